// Writes the committed seed corpora under fuzz/corpus/ (run by hand after a format change:
//   cmake --build build-fuzz --target fuzz_make_seeds && build-fuzz/bin/fuzz_make_seeds fuzz/corpus
// ). Every seed is small and valid, so the fuzzers start from deep inside each parser.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/compress/basis.h"
#include "core/compress/basis_file.h"
#include "core/compress/codec_file.h"
#include "core/engine/session_snapshot.h"
#include "fuzz/snapshot_setup.h"
#include "proto/subspace.pb.h"
#include "tests/core/gguf/gguf_test_util.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::fuzz {
namespace {

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

void GgufSeeds(const std::filesystem::path& dir) {
  using testing::GgufBuilder;
  Write(dir / "empty_v3.gguf", GgufBuilder(3).Build());
  Write(dir / "empty_v2.gguf", GgufBuilder(2).Build());
  GgufBuilder all;
  all.AddUint8("u8", 1).AddInt8("i8", -1).AddUint16("u16", 2).AddInt16("i16", -2);
  all.AddUint32("u32", 3).AddInt32("i32", -3).AddUint64("u64", 4).AddInt64("i64", -4);
  all.AddFloat32("f32", 0.5f).AddFloat64("f64", 0.25).AddBool("b", true);
  all.AddString("general.architecture", "llama");
  all.AddStringArray("sa", {"a", "bc"}).AddFloatArray("fa", {1, 2}).AddInt32Array("ia", {1, -1});
  Write(dir / "all_types.gguf", all.Build());
  testing::TinyModelOptions o{
      .dim = 8, .heads = 2, .kv_heads = 1, .layers = 1, .ffn = 8, .context = 16};
  Write(dir / "tiny_llama.gguf", testing::BuildTinyLlamaGguf(o));
  // One 2 x 256 tensor of every quantized type: varied bytes, fp16 scales left as they fall.
  GgufBuilder quants;
  for (TensorType type :
       {TensorType::kQ4_0, TensorType::kQ4_1, TensorType::kQ5_0, TensorType::kQ5_1,
        TensorType::kQ8_0, TensorType::kQ2_K, TensorType::kQ3_K, TensorType::kQ4_K,
        TensorType::kQ5_K, TensorType::kQ6_K, TensorType::kIQ4_NL}) {
    std::string bytes(2 * TensorRowBytes(type, 256), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 37 + 11) & 0x3b);
    quants.AddTensor(TensorTypeName(type), {256, 2}, type, bytes);
  }
  Write(dir / "quant_tensors.gguf", quants.Build());
}

void BasisSeeds(const std::filesystem::path& dir) {
  const KvCacheGeometry g{1, 1, 4};
  Basis b = Basis::Zeros(g, {2}, {1});
  float x = 0.5f;
  for (LayerBasis& lb : b.layers)
    for (auto* m : {&lb.p_q, &lb.p_k, &lb.p_v, &lb.r_v})
      for (float& v : *m) v = (x += 0.25f);
  BasisFileInfo info{.method_k = "kqsvd",
                     .method_v = "ksvd",
                     .energy = 0.9,
                     .calibration_tokens = 64,
                     .model_checksum = 42};
  Write(dir / "one_layer.gguf", *SerializeBasisFile(info, b));
  const KvCacheGeometry g2{2, 2, 2};
  info.energy = 0;
  Write(dir / "two_layers.gguf", *SerializeBasisFile(info, Basis::Zeros(g2, {1, 2}, {2, 1})));
  // A transform codec (version 2 of the container): identity bases, widths 0, 2, 3, 8.
  CodecFile codec{
      .info = {.key_bits = 4.0, .value_bits = 4.0, .calibration_tokens = 64, .model_checksum = 42},
      .geometry = g};
  for (auto* side : {&codec.keys, &codec.values}) {
    TransformCode c{.dim = 4, .mean = {0.5f, -0.25f, 0.0f, 1.0f}};
    c.basis.assign(16, 0.0f);
    for (int i = 0; i < 4; ++i) c.basis[i * 5] = 1.0f;
    for (int bits : {0, 2, 3, 8}) {
      c.components.push_back({.bits = bits, .offset = -1.0f, .step = bits ? 0.125f : 0.0f});
    }
    side->push_back(c);
  }
  Write(dir / "codec.gguf", *SerializeCodecFile(codec));
}

void TextSeeds(const std::filesystem::path& dir) {
  const std::vector<std::string> texts = {
      "In the beginning God created the heaven and the earth.",
      " leading space and  double  spaces\n\ttabs",
      "<s>special</s> tokens <unk>",
      "w\xC3\xB6rld \xE2\x82\xAC \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87",
      "\xFF\xFE invalid \xC3 bytes \xED\xA0\x80",
  };
  for (size_t i = 0; i < texts.size(); ++i) Write(dir / ("text" + std::to_string(i)), texts[i]);
}

