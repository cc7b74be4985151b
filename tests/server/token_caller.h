// A Subspace stub that calls as one bearer token, and a plain text request: what the tests of
// authentication and session ownership drive a server with.
#ifndef SUBSPACE_TESTS_SERVER_TOKEN_CALLER_H_
#define SUBSPACE_TESTS_SERVER_TOKEN_CALLER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/subspace_client.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"

namespace subspace::testing {

inline constexpr auto kTokenCallTimeout = std::chrono::seconds(20);

inline v1::GenerateRequest TextRequest(const std::string& text, uint32_t max_new) {
  v1::GenerateRequest r;
  r.set_text(text);
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

// The Subspace stub on one channel, calling as one token (none when empty).
class TokenCaller {
 public:
  TokenCaller(std::shared_ptr<grpc::Channel> channel, std::string token)
      : stub_(v1::Subspace::NewStub(std::move(channel))), token_(std::move(token)) {}

  grpc::Status ModelInfo() {
    grpc::ClientContext context;
    Prepare(context);
    v1::ModelInfo info;
    return stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
  }
  grpc::Status Generate(const v1::GenerateRequest& request, v1::GenerateResponse* response) {
    grpc::ClientContext context;
    Prepare(context);
    return stub_->Generate(&context, request, response);
  }
  grpc::Status Stream(const v1::GenerateRequest& request) {
    grpc::ClientContext context;
    Prepare(context);
    auto reader = stub_->GenerateStream(&context, request);
    for (v1::GenerateStreamResponse m; reader->Read(&m);) {
    }
    return reader->Finish();
  }
  absl::StatusOr<std::string> CreateSession() {
    grpc::ClientContext context;
    Prepare(context);
    v1::Session session;
    const grpc::Status s = stub_->CreateSession(&context, v1::CreateSessionRequest(), &session);
    if (!s.ok()) return client::FromGrpcStatus(s);
    return session.session_id();
  }
  grpc::Status GetSession(const std::string& id) {
    grpc::ClientContext context;
    Prepare(context);
    v1::GetSessionRequest request;
    request.set_session_id(id);
    v1::Session session;
    return stub_->GetSession(&context, request, &session);
  }
  // ExportSession's bytes, or its status.
  grpc::Status Export(const std::string& id, std::string* snapshot) {
    grpc::ClientContext context;
    Prepare(context);
    v1::ExportSessionRequest request;
    request.set_session_id(id);
    auto reader = stub_->ExportSession(&context, request);
    for (v1::SessionSnapshotChunk chunk; reader->Read(&chunk);) *snapshot += chunk.data();
    return reader->Finish();
  }
  grpc::Status Import(const std::string& snapshot) {
    grpc::ClientContext context;
    Prepare(context);
    v1::Session session;
    auto writer = stub_->ImportSession(&context, &session);
    v1::SessionSnapshotChunk chunk;
    chunk.set_data(snapshot);
    writer->Write(chunk);
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status DeleteSession(const std::string& id) {
    grpc::ClientContext context;
    Prepare(context);
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    return stub_->DeleteSession(&context, request, &response);
  }
  std::vector<std::string> ListSessions() {
    grpc::ClientContext context;
    Prepare(context);
    v1::ListSessionsResponse response;
    const grpc::Status s = stub_->ListSessions(&context, v1::ListSessionsRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> ids;
    for (const v1::Session& session : response.sessions()) ids.push_back(session.session_id());
    return ids;
  }

 private:
  void Prepare(grpc::ClientContext& context) const {
    context.set_deadline(std::chrono::system_clock::now() + kTokenCallTimeout);
    if (!token_.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }

  std::unique_ptr<v1::Subspace::Stub> stub_;
  std::string token_;
};

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_SERVER_TOKEN_CALLER_H_
