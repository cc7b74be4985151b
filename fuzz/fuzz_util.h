// Shared helpers for the libFuzzer targets: the committed default model's tokenizer and config,
// loaded once per process, and a strict UTF-8 check independent of the code under test.
#ifndef SUBSPACE_FUZZ_FUZZ_UTIL_H_
#define SUBSPACE_FUZZ_FUZZ_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"

namespace subspace::fuzz {

struct FuzzModel {
  std::unique_ptr<GgufFile> file;
  ModelConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
};

// models/subspace-tiny.gguf (only its metadata is read). Aborts when it cannot be loaded: a
// fuzzer without its model would report nothing useful.
inline const FuzzModel& DefaultModel() {
  static const FuzzModel* model = [] {
    const std::string path = std::string(SUBSPACE_SOURCE_DIR) + "/models/subspace-tiny.gguf";
    auto file = GgufFile::Open(path);
    if (!file.ok()) {
      std::fprintf(stderr, "fuzz: cannot open %s: %s\n", path.c_str(),
                   file.status().ToString().c_str());
      std::abort();
    }
    auto* m = new FuzzModel;
    m->file = *std::move(file);
    auto config = ModelConfig::FromGguf(*m->file);
    auto tokenizer = Tokenizer::FromGguf(*m->file);
    if (!config.ok() || !tokenizer.ok()) {
      std::fprintf(stderr, "fuzz: bad default model\n");
      std::abort();
    }
    m->config = *config;
    m->tokenizer = *std::move(tokenizer);
    return m;
  }();
  return *model;
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF.
inline bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned char c = p[i];
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

// Crash with a message: libFuzzer records the input that got here.
#define FUZZ_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

}  // namespace subspace::fuzz

#endif  // SUBSPACE_FUZZ_FUZZ_UTIL_H_
