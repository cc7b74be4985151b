// llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf.inp / .out), read the way its
// tests/test-tokenizer-0 reads them: inputs are the bytes between occurrences of
// "\n__ggml_vocab_test__\n" (every input, the last one included, is followed by one), so an
// input keeps its own inner and leading newlines and may be empty; .out has one line of
// space-separated ids per input (no BOS, special tokens not parsed).
#ifndef SUBSPACE_TESTS_CORE_TOKENIZER_VOCAB_CASES_H_
#define SUBSPACE_TESTS_CORE_TOKENIZER_VOCAB_CASES_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace subspace::testing {

struct VocabCase {
  std::string input;
  std::vector<int32_t> ids;
};

inline std::vector<VocabCase> ReadVocabCases(const std::string& gguf_path) {
  const std::string raw = ReadFileOrDie(gguf_path + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  for (size_t pos = 0; pos < raw.size();) {
    size_t next = raw.find(sep, pos);
    if (next == std::string::npos) next = raw.size();
    cases.push_back({raw.substr(pos, next - pos), {}});
    pos = next + sep.size();
  }
  std::istringstream out(ReadFileOrDie(gguf_path + ".out"));
  std::string line;
  size_t i = 0;
  for (; std::getline(out, line); ++i) {
    if (i >= cases.size()) break;
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) cases[i].ids.push_back(id);
  }
  EXPECT_EQ(i, cases.size()) << ".inp and .out disagree on the number of cases";
  return cases;
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_CORE_TOKENIZER_VOCAB_CASES_H_
