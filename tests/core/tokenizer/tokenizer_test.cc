// Tokenizer tests: llama.cpp's own Llama-2 SPM test vectors (the acceptance criterion), decode
// round trips, the streaming decoder's UTF-8 guarantee, and metadata validation on small GGUF
// files built in memory.
#include "core/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/gguf/gguf.h"
#include "tests/core/tokenizer/vocab_cases.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::FileExists;
using ::subspace::testing::FixturePath;
using ::subspace::testing::ReadFileOrDie;
using ::subspace::testing::VocabCase;

constexpr int32_t kLlamaBos = 1;
constexpr int32_t kLlamaEos = 2;
constexpr int32_t kLlamaUnk = 0;
constexpr int32_t kLlamaSpace = 29871;  // "▁"
constexpr int32_t kLlamaHello = 15043;  // "▁Hello"
constexpr int32_t kLlamaWorld = 3186;   // "▁world"
constexpr int32_t kLlamaNewline = 13;   // <0x0A>
constexpr int32_t kLlamaFirstByte = 3;  // <0x00>; <0xHH> is 3 + 0xHH

std::string VocabPath() { return FixturePath("gguf/ggml-vocab-llama-spm.gguf"); }
std::string TinyModelPath() { return FixturePath("gguf/llama-2-tiny-random.gguf"); }

std::vector<VocabCase> ReadVocabCases() { return ::subspace::testing::ReadVocabCases(VocabPath()); }

// Strict UTF-8 check, written independently of the tokenizer's own scanner.
bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    uint32_t cp = 0;
    size_t n = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

std::string Printable(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += c;
    }
  }
  return "'" + out + "'";
}

std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& path, std::string* error) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) {
    *error = file.status().ToString();
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
  if (!tok.ok()) {
    *error = tok.status().ToString();
    return nullptr;
  }
  return *std::move(tok);
}

// Loads the Llama-2 vocab fixture once for the whole suite.
class LlamaVocabTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (FileExists(VocabPath())) tok_ = LoadTokenizer(VocabPath(), &error_).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    SUBSPACE_ASSERT_FIXTURE(VocabPath());
    ASSERT_NE(tok_, nullptr) << error_;
  }
  const Tokenizer& tok() const { return *tok_; }

  static Tokenizer* tok_;
  static std::string error_;
};
Tokenizer* LlamaVocabTest::tok_ = nullptr;
std::string LlamaVocabTest::error_;

TEST_F(LlamaVocabTest, Metadata) {
  EXPECT_EQ(tok().model_name(), "llama");
  EXPECT_EQ(tok().vocab_size(), 32000);
  EXPECT_EQ(tok().bos_id(), kLlamaBos);
  EXPECT_EQ(tok().eos_id(), kLlamaEos);
  EXPECT_EQ(tok().unk_id(), kLlamaUnk);
  EXPECT_TRUE(tok().add_bos());
  EXPECT_TRUE(tok().add_space_prefix());
  EXPECT_EQ(tok().piece(kLlamaBos), "<s>");
  EXPECT_EQ(tok().type(kLlamaBos), TokenType::kControl);
  EXPECT_EQ(tok().type(kLlamaUnk), TokenType::kUnknown);
  EXPECT_EQ(tok().type(kLlamaNewline), TokenType::kByte);
  EXPECT_EQ(tok().piece(kLlamaNewline), "<0x0A>");
  EXPECT_EQ(tok().piece(kLlamaSpace), "\xe2\x96\x81");
  EXPECT_TRUE(tok().IsControl(kLlamaBos));
  EXPECT_FALSE(tok().IsControl(kLlamaHello));
  EXPECT_FALSE(tok().IsControl(-1));
  EXPECT_TRUE(tok().IsEndOfGeneration(kLlamaEos));
  EXPECT_FALSE(tok().IsEndOfGeneration(kLlamaBos));
}

TEST_F(LlamaVocabTest, FixtureFormat) {
  const std::vector<VocabCase> cases = ReadVocabCases();
  ASSERT_EQ(cases.size(), 46u);
  EXPECT_EQ(cases[0].input, "ied 4 \xc2\xbd months");
  EXPECT_EQ(cases[2].input, "");  // an empty input encodes to nothing
  EXPECT_TRUE(cases[2].ids.empty());
  EXPECT_EQ(cases[3].input, " ");
  EXPECT_EQ(cases[7].input, "\n");
  EXPECT_EQ(cases.back().ids.size(), 237u);
}

