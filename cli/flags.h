// Command-line parsing shared by every binary: absl flags, spelled with dashes as the README
// writes them (`--kv-cache-bytes`; `--kv_cache_bytes` works too), and a --help that lists them.
#ifndef SUBSPACE_CLI_FLAGS_H_
#define SUBSPACE_CLI_FLAGS_H_

#include <string>
#include <vector>

namespace subspace::cli {

// Rewrites `--a-b` to `--a_b` in argv (flag names only, never values; nothing after `--`).
// argv then points into the returned strings: keep them alive while argv is used.
std::vector<std::string> NormalizeDashFlags(int argc, char** argv);

// The --help text: `usage`, then every flag defined in this repository's sources (absl's own
// left out), sorted, as `--name-with-dashes=<default>  help`.
std::string FlagsHelp(const std::string& usage);

// When `args` (argv[0] first) ask for help (--help, -h, --helpfull) before any `--`: prints
// FlagsHelp(usage) to stdout and exits 0.
void ExitOnHelp(const std::vector<std::string>& args, const std::string& usage);

// Parses the command line. --help, -h or --helpfull print FlagsHelp(usage) to stdout and exit 0;
// a bad flag prints absl's error and exits 1. Returns the positional arguments, argv[0] first.
std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage);

}  // namespace subspace::cli

#endif  // SUBSPACE_CLI_FLAGS_H_
