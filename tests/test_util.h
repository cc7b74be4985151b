// Shared helpers for the test suites: where the fixtures live and how to skip or fail
// when they are missing.
#ifndef SUBSPACE_TESTS_TEST_UTIL_H_
#define SUBSPACE_TESTS_TEST_UTIL_H_

#include <string>

namespace subspace::testing {

// Absolute path of a file under ../shared (the fixtures shipped beside the checkout).
std::string SharedPath(const std::string& relative);
// Absolute path of a file under the repository root.
std::string SourcePath(const std::string& relative);
// Absolute path under the build's test_data folder (written by tests/reference/).
std::string TestDataPath(const std::string& relative);
bool FileExists(const std::string& path);
// True when running under CI (env CI=true): missing fixtures must fail, not skip.
bool InCi();
std::string ReadFileOrDie(const std::string& path);

}  // namespace subspace::testing

// Skips the test when `path` is missing locally; fails it under CI.
#define SUBSPACE_REQUIRE_FILE(path)                                          \
  do {                                                                       \
    if (!::subspace::testing::FileExists(path)) {                            \
      if (::subspace::testing::InCi()) FAIL() << "missing fixture " << path; \
      GTEST_SKIP() << "fixture not present: " << path;                       \
    }                                                                        \
  } while (0)

#endif  // SUBSPACE_TESTS_TEST_UTIL_H_
