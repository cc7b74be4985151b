// CudaLlamaModel start-up: the options checked, the one device allocation sized and carved,
// the weights uploaded as fp16 (fused [wq; wk; wv] and [w_gate; w_up]) and the KV cache created
// over it. The step is cuda_model_step.cc.
#include "cuda/cuda_model.h"

#include "cuda/cuda_model_impl.h"

namespace subspace::cuda {
namespace {

absl::Status CheckOptions(const ModelConfig& m, const CudaModelOptions& o) {
  if (o.max_batch_tokens < 1 || o.max_sequences < 1 || o.max_sequences > 65535) {
    return absl::InvalidArgumentError(
        "CUDA backend: max_batch_tokens must be >= 1 and max_sequences in [1, 65535]");
  }
  if (o.block_size < 1 || o.block_size > kernels::kMaxBlockSize) {
    return absl::InvalidArgumentError(absl::StrFormat("CUDA backend: block size %d outside [1, %d]",
                                                      o.block_size, kernels::kMaxBlockSize));
  }
  if (o.kv_cache_bytes < 0 || !(o.gpu_memory_fraction >= 0.0 && o.gpu_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        "CUDA backend: kv_cache_bytes must be >= 0 and gpu_memory_fraction in [0, 1]");
  }
  if (o.kv_cache_bytes == 0 && o.gpu_memory_fraction == 0.0) {
    return absl::InvalidArgumentError(
        "CUDA backend: set the KV pool by kv_cache_bytes or gpu_memory_fraction");
  }
  if (m.head_dim != 64 && m.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CUDA backend: head_dim %d; the attention kernels support 64 and 128", m.head_dim));
  }
  if (o.compressed && o.transform) {
    return absl::InvalidArgumentError("CUDA backend: one KV cache kind, compressed or transform");
  }
  if (m.rope_dim % 2 != 0 || m.rope_dim > m.head_dim) {
    return absl::InvalidArgumentError("CUDA backend: rope_dim must be even and <= head_dim");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CudaBackend> CreateCudaBackend(const LlamaModel& model,
                                              const CudaModelOptions& options) {
  const ModelConfig& m = model.config();
  if (absl::Status st = CheckOptions(m, options); !st.ok()) return st;
  std::string why;
  const std::vector<kernels::CudaDeviceInfo> devices = kernels::ListCudaDevices(&why);
  if (options.device < 0 || options.device >= static_cast<int>(devices.size())) {
    return absl::UnavailableError(absl::StrFormat("CUDA device %d not available (%d found)%s",
                                                  options.device, devices.size(),
                                                  why.empty() ? "" : absl::StrCat(": ", why)));
  }
  const kernels::CudaDeviceInfo& dev = devices[static_cast<size_t>(options.device)];
  if (absl::Status st = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !st.ok()) {
    return st;
  }

  auto impl = std::make_unique<CudaLlamaModel::Impl>();
  CudaLlamaModel::Impl& s = *impl;
  s.config = m;
  s.program = model.program();
  // A sliding window is masked by the attention kernels, as on the CPU; the step's plan is made
  // once for every layer, so the layers must share it.
  s.sliding_window = -1;
  for (const DecoderOp& op : s.program.ops) {
    if (op.kind != OpKind::kAttention) continue;
    if (s.sliding_window >= 0 && op.window != s.sliding_window) {
      return absl::UnimplementedError(
          "CUDA backend: layers with different sliding windows (the step is planned once)");
    }
    s.sliding_window = op.window;
  }
  s.sliding_window = std::max(s.sliding_window, 0);
  s.options = options;
  s.device_name = absl::StrFormat("cuda:%d (%s)", dev.index, dev.name);
  // Decode split-K: 8 CTAs per multiprocessor. On an H200 (2026-11-28, bench/RESULTS.md) 8
  // against 2 took the full-rank kernel from 10-15 % to 20-26 % of copy bandwidth at batch >= 8
  // and was never slower; until the kernel is rebuilt (issue 32) more CTAs hide its latency.
  s.target_ctas = 8 * dev.multiprocessors;
  s.max_blocks_per_seq = CeilDiv(s.config.context_length, options.block_size);
  if (options.compressed) {
    if (absl::Status st = s.LayoutCompressedLayers(); !st.ok()) return st;
    s.query_readback_rows = s.QueryReadbackRows();
  }
  if (options.transform) {
    if (absl::Status st = DeviceTransformKvCache::Validate(s.TransformCacheConfig()); !st.ok()) {
      return st;
    }
    s.layouts = DeviceTransformKvCache::Layouts(s.TransformCacheConfig());
  }

  // Size everything but the pool, then the pool from what is left. One page id costs a page in
  // every layer, compressed cache or not.
  const int64_t block_bytes =
      DevicePagedKvCache::BlockBytes(m.cache_geometry(), options.block_size);
  int64_t kv_bytes = options.kv_cache_bytes;
  {
    // The plan bound depends on the pool's block count; size it for the pool first guessed.
    const int64_t guess = kv_bytes > 0
                              ? kv_bytes
                              : static_cast<int64_t>(options.gpu_memory_fraction *
                                                     static_cast<double>(dev.total_memory_bytes));
    s.LayoutMeta(guess / block_bytes);
    Carver count(nullptr, 0);
    s.CarveBuffers(count);
    s.CarvePool(count, 0);
    if (kv_bytes == 0) {
      kv_bytes = guess - count.used();
      if (kv_bytes < block_bytes) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "CUDA backend: gpu_memory_fraction %g of %d MiB leaves no KV pool after %d MiB of "
            "weights and buffers",
            options.gpu_memory_fraction, dev.total_memory_bytes >> 20, count.used() >> 20));
      }
    }
  }
  kv_bytes = kv_bytes / block_bytes * block_bytes;
  Carver count(nullptr, 0);
  s.CarveBuffers(count);
  s.CarvePool(count, kv_bytes);
  const int64_t total = count.used();
  absl::StatusOr<std::unique_ptr<DeviceAllocation>> memory =
      DeviceAllocation::Create(total, "CUDA backend (weights, activations, KV pool)");
  if (!memory.ok()) return memory.status();
  s.memory = *std::move(memory);
  Carver carve(s.memory->data(), s.memory->bytes());
  s.CarveBuffers(carve);
  s.CarvePool(carve, kv_bytes);
  s.use.kv_pool = kv_bytes;
  if (!carve.ok()) return absl::InternalError("CUDA backend: carving overran its allocation");

