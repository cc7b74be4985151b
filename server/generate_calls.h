// The reactors of Generate (unary) and GenerateStream (server streaming). Each is also the
// engine's observer for its request: tokens arrive on the engine thread and are handed to gRPC
// without blocking; the object lives until both the engine and gRPC are done with it.
#ifndef SUBSPACE_SERVER_GENERATE_CALLS_H_
#define SUBSPACE_SERVER_GENERATE_CALLS_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "proto/subspace.grpc.pb.h"
#include "server/metrics.h"

namespace subspace::server {

// A request handed to the engine that any thread may cancel, also while Submit is still running
// (the engine names a request only when Submit returns): a cancellation that comes first is
// carried out as soon as the request has its id. Both APIs' calls hold one.
class EngineSubmission {
 public:
  explicit EngineSubmission(Engine* engine) : engine_(engine) {}
  // Engine::Submit's status.
  absl::Status Submit(GenerateRequest request, std::shared_ptr<GenerateObserver> observer);
  // The request finishes with kCancelled within a step; nothing when it has finished.
  void Cancel();

 private:
  Engine* const engine_;
  std::mutex mu_;
  // Guarded by mu_:
  std::optional<RequestId> id_;
  bool cancel_requested_ = false;
};

// Submits a validated `request` (or answers with Submit's error) and returns the reactor gRPC
// drives. The response is filled and the call finished when the engine reports the request
// finished: CANCELLED / DEADLINE_EXCEEDED for those finish reasons, the engine's status on
// failure. A client cancellation cancels the engine request, freeing its blocks within a step.
// `response` gets the serialized GenerateResponse.
grpc::ServerUnaryReactor* StartGenerate(Engine* engine, Metrics* metrics, GenerateRequest request,
                                        grpc::ByteBuffer* response);

// Streams one chunk per engine step (consecutive chunks are merged while the client is slower
// than the engine), then a final message with the finish reason, usage and timings, then the
// status as for StartGenerate. Messages are serialized GenerateStreamResponses.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartGenerateStream(Engine* engine, Metrics* metrics,
                                                                GenerateRequest request);

// The one log line and the metrics of a request the engine accepted and has finished, with the
// status its client gets (both APIs).
void RecordRequestFinished(Metrics& metrics, std::string_view request_id,
                           std::string_view session_id, const GenerateResult& result,
                           const absl::Status& status);
// The same for a request refused before it reached the engine.
void RecordRequestRejected(Metrics& metrics, std::string_view request_id,
                           std::string_view session_id, const absl::Status& status);

// A stream that ends at once with `status` (the request never reached the engine).
grpc::ServerWriteReactor<grpc::ByteBuffer>* RejectStream(const absl::Status& status);

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_GENERATE_CALLS_H_
