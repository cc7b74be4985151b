#include "core/model/model_file.h"

#include <utility>

namespace subspace {

absl::StatusOr<ModelFile> OpenModelFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  ModelFile m;
  m.gguf = *std::move(file);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*m.gguf);
  if (!tokenizer.ok()) return tokenizer.status();
  m.tokenizer = *std::move(tokenizer);
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(m.gguf);
  if (!model.ok()) return model.status();
  m.model = *std::move(model);
  return m;
}

}  // namespace subspace