  if (absl::Status st = CudaStatus(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking),
                                   "cudaStreamCreate");
      !st.ok()) {
    return st;
  }
  absl::StatusOr<std::unique_ptr<Gemm>> gemm =
      Gemm::Create(s.stream, s.cublas_workspace, CudaLlamaModel::Impl::kCublasWorkspaceBytes);
  if (!gemm.ok()) return gemm.status();
  s.gemm = *std::move(gemm);
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> meta_host =
      PinnedHostBuffer::Create(s.meta.total, "step plan");
  if (!meta_host.ok()) return meta_host.status();
  s.meta_host = *std::move(meta_host);
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> logits_host = PinnedHostBuffer::Create(
      static_cast<int64_t>(options.max_batch_tokens) * m.n_vocab * 4, "logits");
  if (!logits_host.ok()) return logits_host.status();
  s.logits_host = *std::move(logits_host);
  if (s.query_readback_rows > 0) {
    absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> queries =
        PinnedHostBuffer::Create(s.QueryReadbackValues() * 2, "kqsvd query readback");
    if (!queries.ok()) return queries.status();
    s.query_readback_host = *std::move(queries);
  }
  if (absl::Status st = s.UploadWeights(model); !st.ok()) return st;

  if (options.compressed) {
    absl::StatusOr<std::unique_ptr<CudaKvStore>> store =
        CudaKvStore::Create(s.layouts, s.num_pages, options.compressed->basis_capacity,
                            options.compressed->readback_pages, s.store_device, s.stream);
    if (!store.ok()) return store.status();
    s.store = *std::move(store);
    s.expand_history = &CudaLlamaModel::Impl::ExpandLowRank;
  }
  if (options.transform) {
    const CudaTransformCacheOptions& to = *options.transform;
    std::vector<TransformLayerTables> tables;
    for (int l = 0; l < m.n_layers; ++l) {
      tables.push_back(BuildTransformTables(*to.key_codes, *to.value_codes, l, m.n_kv_heads,
                                            m.head_dim, options.block_size));
    }
    kernels::TransformKeyRope key_rope;
    if (to.pre_rope_keys) {
      absl::StatusOr<RopeSchedule> rope = m.rope();
      if (!rope.ok()) return rope.status();
      key_rope = {.cos_sin = s.rope_table,
                  .rope_dim = m.rope_dim,
                  .max_position = s.config.context_length,
                  .halves = m.rope_layout == RopeLayout::kHalves,
                  .unscale = static_cast<float>(1.0 / (rope->mscale * rope->mscale))};
    }
    absl::StatusOr<std::unique_ptr<CudaTransformStore>> store = CudaTransformStore::Create(
        s.layouts, s.num_pages, tables, key_rope, s.transform_device, s.stream);
    if (!store.ok()) return store.status();
    s.transform_store = *std::move(store);
    s.expand_history = &CudaLlamaModel::Impl::ExpandTransform;
  }

