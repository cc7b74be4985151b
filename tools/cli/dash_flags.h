// Lets command lines use `--kv-cache-bytes` style names with absl flags, whose names are
// identifiers: dashes in a flag's name (not its value) become underscores before parsing.
#ifndef SUBSPACE_TOOLS_CLI_DASH_FLAGS_H_
#define SUBSPACE_TOOLS_CLI_DASH_FLAGS_H_

#include <string>
#include <vector>

namespace subspace::cli {

// Rewrites argv in place-owned storage; keep the returned vector alive while argv is used.
inline std::vector<std::string> NormalizeDashFlags(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;  // everything after is positional
    // Only `--name` forms: a single-dash argument may be a negative number or a value.
    if (a.size() < 3 || a[0] != '-' || a[1] != '-') continue;
    const size_t start = 2;
    size_t end = a.find('=');
    if (end == std::string::npos) end = a.size();
    for (size_t j = start; j < end; ++j) {
      if (a[j] == '-') a[j] = '_';
    }
  }
  for (size_t i = 0; i < args.size(); ++i) argv[i] = args[i].data();
  return args;
}

}  // namespace subspace::cli

#endif  // SUBSPACE_TOOLS_CLI_DASH_FLAGS_H_
