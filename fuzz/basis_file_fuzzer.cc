// Fuzzes the basis-file reader (GGUF container + subspace.basis.* schema): any bytes give a
// Status or a basis whose every matrix has the size its ranks promise.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/compress/basis_file.h"
#include "core/gguf/gguf.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  auto file = GgufFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
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