  std::shared_ptr<CudaLlamaModel> runner(new CudaLlamaModel(std::move(impl)));
  CudaLlamaModel::Impl& r = *runner->impl_;
  if (options.transform) {
    // The store's buffers are the runner's: the cache keeps the runner alive through it.
    absl::StatusOr<std::unique_ptr<DeviceTransformKvCache>> cache = DeviceTransformKvCache::Create(
        r.TransformCacheConfig(),
        std::shared_ptr<TransformKvStore>(runner, r.transform_store.get()));
    if (!cache.ok()) return cache.status();
    r.cache = cache->get();
    for (int l = 0; l < m.n_layers; ++l) {
      r.kv_layers.push_back({.layout = r.layouts[static_cast<size_t>(l)],
                             .pool = r.transform_store->LayerPool(l),
                             .transform = r.transform_store->Tables(static_cast<size_t>(l)),
                             .key_rope = r.transform_store->key_rope()});
    }
    return CudaBackend{std::move(runner), *std::move(cache)};
  }
  if (!options.compressed) {
    // Images copy between steps, after whatever the stream still runs.
    DevicePagedKvCache::Copy copy = [stream = r.stream](void* dst, const void* src,
                                                        size_t bytes) -> absl::Status {
      if (absl::Status st = CudaStatus(cudaStreamSynchronize(stream), "KV image: stream sync");
          !st.ok()) {
        return st;
      }
      return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "KV image: copy");
    };
    absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> cache = DevicePagedKvCache::Create(
        {.geometry = m.cache_geometry(), .block_size = options.block_size, .copy = std::move(copy)},
        r.kv_pool, r.kv_pool_bytes, runner);
    if (!cache.ok()) return cache.status();
    r.cache = cache->get();
    for (int l = 0; l < m.n_layers; ++l) {
      r.kv_layers.push_back({.layout = (*cache)->layout(), .pool = (*cache)->LayerPool(l)});
    }
    return CudaBackend{std::move(runner), *std::move(cache)};
  }
  const CudaCompressedCacheOptions& co = *options.compressed;
  DeviceCompressedKvCacheConfig cc;
  cc.geometry = m.cache_geometry();
  cc.block_size = options.block_size;
  cc.policy = co.policy;
  cc.policy.r_k.clear();  // the layouts' ranks: the basis's when one is given
  cc.policy.r_v.clear();
  for (const kernels::KvPoolLayout& l : r.layouts) {
    cc.policy.r_k.push_back(l.rank_k);
    cc.policy.r_v.push_back(l.rank_v);
  }
  cc.num_pages = r.num_pages;
  cc.refresh = co.refresh;
  cc.refresh_inline = co.refresh_inline;
  cc.n_query_heads = r.query_readback_rows > 0 ? m.n_heads : 0;
  // The store's buffers are the runner's: the cache keeps the runner alive through it.
  absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> cache = DeviceCompressedKvCache::Create(
      cc, std::shared_ptr<CompressedKvStore>(runner, r.store.get()));
  if (!cache.ok()) return cache.status();
  if (co.basis != nullptr) {
    absl::StatusOr<EpochId> epoch = (*cache)->InstallBasis(co.basis);
    if (!epoch.ok()) return epoch.status();
    if (absl::Status st = (*cache)->SetDefaultEpoch(*epoch); !st.ok()) return st;
    if (absl::Status st = (*cache)->ReleaseEpoch(*epoch); !st.ok()) return st;
  }
  r.cache = cache->get();
  for (int l = 0; l < m.n_layers; ++l) {
    r.kv_layers.push_back({.layout = r.layouts[static_cast<size_t>(l)],
                           .pool = r.store->LayerPool(l),
                           .basis_pq = r.store->basis_pq(l),
                           .basis_rv = r.store->basis_rv(l)});
  }
  return CudaBackend{std::move(runner), *std::move(cache)};
}

CudaLlamaModel::CudaLlamaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaLlamaModel::~CudaLlamaModel() = default;
const ModelConfig& CudaLlamaModel::config() const { return impl_->config; }
std::string CudaLlamaModel::device_name() const { return impl_->device_name; }
CudaLlamaModel::MemoryUse CudaLlamaModel::memory_use() const { return impl_->use; }
StepGraphStats CudaLlamaModel::graph_stats() const { return impl_->graphs.stats(); }

}  // namespace subspace::cuda
