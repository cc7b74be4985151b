// Shared helpers for the test suites: where the fixtures live and how to skip or fail
// when they are missing.
#ifndef SUBSPACE_TESTS_TEST_UTIL_H_
#define SUBSPACE_TESTS_TEST_UTIL_H_

#include <string>
#include <vector>

namespace subspace::testing {

// Absolute path of a fixture under tests/data/ (files from other projects, in the repository
// with their source and licence: tests/data/README.md).
std::string FixturePath(const std::string& relative);
// Absolute path of a file under the repository root.
std::string SourcePath(const std::string& relative);
// Absolute path under the build's test_data folder (written by tests/reference/).
std::string TestDataPath(const std::string& relative);
bool FileExists(const std::string& path);
// True when running under CI (env CI=true): missing fixtures must fail, not skip.
bool InCi();
std::string ReadFileOrDie(const std::string& path);

// A fresh directory under the test's temporary folder, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "subspace");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};
// The names of the entries of `dir`, sorted (empty when it cannot be read).
std::vector<std::string> FilesIn(const std::string& dir);

}  // namespace subspace::testing

// Fails the test when a fixture of tests/data/ is missing (they are in the repository).
#define SUBSPACE_ASSERT_FIXTURE(path) \
  ASSERT_TRUE(::subspace::testing::FileExists(path)) << "missing fixture " << (path)

// Skips the test when a generated file (TestDataPath) is missing locally; fails it under CI.
#define SUBSPACE_REQUIRE_FILE(path)                                          \
  do {                                                                       \
    if (!::subspace::testing::FileExists(path)) {                            \
      if (::subspace::testing::InCi()) FAIL() << "missing fixture " << path; \
      GTEST_SKIP() << "fixture not present: " << path;                       \
    }                                                                        \
  } while (0)

#endif  // SUBSPACE_TESTS_TEST_UTIL_H_