// The acceptance criterion: llama.cpp's expected ids, byte for byte, without BOS.
TEST_F(LlamaVocabTest, MatchesLlamaCppVectors) {
  for (const VocabCase& c : ReadVocabCases()) {
    EXPECT_EQ(tok().Encode(c.input, {.add_bos = false}), c.ids) << "input " << Printable(c.input);
  }
}

TEST_F(LlamaVocabTest, DecodeRoundTrip) {
  for (const VocabCase& c : ReadVocabCases()) {
    EXPECT_EQ(tok().Decode(c.ids), c.input) << "input " << Printable(c.input);
    std::vector<int32_t> with_bos = tok().Encode(c.input);
    ASSERT_FALSE(with_bos.empty());
    EXPECT_EQ(with_bos[0], kLlamaBos);
    EXPECT_EQ(tok().Decode(with_bos), c.input) << "input " << Printable(c.input);
  }
}

TEST_F(LlamaVocabTest, EmptyText) {
  EXPECT_EQ(tok().Encode(""), std::vector<int32_t>{kLlamaBos});
  EXPECT_TRUE(tok().Encode("", {.add_bos = false}).empty());
  EXPECT_EQ(tok().Decode(std::vector<int32_t>{}), "");
  EXPECT_EQ(tok().Decode(std::vector<int32_t>{kLlamaBos}), "");
}

TEST_F(LlamaVocabTest, TokenToBytes) {
  EXPECT_EQ(tok().TokenToBytes(kLlamaHello), " Hello");
  EXPECT_EQ(tok().TokenToBytes(kLlamaSpace), " ");
  EXPECT_EQ(tok().TokenToBytes(kLlamaNewline), "\n");
  EXPECT_EQ(tok().TokenToBytes(kLlamaFirstByte + 0xF0), "\xf0");
  // Control and unknown tokens are not text (llama.cpp's token_to_piece with special=false;
  // SentencePiece itself would print " \xe2\x81\x87 " for <unk>).
  EXPECT_EQ(tok().TokenToBytes(kLlamaBos), "");
  EXPECT_EQ(tok().TokenToBytes(kLlamaEos), "");
  EXPECT_EQ(tok().TokenToBytes(kLlamaUnk), "");
  EXPECT_EQ(tok().TokenToBytes(-1), "");
  EXPECT_EQ(tok().TokenToBytes(32000), "");
}

// The dummy prefix's space is dropped once, from the first token that has bytes.
TEST_F(LlamaVocabTest, StripLeadingSpace) {
  const std::vector<int32_t> hello = {kLlamaBos, kLlamaHello, kLlamaWorld};
  EXPECT_EQ(tok().Decode(hello), "Hello world");
  EXPECT_EQ(tok().Decode(hello, /*strip_leading_space=*/false), " Hello world");
  EXPECT_EQ(tok().Encode(" Hello", {.add_bos = false}),
            (std::vector<int32_t>{kLlamaSpace, kLlamaHello}));
  EXPECT_EQ(tok().Decode(std::vector<int32_t>{kLlamaSpace, kLlamaHello}), " Hello");
  // No space to strip on the first text token: nothing is stripped later either.
  EXPECT_EQ(tok().Decode(std::vector<int32_t>{kLlamaNewline, kLlamaHello}), "\n Hello");
}

TEST_F(LlamaVocabTest, ParseSpecial) {
  const EncodeOptions special = {.add_bos = false, .parse_special = true};
  EXPECT_EQ(tok().Encode("<s>Hello</s>", special),
            (std::vector<int32_t>{kLlamaBos, kLlamaHello, kLlamaEos}));
  // As in llama.cpp, text after a special token gets the dummy-prefix space again.
  EXPECT_EQ(tok().Encode("Hello</s>world", special),
            (std::vector<int32_t>{kLlamaHello, kLlamaEos, kLlamaWorld}));
  EXPECT_EQ(tok().Encode("<s></s>", special), (std::vector<int32_t>{kLlamaBos, kLlamaEos}));
  EXPECT_EQ(tok().Encode("<s>", {.add_bos = true, .parse_special = true}),
            (std::vector<int32_t>{kLlamaBos, kLlamaBos}));
  EXPECT_EQ(tok().Encode("<unk>", special), std::vector<int32_t>{kLlamaUnk});

  // Without parse_special the same text is plain text and round-trips.
  const std::vector<int32_t> plain = tok().Encode("<s>Hello</s>", {.add_bos = false});
  for (int32_t id : plain) {
    EXPECT_NE(id, kLlamaBos);
    EXPECT_NE(id, kLlamaEos);
  }
  EXPECT_EQ(tok().Decode(plain), "<s>Hello</s>");
}

