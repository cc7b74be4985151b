#include "tests/test_util.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

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

}  // namespace subspace::testing
