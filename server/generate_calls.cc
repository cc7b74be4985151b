// Reactor state machines of the two Generate RPCs. Rules kept throughout: engine callbacks and
// gRPC reactions only touch state under mu_ and never call into gRPC or the engine while holding
// it (a gRPC reaction may run inline inside StartWrite/Finish); at most one write is in flight;
// Finish is called exactly once; and each object owns itself (self_) until OnDone while the
// engine holds its own reference until OnFinish, so neither side can outlive the other's use.
// The locks are std::mutex, not absl::Mutex, so ThreadSanitizer sees them (scripts/sanitize.sh).
#include "server/generate_calls.h"

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "server/request_validation.h"
#include "server/status_util.h"
#include "spdlog/spdlog.h"

namespace subspace::server {
namespace {

void FillToken(const GeneratedTokenEvent& event, const Tokenizer& tokenizer,
               v1::GeneratedToken* out) {
  out->set_id(event.token);
  out->set_text(ToValidUtf8(event.text));
  out->set_logprob(event.logprob);
  for (const TokenLogprob& alt : event.top) {
    v1::TokenLogprob* p = out->add_top_logprobs();
    p->set_id(alt.token);
    // An alternative is one token on its own: a byte token in the middle of a character is not
    // valid UTF-8 by itself.
    p->set_text(ToValidUtf8(tokenizer.TokenToBytes(alt.token)));
    p->set_logprob(alt.logprob);
  }
}

// Into `out`, replacing what it held (the stream reuses one buffer for every write).
grpc::Status Serialize(const google::protobuf::MessageLite& message, grpc::ByteBuffer* out) {
  out->Clear();
  bool own_buffer = false;
  return grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(message, out,
                                                                             &own_buffer);
}

void FillUsage(const GenerateUsage& usage, v1::Usage* out) {
  out->set_prompt_tokens(static_cast<uint32_t>(usage.prompt_tokens));
  out->set_reused_tokens(static_cast<uint32_t>(usage.reused_tokens));
  out->set_generated_tokens(static_cast<uint32_t>(usage.generated_tokens));
}

void FillTimings(const GenerateTimings& t, v1::Timings* out) {
  out->set_queue_seconds(t.queue_seconds);
  out->set_time_to_first_token_seconds(t.ttft_seconds);
  out->set_total_seconds(t.total_seconds);
  out->mutable_inter_token_seconds()->Add(t.inter_token_seconds.begin(),
                                          t.inter_token_seconds.end());
}

// What both calls share: the engine request id (which may arrive after a cancellation) and the
// per-request metrics and log line.
class GenerateCall : public GenerateObserver, public std::enable_shared_from_this<GenerateCall> {
 protected:
  GenerateCall(Engine* engine, Metrics* metrics, const GenerateRequest& request)
      : engine_(engine),
        metrics_(metrics),
        request_id_(request.request_id),
        session_id_(request.session_id),
        logprobs_(request.sampling.logprobs > 0) {}

  // Submits; on success keeps the object alive until OnDone. On failure the caller finishes the
  // call with the returned status (the engine never calls the observer then).
  absl::Status Submit(GenerateRequest request) {
    self_ = shared_from_this();
    absl::Status s = submission_.Submit(std::move(request), shared_from_this());
    if (!s.ok()) RecordRejected(s);
    return s;
  }

  // From gRPC threads when the client cancels or goes away.
  void CancelEngineRequest() { submission_.Cancel(); }

  void RecordFinished(const GenerateResult& result, const absl::Status& status) {
    RecordRequestFinished(*metrics_, request_id_, session_id_, result, status);
  }

  void RecordRejected(const absl::Status& status) {
    RecordRequestRejected(*metrics_, request_id_, session_id_, status);
  }

  // gRPC is done with the reactor; the engine may still hold its reference.
  void ReleaseSelf() { std::shared_ptr<GenerateCall> last = std::move(self_); }

  Engine* const engine_;
  Metrics* const metrics_;
  const std::string request_id_;
  const std::string session_id_;
  const bool logprobs_;

 private:
  std::shared_ptr<GenerateCall> self_;
  EngineSubmission submission_{engine_};
};

class UnaryGenerateCall final : public grpc::ServerUnaryReactor, public GenerateCall {
 public:
  UnaryGenerateCall(Engine* engine, Metrics* metrics, const GenerateRequest& request,
                    grpc::ByteBuffer* response)
      : GenerateCall(engine, metrics, request), wire_response_(response) {
    response_.set_request_id(request.request_id);
    response_.set_session_id(request.session_id);
  }