// An invalid lead byte becomes one byte token and does not drag the next characters into byte
// fallback with it (llama.cpp would take "\xe2AB" as one 3-byte symbol: <0xE2><0x41><0x42>).
TEST_F(LlamaVocabTest, InvalidUtf8SplitsIntoBytes) {
  const std::vector<int32_t> ids = tok().Encode(
      "\xe2"
      "AB",
      {.add_bos = false});
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], kLlamaSpace);
  EXPECT_EQ(ids[1], kLlamaFirstByte + 0xE2);
  for (size_t i = 2; i < ids.size(); ++i) {
    EXPECT_FALSE(ids[i] >= kLlamaFirstByte && ids[i] < kLlamaFirstByte + 256) << ids[i];
  }
  EXPECT_EQ(tok().Decode(ids),
            "\xe2"
            "AB");

  // A sequence cut off at the end of the text: each byte on its own.
  const std::vector<int32_t> cut = tok().Encode("a\xf0\x9f\xa6", {.add_bos = false});
  ASSERT_GE(cut.size(), 3u);
  EXPECT_EQ(std::vector<int32_t>(cut.end() - 3, cut.end()),
            (std::vector<int32_t>{kLlamaFirstByte + 0xF0, kLlamaFirstByte + 0x9F,
                                  kLlamaFirstByte + 0xA6}));
  EXPECT_EQ(tok().Decode(cut), "a\xf0\x9f\xa6");
}

TEST_F(LlamaVocabTest, RandomBytesRoundTrip) {
  std::mt19937 rng(20240607);
  for (size_t length : {1u, 2u, 3u, 4u, 7u, 64u, 1000u, 20000u}) {
    for (int round = 0; round < 4; ++round) {
      std::string bytes(length, '\0');
      for (char& c : bytes) c = static_cast<char>(rng() & 0xFF);
      // A literal "▁" in the input decodes as a space, the one thing that cannot round-trip.
      for (size_t p = bytes.find("\xe2\x96\x81"); p != std::string::npos;
           p = bytes.find("\xe2\x96\x81", p)) {
        bytes[p + 2] = 'x';
      }
      const std::vector<int32_t> ids = tok().Encode(bytes);
      for (int32_t id : ids) {
        ASSERT_GE(id, 0);
        ASSERT_LT(id, tok().vocab_size());
        ASSERT_NE(id, kLlamaUnk);  // byte fallback covers every byte
      }
      ASSERT_EQ(tok().Decode(ids), bytes) << "length " << length;

      StreamDecoder stream(tok());
      std::string streamed;
      for (int32_t id : ids) {
        const std::string piece = stream.Push(id);
        ASSERT_TRUE(IsValidUtf8(piece));
        streamed += piece;
      }
      const std::string rest = stream.Flush();
      ASSERT_TRUE(IsValidUtf8(rest));
    }
  }
}

TEST_F(LlamaVocabTest, StreamDecoderMatchesDecode) {
  for (const VocabCase& c : ReadVocabCases()) {
    const std::vector<int32_t> ids = tok().Encode(c.input);
    StreamDecoder stream(tok());
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = stream.Push(id);
      EXPECT_TRUE(IsValidUtf8(piece)) << "input " << Printable(c.input);
      streamed += piece;
    }
    streamed += stream.Flush();
    EXPECT_EQ(streamed, tok().Decode(ids)) << "input " << Printable(c.input);
    EXPECT_EQ(streamed, c.input);
  }
}