void RequestSeeds(const std::filesystem::path& dir) {
  v1::GenerateRequest text;
  text.set_text("And God said");
  text.set_request_id("req-1");
  Write(dir / "text.pb", text.SerializeAsString());

  v1::GenerateRequest full;
  full.set_text("Blessed are they that");
  full.set_session_id("session-1");
  v1::SamplingParams* s = full.mutable_sampling();
  s->set_max_new_tokens(16);
  s->set_temperature(0.8f);
  s->set_top_k(40);
  s->set_top_p(0.9f);
  s->set_min_p(0.05f);
  s->set_repetition_penalty(1.1f);
  s->set_seed(7);
  s->add_stop("\n");
  s->add_stop("Amen");
  s->set_logprobs(3);
  s->set_ignore_eos(true);
  Write(dir / "sampling.pb", full.SerializeAsString());

  v1::GenerateRequest tokens;
  for (int id : {1, 15, 300, 2}) tokens.mutable_tokens()->add_ids(id);
  Write(dir / "tokens.pb", tokens.SerializeAsString());

  v1::GenerateRequest bad;
  bad.mutable_tokens()->add_ids(-1);
  bad.mutable_sampling()->set_top_p(1.5f);
  Write(dir / "invalid.pb", bad.SerializeAsString());
}

// A selector byte (session_snapshot_fuzzer.cc), then a snapshot or a raw cache image.
void SnapshotSeeds(const std::filesystem::path& dir) {
  auto paged = SnapshotPagedCache();
  auto compressed = SnapshotCompressedCache();
  const SeqId p = *paged->CreateSequence();
  const SeqId c = *compressed->CreateSequence();
  FillSequence(*paged, p, 10);
  FillSequence(*compressed, c, 22);  // sinks, compressed blocks (some outliers), the window
  const std::string paged_image = *paged->ExportSequence(p);
  const std::string compressed_image = *compressed->ExportSequence(c);
  Write(dir / "paged.image", std::string(1, '\1') + paged_image);
  Write(dir / "compressed.image", std::string(1, '\2') + compressed_image);
  SessionImage s;
  s.id = "0123456789abcdef0123456789abcdef";
  s.owner = "alice";
  s.idle_ttl = absl::Seconds(600);
  s.tokens = {1, 17, 300, 4, 5, 6, 7, 8, 9, 10, 11};
  Write(dir / "tokens_only.session",
        std::string(1, '\0') + EncodeSessionSnapshot(s, kSnapshotIdentity));
  s.cached = 10;
  s.cache = paged_image;
  s.cache_layout = paged->ImageLayout();
  s.refresh = RefreshConfig{.method = RefreshMethod::kFd};
  Write(dir / "paged.session", std::string(1, '\0') + EncodeSessionSnapshot(s, kSnapshotIdentity));
  s.tokens.resize(23, 9);
  s.cached = 22;
  s.cache = compressed_image;
  s.cache_layout = compressed->ImageLayout();
  s.refresh.reset();
  Write(dir / "compressed.session",
        std::string(1, '\0') + EncodeSessionSnapshot(s, kSnapshotIdentity));
  auto transform = SnapshotTransformCache();
  const SeqId t = *transform->CreateSequence();
  FillSequence(*transform, t, 22);  // sinks, coded blocks, the window, a partial block
  const std::string transform_image = *transform->ExportSequence(t);
  Write(dir / "transform.image", std::string(1, '\3') + transform_image);
  // The storage form (range-coded codes) too: the decoder's input.
  Write(dir / "transform_compact.image",
        std::string(1, '\3') + *transform->CompactImage(transform_image));
  // A sequence with online refresh: its image carries the refreshed epochs.
  auto refreshing =
      SnapshotTransformCache({.method = RefreshMethod::kPca, .every_tokens = 8, .max_epochs = 3});
  const SeqId r = *refreshing->CreateSequence();
  FillSequence(*refreshing, r, 72);  // refits need 32 coded rows first
  if (refreshing->Stats().refresh.installed < 2) {
    std::fprintf(stderr, "the refreshing transform cache installed no epochs\n");
    std::exit(1);
  }
  const std::string refreshed_image = *refreshing->ExportSequence(r);
  Write(dir / "transform_refreshed.image", std::string(1, '\3') + refreshed_image);
  Write(dir / "transform_refreshed_compact.image",
        std::string(1, '\3') + *refreshing->CompactImage(refreshed_image));
  s.cache = transform_image;
  s.cache_layout = transform->ImageLayout();
  Write(dir / "transform.session",
        std::string(1, '\0') + EncodeSessionSnapshot(s, kSnapshotIdentity));
}

}  // namespace
}  // namespace subspace::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  subspace::fuzz::GgufSeeds(root / "gguf");
  subspace::fuzz::BasisSeeds(root / "basis_file");
  subspace::fuzz::TextSeeds(root / "tokenizer");
  subspace::fuzz::RequestSeeds(root / "request");
  subspace::fuzz::SnapshotSeeds(root / "session_snapshot");
  return 0;
}