  void Start(GenerateRequest request) {
    if (absl::Status s = Submit(std::move(request)); !s.ok()) FinishOnce(ToGrpcStatus(s));
  }

  void OnTokens(std::span<const GeneratedTokenEvent> tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    for (const GeneratedTokenEvent& t : tokens) {
      response_.mutable_text()->append(ToValidUtf8(t.text));
      response_.add_token_ids(t.token);
      if (logprobs_) FillToken(t, engine_->tokenizer(), response_.add_tokens());
    }
  }

  void OnFinish(const GenerateResult& result) override {
    const absl::Status status = FinishStatus(result);
    RecordFinished(result, status);
    v1::GenerateResponse done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;  // the client cancelled first and has its status already
      finished_ = true;
      response_.set_finish_reason(ToProto(result.finish));
      FillUsage(result.usage, response_.mutable_usage());
      FillTimings(result.timings, response_.mutable_timings());
      done = std::move(response_);
    }
    // finished_ makes this thread the only one to touch the wire response.
    if (status.ok()) {
      Finish(Serialize(done, wire_response_));
    } else {
      Finish(ToGrpcStatus(status));
    }
  }

  void OnCancel() override {
    CancelEngineRequest();
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the request"));
  }

  void OnDone() override { ReleaseSelf(); }

 private:
  void FinishOnce(grpc::Status status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(std::move(status));
  }

  grpc::ByteBuffer* const wire_response_;  // owned by gRPC, valid until OnDone
  std::mutex mu_;
  // Guarded by mu_:
  v1::GenerateResponse response_;
  bool finished_ = false;
};

class StreamGenerateCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                 public GenerateCall {
 public:
  StreamGenerateCall(Engine* engine, Metrics* metrics, const GenerateRequest& request)
      : GenerateCall(engine, metrics, request) {}

  void Start(GenerateRequest request) {
    const absl::Status s = Submit(std::move(request));
    if (s.ok()) return;
    Action action;
    {
      std::lock_guard<std::mutex> lock(mu_);
      engine_done_ = true;
      status_ = s;
      action = NextActionLocked();
    }
    Act(action);
  }

  void OnTokens(std::span<const GeneratedTokenEvent> tokens) override {
    Action action;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_ || finish_called_) return;
      // Merge into the last queued chunk: a slow client gets fewer, larger messages instead
      // of an ever longer queue.
      if (pending_.empty() || !pending_.back().has_chunk()) {
        pending_.emplace_back().set_request_id(request_id_);
      }
      v1::StreamChunk* chunk = pending_.back().mutable_chunk();
      for (const GeneratedTokenEvent& t : tokens) {
        chunk->mutable_text()->append(ToValidUtf8(t.text));
        FillToken(t, engine_->tokenizer(), chunk->add_tokens());
      }
      action = NextActionLocked();
    }
    Act(action);
  }

  void OnFinish(const GenerateResult& result) override {
    const absl::Status status = FinishStatus(result);
    RecordFinished(result, status);
    Action action;
    {
      std::lock_guard<std::mutex> lock(mu_);
      engine_done_ = true;
      if (broken_) return;  // already finished, or about to be, with CANCELLED
      status_ = status;
      if (result.status.ok()) {
        v1::GenerateStreamResponse& last = pending_.emplace_back();
        last.set_request_id(request_id_);
        v1::StreamFinal* fin = last.mutable_final();
        fin->set_finish_reason(ToProto(result.finish));
        fin->set_session_id(session_id_);
        FillUsage(result.usage, fin->mutable_usage());
        FillTimings(result.timings, fin->mutable_timings());
      }
      action = NextActionLocked();
    }
    Act(action);
  }

  void OnWriteDone(bool ok) override {
    Action action;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) MarkBrokenLocked();
      action = NextActionLocked();
    }
    // A failed write means the stream is gone; stop generating for it.
    if (!ok) CancelEngineRequest();
    Act(action);
  }

  void OnCancel() override {
    CancelEngineRequest();
    Action action;
    {
      std::lock_guard<std::mutex> lock(mu_);
      MarkBrokenLocked();
      action = NextActionLocked();
    }
    Act(action);
  }

  void OnDone() override { ReleaseSelf(); }

 private:
  enum class Action { kNone, kWrite, kFinish };

  // *Locked: with mu_ held.
  void MarkBrokenLocked() {
    if (broken_) return;
    broken_ = true;
    pending_.clear();
    if (!engine_done_) status_ = absl::CancelledError("the client cancelled the request");
  }

  // Claims the reactor for one operation when no other thread holds it: the next queued
  // message, or Finish once nothing more will come.
  Action NextActionLocked() {
    if (writing_ || finish_called_) return Action::kNone;
    if (!pending_.empty()) {
      in_flight_message_ = std::move(pending_.front());
      pending_.pop_front();
      writing_ = true;
      return Action::kWrite;
    }
    if (engine_done_ || broken_) {
      finish_called_ = true;
      return Action::kFinish;
    }
    return Action::kNone;
  }

  // Without mu_: gRPC may run OnWriteDone inline.
  void Act(Action action) {
    switch (action) {
      case Action::kWrite: {
        // in_flight_* belong to the claimant; serializing here keeps it out of the lock.
        const grpc::Status s = Serialize(in_flight_message_, &in_flight_);
        if (!s.ok()) {
          CancelEngineRequest();
          {
            std::lock_guard<std::mutex> lock(mu_);
            finish_called_ = true;  // no write is in flight, so nobody else can finish
          }
          Finish(s);
          break;
        }
        StartWrite(&in_flight_);
        break;
      }
      case Action::kFinish: {
        absl::Status status;
        {
          std::lock_guard<std::mutex> lock(mu_);
          status = status_;
        }
        Finish(ToGrpcStatus(status));
        break;
      }
      case Action::kNone:
        break;
    }
  }

  std::mutex mu_;
  std::deque<v1::GenerateStreamResponse> pending_;  // guarded by mu_
  v1::GenerateStreamResponse in_flight_message_;    // owned by whoever set writing_
  grpc::ByteBuffer in_flight_;                      // its serialized form, being written
  // Guarded by mu_:
  bool writing_ = false;
  bool engine_done_ = false;  // OnFinish arrived (or Submit failed)
  bool broken_ = false;       // cancelled or a write failed
  bool finish_called_ = false;
  absl::Status status_;
};

