// subspace.v1.Subspace on gRPC's callback API: authenticates every call, validates requests,
// hands generation to the engine through the reactors in generate_calls.h and answers the
// session and introspection RPCs directly. Until an engine is attached (the model is loading)
// every RPC is UNAVAILABLE. Sessions belong to the principal that created them.
#ifndef SUBSPACE_SERVER_SERVICE_H_
#define SUBSPACE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/engine/session_snapshot.h"
#include "proto/subspace.grpc.pb.h"
#include "runtime/kv_cache_options.h"
#include "server/auth.h"
#include "server/chat_request.h"
#include "server/metrics.h"
#include "server/request_validation.h"

namespace subspace::server {

// What GetModelInfo reports about the cache beyond Engine::Stats().
struct CacheDescription {
  runtime::KvCacheOptions
      options;  // as built: ranks resolved; the policy is reported for kCompressed only
  int64_t pool_bytes = 0;
  int block_size = 0;
};

// Generate, GenerateStream, Chat and ChatStream take raw bytes: protobuf refuses a request
// whose text is not UTF-8 before a typed handler runs, and gRPC then answers a bare
// UNIMPLEMENTED; parsing here turns that into INVALID_ARGUMENT naming the field.
using SubspaceServiceBase = v1::Subspace::WithRawCallbackMethod_Generate<
    v1::Subspace::WithRawCallbackMethod_GenerateStream<v1::Subspace::WithRawCallbackMethod_Chat<
        v1::Subspace::WithRawCallbackMethod_ChatStream<v1::Subspace::CallbackService>>>>;

class SubspaceService final : public SubspaceServiceBase {
 public:
  // `metrics` must outlive the service. Every RPC first passes `auth` (UNAUTHENTICATED
  // otherwise); a default Authenticator lets every call in as the same anonymous principal.
  SubspaceService(Metrics* metrics, RequestLimits limits, Authenticator auth = {});

  // Starts serving with `engine`, which must outlive the gRPC server. Call once. `snapshot`
  // identifies the model in the session snapshots ExportSession writes and ImportSession takes.
  void AttachEngine(Engine* engine, CacheDescription cache, ChatSetup chat = {},
                    SnapshotIdentity snapshot = {});
  // From now on Generate and GenerateStream answer UNAVAILABLE; the rest keeps working so
  // clients can still inspect or delete their sessions while the server drains.
  void BeginDrain() { draining_.store(true, std::memory_order_release); }

  // GenerateRequest in, GenerateResponse out, serialized.
  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // GenerateRequest in, GenerateStreamResponse messages out, serialized.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerateStream(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;

  // ChatRequest in, GenerateResponse out, serialized.
  grpc::ServerUnaryReactor* Chat(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // ChatRequest in, GenerateStreamResponse messages out, serialized.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ChatStream(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request) override;

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::Session* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::Session* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse* response) override;
  grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* ExportSession(
      grpc::CallbackServerContext* context, const v1::ExportSessionRequest* request) override;
  grpc::ServerReadReactor<v1::SessionSnapshotChunk>* ImportSession(
      grpc::CallbackServerContext* context, v1::Session* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetCacheStats(grpc::CallbackServerContext* context,
                                          const v1::GetCacheStatsRequest* request,
                                          v1::CacheStats* response) override;

 private:
  // Where every handler starts, so none can skip authentication: the caller's principal into
  // `caller` (when not null) and the attached engine. UNAUTHENTICATED without valid
  // credentials -- checked first, so such a caller learns nothing else -- then UNAVAILABLE while
  // the model loads.
  absl::StatusOr<Engine*> Admit(const grpc::CallbackServerContext& context,
                                std::string* caller) const;
  // Everything a Generate call needs before it reaches the engine: Admit, parsing `wire` into
  // `request`, draining, field validation, the session's existence for this caller (NOT_FOUND),
  // tokenization and the deadline.
  absl::StatusOr<GenerateRequest> Prepare(const grpc::ByteBuffer& wire,
                                          const grpc::CallbackServerContext& context,
                                          v1::GenerateRequest* request, Engine** engine) const;
  // The same for Chat: the conversation rendered with the chat template and encoded.
  absl::StatusOr<GenerateRequest> PrepareChat(const grpc::ByteBuffer& wire,
                                              const grpc::CallbackServerContext& context,
                                              v1::ChatRequest* request, Engine** engine) const;
  void LogRejected(std::string_view request_id, std::string_view session_id,
                   const absl::Status& status) const;
  // The four generating RPCs: prepare (Prepare or PrepareChat), then hand the engine request to
  // generate_calls, or answer with the preparation's error.
  template <typename Message>
  using PrepareFn = absl::StatusOr<GenerateRequest> (SubspaceService::*)(
      const grpc::ByteBuffer&, const grpc::CallbackServerContext&, Message*, Engine**) const;
  template <typename Message>
  grpc::ServerUnaryReactor* StartUnary(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* wire, grpc::ByteBuffer* response,
                                       PrepareFn<Message> prepare);
  template <typename Message>
  grpc::ServerWriteReactor<grpc::ByteBuffer>* StartStream(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* wire,
                                                          PrepareFn<Message> prepare);

  Metrics* const metrics_;
  const RequestLimits limits_;
  const Authenticator auth_;
  std::atomic<Engine*> engine_{nullptr};
  CacheDescription cache_;     // written before engine_ is published, read after
  ChatSetup chat_;             // likewise
  SnapshotIdentity snapshot_;  // likewise
  std::atomic<bool> draining_{false};
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_SERVICE_H_
