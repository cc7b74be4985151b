// StepGraphs: eager first, then capture, update or instantiate, launch.
#include "cuda/step_graphs.h"

#include "cuda/cuda_status.h"

namespace subspace::cuda {

StepGraphs::~StepGraphs() {
  for (const auto& [key, entry] : entries_) {
    if (entry.exec != nullptr) cudaGraphExecDestroy(entry.exec);
  }
}

absl::Status StepGraphs::Capture(cudaStream_t stream, absl::FunctionRef<absl::Status()> enqueue,
                                 cudaGraph_t* graph) {
  *graph = nullptr;
  // Thread-local: only this thread's unsafe calls (a synchronisation, an allocation) invalidate
  // the capture; another thread's cannot.
  if (absl::Status st = CudaStatus(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                                   "graph capture");
      !st.ok()) {
    return st;
  }
  const absl::Status enqueued = enqueue();
  const absl::Status ended = CudaStatus(cudaStreamEndCapture(stream, graph), "graph capture");
  if (enqueued.ok() && ended.ok()) return absl::OkStatus();
  if (*graph != nullptr) cudaGraphDestroy(*graph);
  *graph = nullptr;
  return enqueued.ok() ? ended : enqueued;
}

absl::Status StepGraphs::Install(Entry& entry, cudaGraph_t graph) {
  if (entry.exec != nullptr) {
    cudaGraphExecUpdateResultInfo info;
    if (cudaGraphExecUpdate(entry.exec, graph, &info) == cudaSuccess) {
      ++stats_.updates;
      return absl::OkStatus();
    }
    (void)cudaGetLastError();  // a refused update is not an error of the next launch
    cudaGraphExecDestroy(entry.exec);
    entry.exec = nullptr;
  }
  if (absl::Status st =
          CudaStatus(cudaGraphInstantiate(&entry.exec, graph, 0), "graph instantiation");
      !st.ok()) {
    entry.exec = nullptr;
    return st;
  }
  ++stats_.instantiations;
  return absl::OkStatus();
}

absl::Status StepGraphs::Run(cudaStream_t stream, int64_t key,
                             absl::FunctionRef<absl::Status()> enqueue) {
  const auto [it, first] = entries_.try_emplace(key);
  Entry& entry = it->second;
  if (first || entry.eager_only) {
    ++stats_.eager;
    return enqueue();
  }
  cudaGraph_t graph = nullptr;
  absl::Status st = Capture(stream, enqueue, &graph);
  if (st.ok()) {
    st = Install(entry, graph);
    cudaGraphDestroy(graph);
    if (st.ok()) {
      ++stats_.replays;
      return CudaStatus(cudaGraphLaunch(entry.exec, stream), "graph launch");
    }
  }
  // Nothing ran: run the step eagerly, and this key from now on.
  (void)cudaGetLastError();
  ++stats_.capture_failures;
  ++stats_.eager;
  entry.eager_only = true;
  return enqueue();
}

}  // namespace subspace::cuda
