// Byte-level BPE (tokenizer.ggml.model = gpt2) against llama.cpp's vocab test vectors for seven
// real vocabularies and their pre-tokenizers, byte-exact round trips, and toy vocabularies built
// in memory for the merge order, ignore_merges, added tokens and the load errors.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/gguf/gguf.h"
#include "core/tokenizer/bpe.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/core/gguf/gguf_test_util.h"
#include "tests/core/tokenizer/vocab_cases.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::FixturePath;
using ::subspace::testing::GgufBuilder;
using ::subspace::testing::ReadVocabCases;
using ::subspace::testing::VocabCase;

struct VocabParam {
  const char* name;  // ggml-vocab-NAME.gguf
  const char* pre;   // its tokenizer.ggml.pre
};

std::string VocabFile(const VocabParam& p) {
  return FixturePath(std::string("gguf/ggml-vocab-") + p.name + ".gguf");
}

std::unique_ptr<Tokenizer> Load(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

class BpeVocabTest : public ::testing::TestWithParam<VocabParam> {
 protected:
  void SetUp() override {
    SUBSPACE_ASSERT_FIXTURE(VocabFile(GetParam()));
    tok_ = Load(VocabFile(GetParam()));
    ASSERT_NE(tok_, nullptr);
  }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_P(BpeVocabTest, Metadata) {
  EXPECT_EQ(tok_->model_name(), "gpt2");
  EXPECT_EQ(tok_->pre_name(), GetParam().pre);
  EXPECT_FALSE(tok_->add_space_prefix());
}

// The acceptance criterion: llama.cpp's expected ids (made by HF tokenizers), without BOS.
TEST_P(BpeVocabTest, MatchesLlamaCppVectors) {
  const std::vector<VocabCase> cases = ReadVocabCases(VocabFile(GetParam()));
  ASSERT_GE(cases.size(), 40u);
  for (const VocabCase& c : cases) {
    EXPECT_EQ(tok_->Encode(c.input, {.add_bos = false}), c.ids) << "input '" << c.input << "'";
  }
}

// Byte-level BPE loses nothing: decoding gives back every input byte.
TEST_P(BpeVocabTest, DecodeRoundTrip) {
  for (const VocabCase& c : ReadVocabCases(VocabFile(GetParam()))) {
    EXPECT_EQ(tok_->Decode(c.ids), c.input);
    EXPECT_EQ(tok_->Decode(tok_->Encode(c.input, {.add_bos = true})), c.input);
  }
}

// Random bytes, valid UTF-8 or not, round-trip when the vocabulary can spell every byte in
// them. Most of these vocabularies leave out the bytes that never occur in UTF-8 (C0, C1,
// F5..FF; a byte without a token is dropped, as in llama.cpp and HF); Falcon's lacks 15 bytes
// that do occur in UTF-8, StarCoder's and Refact's the rare lead byte F1.
TEST_P(BpeVocabTest, RandomBytesRoundTrip) {
  std::vector<char> spellable;
  int utf8_bytes_missing = 0;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    if (tok_->Decode(tok_->Encode(one, {.add_bos = false})) == one) {
      spellable.push_back(one[0]);
    } else if (b != 0xC0 && b != 0xC1 && b < 0xF5) {
      ++utf8_bytes_missing;
    }
  }
  const std::string name = GetParam().name;
  EXPECT_EQ(utf8_bytes_missing, name == "falcon" ? 15 : (name == "starcoder" || name == "refact"));
  if (name == "gpt-2") EXPECT_EQ(spellable.size(), 256u);
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::string text(rng() % 40, '\0');
    for (char& ch : text) ch = spellable[rng() % spellable.size()];
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, {.add_bos = false})), text);
  }
}

TEST_P(BpeVocabTest, StreamDecoderMatchesDecode) {
  for (const VocabCase& c : ReadVocabCases(VocabFile(GetParam()))) {
    StreamDecoder stream(*tok_);
    std::string text;
    for (int32_t id : c.ids) text += stream.Push(id);
    text += stream.Flush();
    EXPECT_EQ(text, c.input);
  }
}

INSTANTIATE_TEST_SUITE_P(
    LlamaCppVocabs, BpeVocabTest,
    ::testing::Values(VocabParam{"gpt-2", "gpt-2"}, VocabParam{"deepseek-llm", "deepseek-llm"},
                      VocabParam{"deepseek-coder", "deepseek-coder"},
                      VocabParam{"falcon", "falcon"}, VocabParam{"starcoder", "starcoder"},
                      VocabParam{"refact", "refact"}, VocabParam{"mpt", "mpt"}),
    [](const ::testing::TestParamInfo<VocabParam>& info) {
      std::string name = info.param.name;
      for (char& c : name) {
        if (c == '-') c = '_';
      }
      return name;
    });

