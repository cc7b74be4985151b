// A GGUF model file opened whole -- the mapped file, its tokenizer and its weights -- as the
// server and every tool open their --model.
#ifndef SUBSPACE_CORE_MODEL_MODEL_FILE_H_
#define SUBSPACE_CORE_MODEL_MODEL_FILE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"

namespace subspace {

struct ModelFile {
  std::shared_ptr<const GgufFile> gguf;  // the model keeps it mapped too
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LlamaModel> model;
};

// Whatever GgufFile::Open, Tokenizer::FromGguf or LlamaModel::Load refuses, with its status.
absl::StatusOr<ModelFile> OpenModelFile(const std::string& path);

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_MODEL_FILE_H_