// "🦙" (F0 9F A6 99) has no token of its own: three byte tokens are held back, the fourth
// completes the code point.
TEST_F(LlamaVocabTest, StreamDecoderHoldsBackPartialCodePoints) {
  const std::vector<int32_t> ids =
      tok().Encode(" this is \xf0\x9f\xa6\x99.cpp", {.add_bos = false});
  ASSERT_EQ(ids, (std::vector<int32_t>{29871, 445, 338, 29871, 243, 162, 169, 156, 29889, 8223}));
  StreamDecoder stream(tok());
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(stream.Push(id));
  // The first "▁" is the dummy prefix's space and is dropped, as Decode does.
  EXPECT_EQ(pieces, (std::vector<std::string>{"", " this", " is", " ", "", "", "",
                                              "\xf0\x9f\xa6\x99", ".", "cpp"}));
  EXPECT_EQ(stream.Flush(), "");
}

TEST_F(LlamaVocabTest, StreamDecoderReplacesInvalidBytes) {
  auto byte = [](int b) { return kLlamaFirstByte + b; };
  {
    StreamDecoder stream(tok(), /*strip_leading_space=*/false);
    EXPECT_EQ(stream.Push(byte(0xE2)), "");
    EXPECT_EQ(stream.Push(byte(0x96)), "");
    // 'A' can never continue E2 96: the held bytes become one U+FFFD, then 'A' goes out.
    EXPECT_EQ(stream.Push(byte('A')),
              "\xef\xbf\xbd"
              "A");
    EXPECT_EQ(stream.Flush(), "");
  }
  {
    StreamDecoder stream(tok());
    EXPECT_EQ(stream.Push(byte(0x80)), "\xef\xbf\xbd");  // stray continuation byte
    EXPECT_EQ(stream.Push(byte(0xF0)), "");
    EXPECT_EQ(stream.Push(kLlamaBos), "");      // control tokens add nothing
    EXPECT_EQ(stream.Flush(), "\xef\xbf\xbd");  // cut off at the end
    EXPECT_EQ(stream.Flush(), "");
  }
  {
    StreamDecoder stream(tok());
    EXPECT_EQ(stream.Push(byte(0xED)), "");
    EXPECT_EQ(stream.Push(byte(0xA0)), "\xef\xbf\xbd\xef\xbf\xbd");  // a surrogate, never valid
  }
  {
    StreamDecoder stream(tok());
    EXPECT_EQ(stream.Push(kLlamaBos), "");
    EXPECT_EQ(stream.Push(kLlamaHello), "Hello");  // leading space stripped, as in Decode
    EXPECT_EQ(stream.Push(kLlamaWorld), " world");
  }
}

// Tests never assert on time; this one prints it and checks the result on ~100 KB of text,
// including the long runs of one character that would expose quadratic merging.
TEST_F(LlamaVocabTest, LargeInput) {
  std::string text;
  const std::vector<VocabCase> cases = ReadVocabCases();
  while (text.size() < 100000) {
    for (const VocabCase& c : cases) text += c.input + " ";
  }
  const std::vector<std::string> inputs = {text, std::string(100000, ' '), std::string(100000, 'a'),
                                           std::string(100000, '\n')};
  for (const std::string& input : inputs) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok().Encode(input);
    const auto end = std::chrono::steady_clock::now();
    std::cout << "[ INFO     ] encoded " << input.size() << " bytes into " << ids.size()
              << " tokens in " << std::chrono::duration<double, std::milli>(end - start).count()
              << " ms\n";
    EXPECT_EQ(tok().Decode(ids), input);
  }
}

TEST_F(LlamaVocabTest, TinyRandomModelHasTheSameVocab) {
  SUBSPACE_ASSERT_FIXTURE(TinyModelPath());
  std::string error;
  std::unique_ptr<Tokenizer> tiny = LoadTokenizer(TinyModelPath(), &error);
  ASSERT_NE(tiny, nullptr) << error;
  EXPECT_EQ(tiny->vocab_size(), tok().vocab_size());
  EXPECT_EQ(tiny->bos_id(), tok().bos_id());
  EXPECT_EQ(tiny->eos_id(), tok().eos_id());
  for (const VocabCase& c : ReadVocabCases()) {
    EXPECT_EQ(tiny->Encode(c.input), tok().Encode(c.input)) << "input " << Printable(c.input);
  }
  EXPECT_EQ(tiny->Encode("Hello world", {.add_bos = false}),
            (std::vector<int32_t>{kLlamaHello, kLlamaWorld}));
}

