// SubspaceClient: blocking calls on the generated stubs, translating grpc::Status to
// absl::Status one-to-one (the codes are the same numbers).
#include "client/subspace_client.h"

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/random_id.h"

namespace subspace::client {

absl::StatusOr<std::string> NewSessionId() { return NewRandomHexId(); }

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

SubspaceClient::SubspaceClient(ClientOptions options)
    : SubspaceClient(grpc::CreateChannel(options.server, grpc::InsecureChannelCredentials()),
                     options) {}

SubspaceClient::SubspaceClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Subspace::NewStub(channel_)),
      health_stub_(health_v1::Health::NewStub(channel_)) {}

void SubspaceClient::Prepare(grpc::ClientContext& context, const std::string& session_id) const {
  if (options_.timeout != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  }
  if (options_.wait_for_ready) context.set_wait_for_ready(true);
  if (!session_id.empty()) context.AddMetadata(kSessionIdHeader, session_id);
}

absl::StatusOr<v1::GenerateResponse> SubspaceClient::Generate(const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  Prepare(context, request.session_id());
  v1::GenerateResponse response;
  grpc::Status status = stub_->Generate(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<StreamResult> SubspaceClient::Stream(const v1::GenerateRequest& request,
                                                    const ChunkCallback& on_chunk) {
  grpc::ClientContext context;
  Prepare(context, request.session_id());
  std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader =
      stub_->GenerateStream(&context, request);
  StreamResult result;
  bool have_final = false;
  bool cancelled = false;
  v1::GenerateStreamResponse message;
  while (reader->Read(&message)) {
    if (result.request_id.empty()) result.request_id = message.request_id();
    if (message.has_chunk()) {
      if (on_chunk && !on_chunk(message)) {
        context.TryCancel();
        cancelled = true;
        break;
      }
    } else if (message.has_final()) {
      result.final = std::move(*message.mutable_final());
      have_final = true;
    }
  }
  if (cancelled) {
    // Drain so Finish() does not block on unread messages; reads fail fast after TryCancel().
    while (reader->Read(&message)) {
    }
    (void)reader->Finish();  // CANCELLED, by us
    return absl::CancelledError("stream cancelled by the client");
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!have_final) return absl::DataLossError("stream ended without its final message");
  return result;
}

absl::StatusOr<v1::Session> SubspaceClient::CreateSession(uint32_t idle_ttl_seconds,
                                                          const std::string& session_id) {
  // Made here, not by the server, so the routing key exists before the session does.
  absl::StatusOr<std::string> id = session_id.empty() ? NewSessionId() : session_id;
  if (!id.ok()) return id.status();
  grpc::ClientContext context;
  Prepare(context, *id);
  v1::CreateSessionRequest request;
  request.set_idle_ttl_seconds(idle_ttl_seconds);
  request.set_session_id(*id);
  v1::Session session;
  grpc::Status status = stub_->CreateSession(&context, request, &session);
  if (!status.ok()) return FromGrpcStatus(status);
  return session;
}

absl::StatusOr<v1::Session> SubspaceClient::GetSession(const std::string& session_id) {
  grpc::ClientContext context;
  Prepare(context, session_id);
  v1::GetSessionRequest request;
  request.set_session_id(session_id);
  v1::Session session;
  grpc::Status status = stub_->GetSession(&context, request, &session);
  if (!status.ok()) return FromGrpcStatus(status);
  return session;
}

absl::StatusOr<std::vector<v1::Session>> SubspaceClient::ListSessions() {
  grpc::ClientContext context;
  Prepare(context, "");
  v1::ListSessionsResponse response;
  grpc::Status status = stub_->ListSessions(&context, v1::ListSessionsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<v1::Session>(response.sessions().begin(), response.sessions().end());
}

absl::Status SubspaceClient::DeleteSession(const std::string& session_id) {
  grpc::ClientContext context;
  Prepare(context, session_id);
  v1::DeleteSessionRequest request;
  request.set_session_id(session_id);
  v1::DeleteSessionResponse response;
  return FromGrpcStatus(stub_->DeleteSession(&context, request, &response));
}

absl::StatusOr<v1::ModelInfo> SubspaceClient::GetModelInfo() {
  grpc::ClientContext context;
  Prepare(context, "");
  v1::ModelInfo info;
  grpc::Status status = stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::CacheStats> SubspaceClient::GetCacheStats() {
  grpc::ClientContext context;
  Prepare(context, "");
  v1::CacheStats stats;
  grpc::Status status = stub_->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats);
  if (!status.ok()) return FromGrpcStatus(status);
  return stats;
}

absl::StatusOr<ServingStatus> SubspaceClient::Health(const std::string& service) {
  grpc::ClientContext context;
  Prepare(context, "");
  health_v1::HealthCheckRequest request;
  request.set_service(service);
  health_v1::HealthCheckResponse response;
  grpc::Status status = health_stub_->Check(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    return health_v1::HealthCheckResponse::SERVICE_UNKNOWN;
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

}  // namespace subspace::client
