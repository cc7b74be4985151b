// SubspaceClient: blocking calls on the generated stubs, translating grpc::Status to
// absl::Status one-to-one (the codes are the same numbers).
#include "client/subspace_client.h"

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/random_id.h"

namespace subspace::client {

absl::StatusOr<std::string> NewSessionId() { return NewRandomHexId(); }

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  if (in.is_open()) bytes << in.rdbuf();
  if (!in.is_open() || in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  }
  return bytes.str();
}

}  // namespace

absl::StatusOr<ClientTls> LoadClientTls(const std::string& ca_path, const std::string& cert_path,
                                        const std::string& key_path) {
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  ClientTls tls;
  struct File {
    const std::string& path;
    const char* flag;
    std::string* pem;
  };
  for (const File& f :
       {File{ca_path, "--tls-ca", &tls.root_certs}, File{cert_path, "--tls-cert", &tls.cert_chain},
        File{key_path, "--tls-key", &tls.private_key}}) {
    if (f.path.empty()) continue;
    absl::StatusOr<std::string> pem = ReadPem(f.path, f.flag);
    if (!pem.ok()) return pem.status();
    *f.pem = *std::move(pem);
  }
  return tls;
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& options) {
  if (!options.tls.has_value()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls->root_certs;
  ssl.pem_cert_chain = options.tls->cert_chain;
  ssl.pem_private_key = options.tls->private_key;
  return grpc::SslCredentials(ssl);
}

SubspaceClient::SubspaceClient(const ClientOptions& options)
    : SubspaceClient(grpc::CreateChannel(options.server, ChannelCredentials(options)), options) {}

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
  if (!options_.auth_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
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

namespace {

// Reads a Generate or Chat stream to its end: chunks to `on_chunk` (false cancels), the final
// message into the result.
absl::StatusOr<StreamResult> ReadStream(grpc::ClientContext& context,
                                        grpc::ClientReader<v1::GenerateStreamResponse>& reader,
                                        const ChunkCallback& on_chunk) {
  StreamResult result;
  bool have_final = false;
  bool cancelled = false;
  v1::GenerateStreamResponse message;
  while (reader.Read(&message)) {
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
    while (reader.Read(&message)) {
    }
    (void)reader.Finish();  // CANCELLED, by us
    return absl::CancelledError("stream cancelled by the client");
  }
  grpc::Status status = reader.Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!have_final) return absl::DataLossError("stream ended without its final message");
  return result;
}

}  // namespace

absl::StatusOr<StreamResult> SubspaceClient::Stream(const v1::GenerateRequest& request,
                                                    const ChunkCallback& on_chunk) {
  grpc::ClientContext context;
  Prepare(context, request.session_id());
  std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader =
      stub_->GenerateStream(&context, request);
  return ReadStream(context, *reader, on_chunk);
}

absl::StatusOr<v1::GenerateResponse> SubspaceClient::Chat(const v1::ChatRequest& request) {
  grpc::ClientContext context;
  Prepare(context, request.session_id());
  v1::GenerateResponse response;
  grpc::Status status = stub_->Chat(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<StreamResult> SubspaceClient::ChatStream(const v1::ChatRequest& request,
                                                        const ChunkCallback& on_chunk) {
  grpc::ClientContext context;
  Prepare(context, request.session_id());
  std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader =
      stub_->ChatStream(&context, request);
  return ReadStream(context, *reader, on_chunk);
}

absl::StatusOr<v1::Session> SubspaceClient::CreateSession(
    uint32_t idle_ttl_seconds, const std::string& session_id,
    const std::optional<v1::BasisRefresh>& refresh) {
  // Made here, not by the server, so the routing key exists before the session does.
  absl::StatusOr<std::string> id = session_id.empty() ? NewSessionId() : session_id;
  if (!id.ok()) return id.status();
  grpc::ClientContext context;
  Prepare(context, *id);
  v1::CreateSessionRequest request;
  request.set_idle_ttl_seconds(idle_ttl_seconds);
  request.set_session_id(*id);
  if (refresh.has_value()) *request.mutable_refresh() = *refresh;
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

absl::StatusOr<std::string> SubspaceClient::ExportSession(const std::string& session_id) {
  grpc::ClientContext context;
  Prepare(context, session_id);
  v1::ExportSessionRequest request;
  request.set_session_id(session_id);
  std::unique_ptr<grpc::ClientReader<v1::SessionSnapshotChunk>> reader =
      stub_->ExportSession(&context, request);
  std::string snapshot;
  for (v1::SessionSnapshotChunk chunk; reader->Read(&chunk);) snapshot += chunk.data();
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return snapshot;
}

absl::StatusOr<v1::Session> SubspaceClient::ImportSession(const std::string& session_id,
                                                          const std::string& snapshot) {
  constexpr size_t kChunk = size_t{1} << 20;
  grpc::ClientContext context;
  Prepare(context, session_id);
  v1::Session session;
  std::unique_ptr<grpc::ClientWriter<v1::SessionSnapshotChunk>> writer =
      stub_->ImportSession(&context, &session);
  for (size_t at = 0; at < snapshot.size(); at += kChunk) {
    v1::SessionSnapshotChunk chunk;
    chunk.set_data(snapshot.substr(at, kChunk));
    if (!writer->Write(chunk)) break;  // the server answered early: Finish says why
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return session;
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