// Answers a stream that never reached the engine.
class RejectedStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RejectedStream(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

absl::Status EngineSubmission::Submit(GenerateRequest request,
                                      std::shared_ptr<GenerateObserver> observer) {
  absl::StatusOr<RequestId> id = engine_->Submit(std::move(request), std::move(observer));
  if (!id.ok()) return id.status();
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id_ = *id;
    cancel = cancel_requested_;
  }
  // Cancelled while Submit ran: Cancel could not name the request yet.
  if (cancel) engine_->Cancel(*id);
  return absl::OkStatus();
}

void EngineSubmission::Cancel() {
  std::optional<RequestId> id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_requested_ = true;
    id = id_;
  }
  if (id.has_value()) engine_->Cancel(*id);
}

void RecordRequestFinished(Metrics& metrics, std::string_view request_id,
                           std::string_view session_id, const GenerateResult& result,
                           const absl::Status& status) {
  metrics.RecordFinished(result, status.code());
  const GenerateUsage& u = result.usage;
  spdlog::info(
      "request {} session={} status={} finish={} prompt_tokens={} reused_tokens={} "
      "generated_tokens={} queue_ms={:.1f} ttft_ms={:.1f} total_ms={:.1f} preemptions={}",
      request_id, session_id.empty() ? "-" : session_id, absl::StatusCodeToString(status.code()),
      FinishReasonName(result.finish), u.prompt_tokens, u.reused_tokens, u.generated_tokens,
      result.timings.queue_seconds * 1e3, result.timings.ttft_seconds * 1e3,
      result.timings.total_seconds * 1e3, result.preemptions);
}

void RecordRequestRejected(Metrics& metrics, std::string_view request_id,
                           std::string_view session_id, const absl::Status& status) {
  metrics.RecordRejected(status.code());
  spdlog::info("request {} session={} rejected: {}", request_id.empty() ? "-" : request_id,
               session_id.empty() ? "-" : session_id, status.ToString());
}

grpc::ServerUnaryReactor* StartGenerate(Engine* engine, Metrics* metrics, GenerateRequest request,
                                        grpc::ByteBuffer* response) {
  auto call = std::make_shared<UnaryGenerateCall>(engine, metrics, request, response);
  call->Start(std::move(request));
  return call.get();  // kept alive by its own reference until OnDone
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartGenerateStream(Engine* engine, Metrics* metrics,
                                                                GenerateRequest request) {
  auto call = std::make_shared<StreamGenerateCall>(engine, metrics, request);
  call->Start(std::move(request));
  return call.get();
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RejectStream(const absl::Status& status) {
  return new RejectedStream(status);
}

}  // namespace subspace::server