// --- Small vocabularies written as GGUF in memory -------------------------------------------

// Writes GGUF v3 metadata (no tensors), enough for Tokenizer::FromGguf.
class GgufBuilder {
 public:
  GgufBuilder& String(const std::string& key, const std::string& value) {
    Key(key, GgufValueType::kString);
    Str(value);
    return *this;
  }
  GgufBuilder& Uint32(const std::string& key, uint32_t value) {
    Key(key, GgufValueType::kUint32);
    Pod(value);
    return *this;
  }
  GgufBuilder& Bool(const std::string& key, bool value) {
    Key(key, GgufValueType::kBool);
    Pod(static_cast<uint8_t>(value));
    return *this;
  }
  GgufBuilder& Strings(const std::string& key, const std::vector<std::string>& values) {
    ArrayHeader(key, GgufValueType::kString, values.size());
    for (const std::string& v : values) Str(v);
    return *this;
  }
  GgufBuilder& Floats(const std::string& key, const std::vector<float>& values) {
    ArrayHeader(key, GgufValueType::kFloat32, values.size());
    for (float v : values) Pod(v);
    return *this;
  }
  GgufBuilder& Int32s(const std::string& key, const std::vector<int32_t>& values) {
    ArrayHeader(key, GgufValueType::kInt32, values.size());
    for (int32_t v : values) Pod(v);
    return *this;
  }
  std::string Build() const {
    std::string out = "GGUF";
    auto put = [&out](const auto& v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    put(uint32_t{3});
    put(uint64_t{0});  // tensors
    put(count_);
    return out + kv_;
  }

 private:
  template <typename T>
  void Pod(T v) {
    kv_.append(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  void Str(const std::string& s) {
    Pod(static_cast<uint64_t>(s.size()));
    kv_ += s;
  }
  void Key(const std::string& key, GgufValueType type) {
    ++count_;
    Str(key);
    Pod(static_cast<uint32_t>(type));
  }
  void ArrayHeader(const std::string& key, GgufValueType elem, size_t n) {
    Key(key, GgufValueType::kArray);
    Pod(static_cast<uint32_t>(elem));
    Pod(static_cast<uint64_t>(n));
  }

  std::string kv_;
  uint64_t count_ = 0;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> FromBuilder(const GgufBuilder& builder) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(builder.Build());
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

// A toy vocabulary without byte tokens: 0 <unk>, 1 <s>, 2 </s>, 3 ▁, 4 a, 5 b, 6 c, 7 ab,
// 8 bc, 9 <tool> (user-defined).
GgufBuilder ToyVocab(float ab_score, float bc_score) {
  GgufBuilder b;
  b.String("tokenizer.ggml.model", "llama")
      .Strings("tokenizer.ggml.tokens",
               {"<unk>", "<s>", "</s>", "\xe2\x96\x81", "a", "b", "c", "ab", "bc", "<tool>"})
      .Floats("tokenizer.ggml.scores", {0, 0, 0, -1, -2, -2, -2, ab_score, bc_score, 0})
      .Int32s("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1, 1, 1, 1, 4})
      .Uint32("tokenizer.ggml.bos_token_id", 1)
      .Uint32("tokenizer.ggml.eos_token_id", 2)
      .Uint32("tokenizer.ggml.unknown_token_id", 0)
      .Bool("tokenizer.ggml.add_space_prefix", false);
  return b;
}

TEST(ToyVocabTest, HighestScoreMergesFirstAndTiesGoLeft) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tie = FromBuilder(ToyVocab(-1, -1));
  ASSERT_TRUE(tie.ok()) << tie.status();
  EXPECT_FALSE((*tie)->add_space_prefix());
  EXPECT_EQ((*tie)->Encode("abc", {.add_bos = false}), (std::vector<int32_t>{7, 6}));

  absl::StatusOr<std::unique_ptr<Tokenizer>> right = FromBuilder(ToyVocab(-1, -0.5f));
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_EQ((*right)->Encode("abc", {.add_bos = false}), (std::vector<int32_t>{4, 8}));
}

TEST(ToyVocabTest, UnknownWithoutByteTokensAndUserDefinedAlwaysParsed) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromBuilder(ToyVocab(-1, -1));
  ASSERT_TRUE(tok.ok()) << tok.status();
  // "z" has no piece and there are no byte tokens: UNK, which decodes to nothing.
  const std::vector<int32_t> ids = (*tok)->Encode("az b", {.add_bos = false});
  EXPECT_EQ(ids, (std::vector<int32_t>{4, 0, 3, 5}));
  EXPECT_EQ((*tok)->Decode(ids), "a b");
  // User-defined tokens are split out even without parse_special, and decode verbatim.
  EXPECT_EQ((*tok)->Encode("a<tool>b", {.add_bos = false}), (std::vector<int32_t>{4, 9, 5}));
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{4, 9, 5}), "a<tool>b");
}

// Phi-3's SentencePiece vocabulary (Llama 2's plus chat tokens such as <|end|>, which ends
// generation): llama.cpp's vectors too.
TEST(Phi3VocabTest, MatchesLlamaCppVectors) {
  const std::string path = FixturePath("gguf/ggml-vocab-phi-3.gguf");
  SUBSPACE_ASSERT_FIXTURE(path);
  std::string error;
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(path, &error);
  ASSERT_NE(tok, nullptr) << error;
  EXPECT_EQ(tok->model_name(), "llama");
  EXPECT_EQ(tok->pre_name(), "");
  const std::vector<VocabCase> cases = ::subspace::testing::ReadVocabCases(path);
  ASSERT_GE(cases.size(), 40u);
  for (const VocabCase& c : cases) {
    EXPECT_EQ(tok->Encode(c.input, {.add_bos = false}), c.ids) << "input " << Printable(c.input);
    EXPECT_EQ(tok->Decode(c.ids), c.input) << "input " << Printable(c.input);
  }
  constexpr int32_t kEnd = 32007;  // <|end|>
  EXPECT_EQ(tok->piece(kEnd), "<|end|>");
  EXPECT_TRUE(tok->IsEndOfGeneration(kEnd));
  EXPECT_TRUE(tok->IsEndOfGeneration(tok->eos_id()));
  EXPECT_EQ(tok->Encode("<|end|>", {.add_bos = false, .parse_special = true}),
            std::vector<int32_t>{kEnd});
}

TEST(ToyVocabTest, Defaults) {
  GgufBuilder b;
  b.String("tokenizer.ggml.model", "llama")
      .Strings("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\xe2\x96\x81", "a"});
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromBuilder(b);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_TRUE((*tok)->add_bos());
  EXPECT_TRUE((*tok)->add_space_prefix());
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_EQ((*tok)->unk_id(), 0);
  EXPECT_EQ((*tok)->Encode("a"), (std::vector<int32_t>{1, 3, 4}));
}

