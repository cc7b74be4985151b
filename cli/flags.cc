#include "cli/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace subspace::cli {

std::vector<std::string> NormalizeDashFlags(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;  // everything after is positional
    // Only `--name` forms: a single-dash argument may be a negative number or a value.
    if (a.size() < 3 || a[0] != '-' || a[1] != '-') continue;
    size_t end = a.find('=');
    if (end == std::string::npos) end = a.size();
    for (size_t j = 2; j < end; ++j) {
      if (a[j] == '-') a[j] = '_';
    }
  }
  for (size_t i = 0; i < args.size(); ++i) argv[i] = args[i].data();
  return args;
}

std::string FlagsHelp(const std::string& usage) {
  std::vector<const absl::CommandLineFlag*> ours;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    // absl's own flags (--flagfile, --fromenv, ...) are defined under absl/.
    if (flag->IsRetired() || absl::StrContains(flag->Filename(), "absl/")) continue;
    ours.push_back(flag);
  }
  std::sort(ours.begin(), ours.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat("Usage: ", usage, "\n\nFlags:\n");
  for (const absl::CommandLineFlag* f : ours) {
    const std::string name = absl::StrReplaceAll(f->Name(), {{"_", "-"}});
    const std::string def = f->DefaultValue();
    absl::StrAppend(&out, "  --", name, def.empty() ? "" : absl::StrCat("=", def), "\n      ",
                    absl::StrReplaceAll(f->Help(), {{"\n", "\n      "}}), "\n");
  }
  absl::StrAppend(&out,
                  "\nFlags take dashes or underscores: --kv-cache-bytes = --kv_cache_bytes.\n");
  return out;
}

void ExitOnHelp(const std::vector<std::string>& args, const std::string& usage) {
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;
    if (a == "--help" || a == "-h" || a == "--helpfull" || a == "-help") {
      std::fputs(FlagsHelp(usage).c_str(), stdout);
      std::exit(0);
    }
  }
}

std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage) {
  static std::vector<std::string> storage;  // argv points into it for the program's life
  storage = NormalizeDashFlags(argc, argv);
  ExitOnHelp(storage, usage);
  absl::SetProgramUsageMessage(usage);
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  return std::vector<std::string>(rest.begin(), rest.end());
}

}  // namespace subspace::cli
