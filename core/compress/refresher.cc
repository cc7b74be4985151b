// The background refresher; see refresher.h. The thread takes the whole queue at once and
// works outside the lock, so the engine's Observe/TakePublished calls only ever contend for
// the time it takes to swap a deque.
#include "core/compress/refresher.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"

namespace subspace {
namespace {

// A residual-triggered refresh waits for at least this many new tokens, so a basis whose
// rank cannot reach the threshold is not recomputed after every block.
constexpr int64_t kMinResidualTriggerTokens = 64;

int64_t BytesOf(const BlockObservation& o) {
  return static_cast<int64_t>((o.keys.size() + o.values.size()) * sizeof(float));
}

// sum ||k - P_q P_k^T k||^2 and sum ||k||^2 over the n_kv * n rows of `keys` ([n_kv, n, d]):
// the residual the CPU cache computes as it codes a block, here for blocks a device coded.
void KeyResidual(const LayerBasis& basis, const float* keys, int n_kv, int n, int d,
                 double* residual, double* energy) {
  const int r = basis.rank_k;
  std::vector<float> c(static_cast<size_t>(r));
  for (int h = 0; h < n_kv; ++h) {
    const float* pk = basis.p_k.data() + static_cast<size_t>(h) * d * r;  // [d, r]
    const float* pq = basis.p_q.data() + static_cast<size_t>(h) * d * r;
    for (int t = 0; t < n; ++t) {
      const float* k = keys + (static_cast<size_t>(h) * n + t) * d;
      std::fill(c.begin(), c.end(), 0.0f);
      for (int x = 0; x < d; ++x) {
        for (int j = 0; j < r; ++j) c[static_cast<size_t>(j)] += k[x] * pk[x * r + j];
      }
      for (int x = 0; x < d; ++x) {
        float kr = 0.0f;
        for (int j = 0; j < r; ++j) kr += pq[x * r + j] * c[static_cast<size_t>(j)];
        *residual += static_cast<double>(k[x] - kr) * (k[x] - kr);
        *energy += static_cast<double>(k[x]) * k[x];
      }
    }
  }
}

}  // namespace

Refresher::Refresher(const Options& options) : options_(options) {
  if (!options_.inline_mode) thread_ = std::thread([this] { Run(); });
}

Refresher::~Refresher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Refresher::StreamId Refresher::Open(std::unique_ptr<RefreshStatistics> stats) {
  auto shared = std::make_shared<std::unique_ptr<RefreshStatistics>>(std::move(stats));
  return Open([shared] { return std::move(*shared); });
}

Refresher::StreamId Refresher::Open(std::function<std::unique_ptr<RefreshStatistics>()> make) {
  Message m{.kind = Message::Kind::kOpen};
  m.make = std::move(make);
  {
    std::lock_guard<std::mutex> lock(mu_);
    m.stream = next_stream_++;
    ++stats_.streams;
  }
  const StreamId id = m.stream;
  Enqueue(std::move(m));
  return id;
}

void Refresher::Close(StreamId stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --stats_.streams;
  }
  Enqueue(Message{.kind = Message::Kind::kClose, .stream = stream});
}

bool Refresher::Observe(StreamId stream, BlockObservation observation) {
  Message m{.kind = Message::Kind::kBlock, .stream = stream};
  m.bytes = BytesOf(observation);
  m.block = std::move(observation);
  return EnqueueObservation(std::move(m));
}

bool Refresher::Observe(StreamId stream, QueryObservation observation) {
  Message m{.kind = Message::Kind::kQueries, .stream = stream};
  m.bytes = static_cast<int64_t>(observation.q.size() * sizeof(float));
  m.queries = std::move(observation);
  return EnqueueObservation(std::move(m));
}

