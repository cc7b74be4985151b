// The command-line layer every binary shares: dashed names parse, --help lists our flags with
// dashes and defaults and leaves absl's own out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "cli/flags.h"

ABSL_FLAG(int32_t, kv_test_window, 64, "W: a test flag\nwith two lines");
ABSL_FLAG(std::string, test_model_path, "", "a flag without a default");

namespace subspace::cli {
namespace {

TEST(CliFlagsTest, HelpListsOurFlagsWithDashesAndDefaults) {
  const std::string help = FlagsHelp("cli_flags_test [flags]");
  EXPECT_EQ(help.rfind("Usage: cli_flags_test [flags]\n", 0), 0u) << help;
  EXPECT_NE(help.find("  --kv-test-window=64\n      W: a test flag\n      with two lines\n"),
            std::string::npos)
      << help;
  EXPECT_NE(help.find("  --test-model-path\n      a flag without a default\n"), std::string::npos)
      << help;
  EXPECT_EQ(help.find("kv_test_window"), std::string::npos) << "underscored name in " << help;
  EXPECT_EQ(help.find("--flagfile"), std::string::npos) << "absl's own flags listed: " << help;
  EXPECT_LT(help.find("--kv-test-window"), help.find("--test-model-path")) << "not sorted";
}

TEST(CliFlagsTest, DashedAndUnderscoredNamesParseAlike) {
  std::vector<std::string> raw = {
      "prog", "--kv-test-window=7", "--test_model_path", "a-b.gguf", "pos-arg",
      "--",   "--not-a-flag"};
  std::vector<char*> argv;
  for (std::string& s : raw) argv.push_back(s.data());
  const std::vector<std::string> rest =
      ParseFlags(static_cast<int>(argv.size()), argv.data(), "prog");
  EXPECT_EQ(absl::GetFlag(FLAGS_kv_test_window), 7);
  EXPECT_EQ(absl::GetFlag(FLAGS_test_model_path), "a-b.gguf") << "a value was rewritten";
  EXPECT_EQ(rest, (std::vector<std::string>{"prog", "pos-arg", "--not-a-flag"}));
}

TEST(CliFlagsTest, HelpExitsZeroAndPrintsTheFlags) {
  const auto parse_help = [] {
    std::vector<std::string> raw = {"prog", "--kv-test-window=3", "--help"};
    std::vector<char*> argv;
    for (std::string& s : raw) argv.push_back(s.data());
    ParseFlags(static_cast<int>(argv.size()), argv.data(), "prog [flags]");
  };
  EXPECT_EXIT(parse_help(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace subspace::cli
