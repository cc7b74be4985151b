// Fuzzes the basis-file readers (GGUF container + subspace.basis.* schema), the low-rank basis
// (version 1) and the transform codec (version 2): any bytes give a Status, or a basis whose
// every matrix has the size its ranks promise, or a codec that validates, re-serialises and
// codes a row.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/compress/basis_file.h"
#include "core/compress/codec_file.h"
#include "core/gguf/gguf.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  auto file = GgufFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  if (absl::StatusOr<CodecFile> codec = ParseCodecFile(**file); codec.ok()) {
    FUZZ_CHECK(ValidateCodecFile(*codec).ok());
    absl::StatusOr<std::string> bytes = SerializeCodecFile(*codec);
    FUZZ_CHECK(bytes.ok());
    auto again = GgufFile::FromBytes(*std::move(bytes));
    FUZZ_CHECK(again.ok());
    FUZZ_CHECK(ParseCodecFile(**again).ok());
    const TransformCode& k = codec->keys[0];
    std::vector<float> row(static_cast<size_t>(k.dim), 0.5f);
    std::vector<uint8_t> codes(static_cast<size_t>(k.BytesPerRow()));
    k.Encode(row.data(), codes.data());
    k.Decode(codes.data(), row.data());
  }
  absl::StatusOr<BasisFile> parsed = ParseBasisFile(**file);
  if (!parsed.ok()) return 0;
  const KvCacheGeometry& g = parsed->basis.geometry;
  FUZZ_CHECK(static_cast<int>(parsed->basis.layers.size()) == g.n_layers);
  // Re-serialising what was read must succeed and read back the same (a consistent basis).
  absl::StatusOr<std::string> bytes = SerializeBasisFile(parsed->info, parsed->basis);
  FUZZ_CHECK(bytes.ok());
  auto again = GgufFile::FromBytes(*std::move(bytes));
  FUZZ_CHECK(again.ok());
  absl::StatusOr<BasisFile> reparsed = ParseBasisFile(**again);
  FUZZ_CHECK(reparsed.ok());
  FUZZ_CHECK(reparsed->basis.layers.size() == parsed->basis.layers.size());
  (void)CheckBasisMatchesModel(*parsed, g, parsed->info.model_checksum);
  return 0;
}