absl::StatusOr<bool> Refresher::Observe(StreamId stream, HalfQueryObservation observation) {
  const HalfQueryObservation& o = observation;
  if (o.n_layers < 1 || o.n < 1 || o.width < 1 ||
      o.q.size() != static_cast<size_t>(o.n_layers) * static_cast<size_t>(o.n) *
                        static_cast<size_t>(o.width)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("half-query observation of %d values for %d layers x %d rows x %d",
                        o.q.size(), o.n_layers, o.n, o.width));
  }
  if (!(std::isfinite(o.weight) && o.weight > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("half-query observation weight %g: must be finite and positive", o.weight));
  }
  Message m{.kind = Message::Kind::kHalfQueries, .stream = stream};
  m.bytes = static_cast<int64_t>(o.q.size() * sizeof(uint16_t));
  m.observations = o.n_layers;  // as many as the CPU cache's per-layer query observations
  m.half_queries = std::move(observation);
  return EnqueueObservation(std::move(m));
}

absl::StatusOr<bool> Refresher::Observe(HalfBlockBatch batch) {
  if (batch.blocks.empty()) return true;
  const std::shared_ptr<const Basis>& first = batch.blocks[0].basis;
  if (first == nullptr || batch.block_size < 1) {
    return absl::InvalidArgumentError("half-block batch without a basis or block size");
  }
  const KvCacheGeometry& g = first->geometry;
  for (const HalfBlockBatch::Block& b : batch.blocks) {
    if (b.basis == nullptr || b.basis->geometry.n_layers != g.n_layers ||
        b.basis->geometry.n_kv_heads != g.n_kv_heads || b.basis->geometry.head_dim != g.head_dim) {
      return absl::InvalidArgumentError("half-block batch mixes geometries");
    }
  }
  const size_t per_block = 2 * static_cast<size_t>(g.n_kv_heads) * batch.block_size * g.head_dim;
  if (batch.data.size() != per_block * batch.blocks.size() * static_cast<size_t>(g.n_layers)) {
    return absl::InvalidArgumentError("half-block batch data does not match its blocks");
  }
  Message m{.kind = Message::Kind::kHalfBlocks};
  m.bytes = static_cast<int64_t>(batch.data.size() * sizeof(uint16_t));
  m.observations = static_cast<int64_t>(batch.blocks.size()) * g.n_layers;
  m.half_blocks = std::move(batch);
  return EnqueueObservation(std::move(m));
}

void Refresher::Enqueue(Message m) {
  if (options_.inline_mode) {
    Process(m);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued_bytes_ += m.bytes;
    queue_.push_back(std::move(m));
  }
  cv_.notify_one();
}

bool Refresher::EnqueueObservation(Message m) {
  if (!options_.inline_mode) {
    std::lock_guard<std::mutex> lock(mu_);
    if (queued_bytes_ + m.bytes > options_.max_queued_bytes) {
      stats_.observations_dropped += m.observations;
      return false;
    }
  }
  Enqueue(std::move(m));
  return true;
}

std::vector<Refresher::Published> Refresher::TakePublished() {
  std::vector<Published> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(published_);
  has_published_.store(false, std::memory_order_release);
  return out;
}

BasisRefreshStats Refresher::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Refresher::Flush() {
  if (options_.inline_mode) return;
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return (queue_.empty() && !busy_) || stop_; });
}

void Refresher::SetBeforeRefreshHookForTest(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  before_refresh_ = std::move(hook);
}

void Refresher::Run() {
  std::deque<Message> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      batch.swap(queue_);
      queued_bytes_ = 0;
      busy_ = true;
    }
    for (Message& m : batch) Process(m);
    batch.clear();
  }
}

void Refresher::Process(Message& m) {
  switch (m.kind) {
    case Message::Kind::kOpen:
      streams_[m.stream].stats = m.make();
      return;
    case Message::Kind::kClose:
      streams_.erase(m.stream);
      return;
    case Message::Kind::kQueries: {
      auto it = streams_.find(m.stream);
      if (it == streams_.end()) return;
      it->second.stats->ObserveQueries(m.queries.layer, m.queries.q.data(), m.queries.n, 1.0);
      return;
    }
    case Message::Kind::kBlock:
      ProcessBlock(m.stream, m.block);
      return;
    case Message::Kind::kHalfBlocks:
      ProcessHalfBlocks(m.half_blocks);
      return;
    case Message::Kind::kHalfQueries:
      ProcessHalfQueries(m.stream, m.half_queries);
      return;
  }
}