TEST(ToyVocabTest, RejectsBadMetadata) {
  auto expect_invalid = [](const GgufBuilder& b, const std::string& needle) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = FromBuilder(b);
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << tok.status();
    EXPECT_NE(tok.status().message().find(needle), std::string::npos) << tok.status();
  };
  const std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "a"};

  expect_invalid(
      GgufBuilder().String("tokenizer.ggml.model", "gpt2").Strings("tokenizer.ggml.tokens", tokens),
      "gpt2");
  expect_invalid(GgufBuilder().Strings("tokenizer.ggml.tokens", tokens), "tokenizer.ggml.model");
  expect_invalid(GgufBuilder().String("tokenizer.ggml.model", "llama"), "tokenizer.ggml.tokens");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", tokens)
                     .Floats("tokenizer.ggml.scores", {0, 0, 0}),
                 "scores");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", tokens)
                     .Int32s("tokenizer.ggml.token_type", {2, 3, 3, 1, 1}),
                 "token_type");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", tokens)
                     .Int32s("tokenizer.ggml.token_type", {2, 3, 3, 9}),
                 "token_type[3]");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", tokens)
                     .Uint32("tokenizer.ggml.eos_token_id", 4),
                 "eos_token_id");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", tokens)
                     .Int32s("tokenizer.ggml.token_type", {2, 3, 3, 6}),
                 "<0xHH>");
  expect_invalid(GgufBuilder()
                     .String("tokenizer.ggml.model", "llama")
                     .Strings("tokenizer.ggml.tokens", {"a"}),  // default BOS 1 does not exist
                 "add_bos_token");
}

}  // namespace
}  // namespace subspace
