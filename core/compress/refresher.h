// The background refresher: sequences with online refresh hand it the blocks their cache
// compresses (and, for KQ-SVD, their queries); a thread of its own folds them into each
// sequence's OnlineStatistics, decides when a refresh is due (every T tokens, or when the
// mean key residual of new blocks rises past a threshold) and publishes new bases, which the
// cache installs at its next Commit. The engine's step never waits for it: handing over is a
// short critical section, and when the refresher falls behind, observations are dropped and
// counted instead of queued without bound.
#ifndef SUBSPACE_CORE_COMPRESS_REFRESHER_H_
#define SUBSPACE_CORE_COMPRESS_REFRESHER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/compress/online_statistics.h"
#include "core/compress/refresh_statistics.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// One compressed block of one layer, as the cache saw it.
struct BlockObservation {
  int layer = 0;
  int tokens = 0;             // n, per KV head
  std::vector<float> keys;    // [n_kv, n, d] post-RoPE
  std::vector<float> values;  // [n_kv, n, d]
  // Key residual energy under the epoch that compressed the block: sum ||k - k^||^2 and
  // sum ||k||^2 over its heads and tokens.
  double residual = 0.0;
  double energy = 0.0;
};

// Blocks of every layer read back from a device pool, still fp16, with the epoch that coded
// each: the refresher widens them and computes their key residual on its own thread, so the
// engine's step pays one copy instead of O(B d r) work per block and layer.
struct HalfBlockBatch {
  struct Block {
    uint64_t stream = 0;                 // Refresher::StreamId
    std::shared_ptr<const Basis> basis;  // the epoch that coded it
  };
  int block_size = 0;
  // [n_layers][blocks.size()][2][n_kv][block_size][head_dim]: keys then values, post-RoPE
  std::vector<uint16_t> data;
  std::vector<Block> blocks;
};

struct QueryObservation {
  int layer = 0;
  int64_t n = 0;
  std::vector<float> q;  // [n, n_heads, d]
};

// One sequence's queries of every layer read back from a device, still fp16, widened on the
// refresher's thread. A backend with room for only some of a step's query rows keeps an even
// subset and weights each kept row by rows / kept, so G_Q still sums every query.
struct HalfQueryObservation {
  int n_layers = 0;
  int64_t n = 0;      // rows per layer
  int64_t width = 0;  // n_heads * head_dim
  double weight = 1.0;
  std::vector<uint16_t> q;  // [n_layers, n, width]
};

class Refresher {
 public:
  using StreamId = uint64_t;
  struct Options {
    // Process every observation in the caller's thread, at once: deterministic (tools, tests).
    bool inline_mode = false;
    // Observations waiting beyond this many bytes are dropped (counted), never queued.
    int64_t max_queued_bytes = int64_t{64} << 20;
  };
  struct Published {
    StreamId stream = 0;
    RefreshedEpoch epoch;  // a basis or codes, as the stream's statistics make them
  };

  explicit Refresher(const Options& options);
  // Joins the thread; what is still queued is discarded.
  ~Refresher();
  Refresher(const Refresher&) = delete;
  Refresher& operator=(const Refresher&) = delete;

  // A sequence starts being tracked; `stats` carries its method and triggers. The factory form
  // runs `make` on the refresher thread, so a large model's statistics (tens of MiB zeroed, a
  // copy of the initial basis) are never allocated on the caller's (the engine's) thread.
  StreamId Open(std::unique_ptr<RefreshStatistics> stats);
  StreamId Open(std::function<std::unique_ptr<RefreshStatistics>()> make);
  // The sequence is gone: its statistics are dropped and nothing more is published for it.
  void Close(StreamId stream);
  // False when dropped because the queue is full.
  bool Observe(StreamId stream, BlockObservation observation);
  bool Observe(StreamId stream, QueryObservation observation);
  // INVALID_ARGUMENT when `q` does not hold n_layers x n x width values or the weight is not a
  // finite positive number; false when dropped because the queue is full. Rows whose width is
  // not the stream's n_heads x head_dim, or layers it does not have, are ignored there.
  absl::StatusOr<bool> Observe(StreamId stream, HalfQueryObservation observation);
  // INVALID_ARGUMENT when `batch.data` does not hold every layer of every block (the geometry
  // is each block's basis's); false when dropped because the queue is full.
  absl::StatusOr<bool> Observe(HalfBlockBatch batch);

  // New bases published since the last call (possibly for streams closed since).
  std::vector<Published> TakePublished();
  bool has_published() const { return has_published_.load(std::memory_order_acquire); }

  BasisRefreshStats Stats() const;
  // Waits until everything queued so far has been processed (tests, tools).
  void Flush();
  // Runs on the refresher thread before each refresh computation (tests: a stalled refresher).
  void SetBeforeRefreshHookForTest(std::function<void()> hook);

 private:
  struct Message {
    enum class Kind { kOpen, kClose, kBlock, kQueries, kHalfBlocks, kHalfQueries } kind;
    StreamId stream = 0;
    std::function<std::unique_ptr<RefreshStatistics>()> make;  // kOpen: run on this thread
    BlockObservation block;                                    // kBlock
    QueryObservation queries;                                  // kQueries
    HalfBlockBatch half_blocks;                                // kHalfBlocks
    HalfQueryObservation half_queries;                         // kHalfQueries
    int64_t bytes = 0;
    int64_t observations = 1;  // block-layers it carries (counted when dropped)
  };
  struct Stream {
    std::unique_ptr<RefreshStatistics> stats;
    int64_t tokens_since = 0;  // layer-0 tokens observed since the last refresh
    double residual_since = 0.0, energy_since = 0.0;
  };

  void Enqueue(Message m);
  bool EnqueueObservation(Message m);
  void Run();
  void Process(Message& m);  // refresher thread (or the caller's, inline)
  void ProcessBlock(StreamId id, const BlockObservation& b);
  void ProcessHalfBlocks(const HalfBlockBatch& batch);
  void ProcessHalfQueries(StreamId id, const HalfQueryObservation& o);
  void RefreshStream(StreamId id, Stream& s);

  const Options options_;
  std::atomic<bool> has_published_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;            // work arrived or stopping
  std::condition_variable idle_cv_;       // the queue drained (Flush)
  std::deque<Message> queue_;             // guarded by mu_
  int64_t queued_bytes_ = 0;              // guarded by mu_
  bool busy_ = false;                     // guarded by mu_: a batch is being processed
  bool stop_ = false;                     // guarded by mu_
  std::vector<Published> published_;      // guarded by mu_
  BasisRefreshStats stats_;               // guarded by mu_
  std::function<void()> before_refresh_;  // guarded by mu_

  // Refresher thread only (or the caller's, inline).
  std::unordered_map<StreamId, Stream> streams_;
  StreamId next_stream_ = 1;  // guarded by mu_
  std::thread thread_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_REFRESHER_H_
