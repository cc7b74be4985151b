// CUDA-graph replay of decode steps. A decode step is dozens of small launches per layer; as a
// graph they reach the GPU as one submission and run back to back. The step's launches are
// captured as they are enqueued (nothing in the forward pass changes), and the captured graph
// updates the executable graph kept for the same shape key (the batch size: the same kernels
// in the same order, only their arguments, grids and copy sizes differ from step to step) —
// cudaGraphExecUpdate, far cheaper than instantiating; a step whose graph cannot update it
// (a launcher picked another kernel variant or launched nothing) instantiates a new one. As
// llama.cpp's CUDA backend does, so that no kernel needs a fixed-shape variant for replay.
//
// The first step of each key runs eagerly (launchers set their kernels' attributes, cuBLAS picks
// its algorithms, outside any capture); a capture that fails is retried eagerly once and that
// key stays eager from then on (counted: a serving process keeps working, tests expect none).
#ifndef SUBSPACE_CUDA_STEP_GRAPHS_H_
#define SUBSPACE_CUDA_STEP_GRAPHS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace subspace::cuda {

struct StepGraphStats {
  int64_t replays = 0;         // steps run as a graph
  int64_t updates = 0;         // ... through an updated executable graph
  int64_t instantiations = 0;  // ... through a newly instantiated one
  int64_t eager = 0;           // steps run eagerly: a key's first, or a key that failed capture
  int64_t capture_failures = 0;
};

class StepGraphs {
 public:
  StepGraphs() = default;
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;
  ~StepGraphs();

  // Runs what `enqueue` puts on `stream` (which must not be capturing already): eagerly, or
  // captured and launched as the graph kept for `key`. `enqueue` must be repeatable (it is
  // called again, eagerly, after a failed capture). Returns `enqueue`'s error, or INTERNAL for
  // a CUDA failure outside it.
  absl::Status Run(cudaStream_t stream, int64_t key, absl::FunctionRef<absl::Status()> enqueue);

  const StepGraphStats& stats() const { return stats_; }

 private:
  struct Entry {
    cudaGraphExec_t exec = nullptr;  // null until the key's second step
    bool eager_only = false;         // its capture failed once
  };
  // Captures `enqueue` into `*graph` (null and an error when the capture failed).
  absl::Status Capture(cudaStream_t stream, absl::FunctionRef<absl::Status()> enqueue,
                       cudaGraph_t* graph);
  // Updates entry's executable graph from `graph`, or instantiates it anew.
  absl::Status Install(Entry& entry, cudaGraph_t graph);

  absl::flat_hash_map<int64_t, Entry> entries_;
  StepGraphStats stats_;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_STEP_GRAPHS_H_
