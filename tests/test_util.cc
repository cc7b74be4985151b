#include "tests/test_util.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace subspace::testing {

std::string FixturePath(const std::string& relative) {
  return std::string(SUBSPACE_SOURCE_DIR) + "/tests/data/" + relative;
}
std::string SourcePath(const std::string& relative) {
  return std::string(SUBSPACE_SOURCE_DIR) + "/" + relative;
}
std::string TestDataPath(const std::string& relative) {
  return std::string(SUBSPACE_TEST_DATA_DIR) + "/" + relative;
}
bool FileExists(const std::string& path) { return std::ifstream(path).good(); }
bool InCi() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}
std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TempDir::TempDir(const std::string& prefix) {
  std::string tmpl = std::filesystem::temp_directory_path().string() + "/" + prefix + "_XXXXXX";
  if (const char* gtest_dir = std::getenv("TEST_TMPDIR"); gtest_dir != nullptr) {
    tmpl = std::string(gtest_dir) + "/" + prefix + "_XXXXXX";
  }
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace subspace::testing