void Refresher::ProcessHalfQueries(StreamId id, const HalfQueryObservation& o) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;  // closed since it was read back
  RefreshStatistics& stats = *it->second.stats;
  if (stats.query_width() == 0 || o.width != stats.query_width()) return;
  const size_t layer_values = static_cast<size_t>(o.n) * static_cast<size_t>(o.width);
  std::vector<float> q(layer_values);
  for (int l = 0; l < std::min(o.n_layers, stats.n_layers()); ++l) {
    const uint16_t* src = o.q.data() + static_cast<size_t>(l) * layer_values;
    for (size_t j = 0; j < layer_values; ++j) q[j] = HalfToFloat(src[j]);
    stats.ObserveQueries(l, q.data(), o.n, o.weight);
  }
}

void Refresher::ProcessBlock(StreamId id, const BlockObservation& b) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;
  Stream& s = it->second;
  s.stats->ObserveBlock(b.layer, b.keys.data(), b.values.data(), b.tokens);
  s.residual_since += b.residual;
  s.energy_since += b.energy;
  if (b.layer == 0) s.tokens_since += b.tokens;
  // Triggers are checked once the block's last layer is in, so a refresh sees all layers.
  if (b.layer != s.stats->n_layers() - 1) return;
  const RefreshConfig& c = s.stats->config();
  const bool by_count = c.every_tokens > 0 && s.tokens_since >= c.every_tokens;
  const bool by_residual = c.residual_threshold > 0.0 && s.energy_since > 0.0 &&
                           s.tokens_since >= kMinResidualTriggerTokens &&
                           s.residual_since / s.energy_since > c.residual_threshold;
  if (by_count || by_residual) RefreshStream(id, s);
}

void Refresher::ProcessHalfBlocks(const HalfBlockBatch& batch) {
  const KvCacheGeometry& g = batch.blocks[0].basis->geometry;
  const int n_kv = g.n_kv_heads, d = g.head_dim, n = batch.block_size;
  const size_t half = static_cast<size_t>(n_kv) * n * d;  // keys (or values) of one block-layer
  const size_t nb = batch.blocks.size();
  BlockObservation o;
  for (size_t i = 0; i < nb; ++i) {
    const HalfBlockBatch::Block& block = batch.blocks[i];
    if (!streams_.contains(block.stream)) continue;  // closed since it was read back
    for (int l = 0; l < g.n_layers; ++l) {
      const uint16_t* src = batch.data.data() + (static_cast<size_t>(l) * nb + i) * 2 * half;
      o.layer = l;
      o.tokens = n;
      o.keys.resize(half);
      o.values.resize(half);
      for (size_t j = 0; j < half; ++j) o.keys[j] = HalfToFloat(src[j]);
      for (size_t j = 0; j < half; ++j) o.values[j] = HalfToFloat(src[half + j]);
      o.residual = o.energy = 0.0;
      KeyResidual(block.basis->layers[static_cast<size_t>(l)], o.keys.data(), n_kv, n, d,
                  &o.residual, &o.energy);
      ProcessBlock(block.stream, o);
    }
  }
}

void Refresher::RefreshStream(StreamId id, Stream& s) {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hook = before_refresh_;
  }
  if (hook) hook();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<RefreshedEpoch> epoch = s.stats->RefreshEpoch();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.tokens_since = 0;
  s.residual_since = s.energy_since = 0.0;
  std::lock_guard<std::mutex> lock(mu_);
  if (!epoch.ok()) {
    ++stats_.failures;
    return;
  }
  if (epoch->basis == nullptr && epoch->codes.keys == nullptr) return;  // nothing new yet
  ++stats_.refreshes;
  stats_.latency_seconds_sum += seconds;
  const auto& bounds = BasisRefreshStats::kLatencyBounds;
  const size_t bucket =
      static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin());
  ++stats_.latency_counts[bucket];
  published_.push_back({id, *std::move(epoch)});
  has_published_.store(true, std::memory_order_release);
}

}  // namespace subspace