TEST(BpeVocabSpecialTest, Gpt2SpecialTokensAndEndOfGeneration) {
  SUBSPACE_ASSERT_FIXTURE(FixturePath("gguf/ggml-vocab-gpt-2.gguf"));
  std::unique_ptr<Tokenizer> tok = Load(FixturePath("gguf/ggml-vocab-gpt-2.gguf"));
  ASSERT_NE(tok, nullptr);
  constexpr int32_t kEndOfText = 50256;
  EXPECT_EQ(tok->eos_id(), kEndOfText);
  EXPECT_TRUE(tok->IsEndOfGeneration(kEndOfText));
  EXPECT_TRUE(tok->IsControl(kEndOfText));
  EXPECT_FALSE(tok->add_bos());  // gpt2 vocabularies add no BOS unless the file says so
  // Parsed as one token only when asked; otherwise it is text like any other.
  EXPECT_EQ(tok->Encode("a<|endoftext|>", {.add_bos = false, .parse_special = true}),
            (std::vector<int32_t>{64, kEndOfText}));
  const std::vector<int32_t> plain = tok->Encode("a<|endoftext|>", {.add_bos = false});
  EXPECT_GT(plain.size(), 2u);
  EXPECT_EQ(tok->Decode(plain), "a<|endoftext|>");
  // Control tokens decode to nothing; the text around them is kept.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{64, kEndOfText, 64}), "aa");
  EXPECT_EQ(tok->Encode("a", {.add_bos = true, .add_eos = true}),
            (std::vector<int32_t>{kEndOfText, 64, kEndOfText}));
}

// A toy byte-level vocabulary: the 256 byte spellings, then merged tokens.
GgufBuilder ToyBpe(const std::vector<std::string>& extra_tokens,
                   const std::vector<std::string>& merges, const std::string& pre = "gpt-2") {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteLevelBpe::BytesToText(std::string(1, b)));
  tokens.insert(tokens.end(), extra_tokens.begin(), extra_tokens.end());
  GgufBuilder builder;
  builder.AddString("tokenizer.ggml.model", "gpt2")
      .AddString("tokenizer.ggml.pre", pre)
      .AddStringArray("tokenizer.ggml.tokens", tokens)
      .AddStringArray("tokenizer.ggml.merges", merges);
  return builder;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> FromBuilder(const GgufBuilder& builder) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(builder.Build());
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

TEST(ToyBpeTest, LowestRankMergesFirstAndTiesGoLeft) {
  // "abc" with merges rank 0 "b c", rank 1 "a b", rank 2 "a bc": bc forms first, then abc.
  // Had "a b" gone first, the result would be ab + c (no "ab c" merge).
  auto tok = FromBuilder(ToyBpe({"ab", "bc", "abc"}, {"b c", "a b", "a bc"}));
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("abc", {.add_bos = false}), (std::vector<int32_t>{258}));
  // "aaa" with merge "a a": the leftmost pair merges first -> "aa" + "a".
  auto tok2 = FromBuilder(ToyBpe({"aa"}, {"a a"}));
  ASSERT_TRUE(tok2.ok());
  EXPECT_EQ((*tok2)->Encode("aaa", {.add_bos = false}), (std::vector<int32_t>{256, 'a'}));
}

TEST(ToyBpeTest, MergeResultsOutsideTheVocabularyFallBackToBytes) {
  // "x y" is a merge whose result is no token; "xy z" then makes a token from it.
  auto tok = FromBuilder(ToyBpe({"xyz"}, {"x y", "xy z"}));
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("xyz", {.add_bos = false}), (std::vector<int32_t>{256}));
  EXPECT_EQ((*tok)->Encode("xy", {.add_bos = false}), (std::vector<int32_t>{'x', 'y'}));
}

TEST(ToyBpeTest, IgnoreMergesTakesWholeWords) {
  // Llama 3's pre-tokenizer emits a word that is a token as is, even when no merge path
  // reaches it.
  auto llama3 = FromBuilder(ToyBpe({"hello"}, {}, "llama-bpe"));
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  EXPECT_EQ((*llama3)->Encode("hello", {.add_bos = false}), (std::vector<int32_t>{256}));
  EXPECT_FALSE((*llama3)->add_bos());  // llama-bpe's default is to add BOS, but it has none
  auto gpt2 = FromBuilder(ToyBpe({"hello"}, {}));
  ASSERT_TRUE(gpt2.ok());
  EXPECT_EQ((*gpt2)->Encode("hello", {.add_bos = false}).size(), 5u);
}

TEST(ToyBpeTest, LoadErrorsNameTheKey) {
  GgufBuilder no_merges;
  no_merges.AddString("tokenizer.ggml.model", "gpt2")
      .AddStringArray("tokenizer.ggml.tokens", {"a", "b"});
  auto missing = FromBuilder(no_merges);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("tokenizer.ggml.merges"), std::string::npos);

  auto unknown_pre = FromBuilder(ToyBpe({}, {}, "no-such-pre"));
  ASSERT_FALSE(unknown_pre.ok());
  EXPECT_EQ(unknown_pre.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown_pre.status().message().find("no-such-pre"), std::string::npos);

  auto bad_merge = FromBuilder(ToyBpe({}, {"ab"}));
  ASSERT_FALSE(bad_merge.ok());
  EXPECT_NE(bad_merge.status().message().find("tokenizer.ggml.merges[0]"), std::string::npos);

  GgufBuilder unknown_model;
  unknown_model.AddString("tokenizer.ggml.model", "t5")
      .AddStringArray("tokenizer.ggml.tokens", {"a"});
  auto t5 = FromBuilder(unknown_model);
  ASSERT_FALSE(t5.ok());
  EXPECT_NE(t5.status().message().find("tokenizer.ggml.model"), std::string::npos);
}

}  // namespace
}  // namespace subspace
