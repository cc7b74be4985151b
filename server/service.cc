// The Subspace RPC handlers. Generation goes through generate_calls; everything else is a
// short engine call answered on gRPC's default unary reactor.
#include "server/service.h"

#include <google/protobuf/stubs/logging.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/compress/transform_kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "server/generate_calls.h"
#include "server/prepare_request.h"
#include "server/session_access.h"
#include "server/session_transfer.h"
#include "server/status_util.h"
#include "spdlog/spdlog.h"

namespace subspace::server {
namespace {

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void ToProto(const SessionInfo& info, v1::Session* out) {
  out->set_session_id(info.id);
  out->set_tokens(static_cast<uint32_t>(info.tokens));
  out->set_cached_tokens(static_cast<uint32_t>(info.cached_tokens));
  out->set_idle_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(info.idle_ttl)));
  out->set_created_unix_ms(absl::ToUnixMillis(info.created));
  out->set_last_used_unix_ms(absl::ToUnixMillis(info.last_used));
  out->set_busy(info.busy);
  out->set_refresh_method(RefreshMethodName(info.refresh_method));
  out->set_cache_location(CacheLocationName(info.cache_location));
  out->set_owner(info.owner);
}

// A session's online refresh: the server's --refresh-* flags with the request's overrides.
absl::StatusOr<RefreshConfig> SessionRefresh(const v1::CreateSessionRequest& request,
                                             const runtime::KvCacheOptions& options) {
  RefreshConfig c = options.refresh;
  if (request.has_refresh()) {
    const v1::BasisRefresh& r = request.refresh();
    if (!r.method().empty()) {
      absl::StatusOr<RefreshMethod> m = ParseRefreshMethod(r.method());
      if (!m.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("refresh.method: ", m.status().message()));
      }
      c.method = *m;
    }
    if (r.every_tokens() > 0) c.every_tokens = r.every_tokens();
  }
  const bool transform = options.kind == runtime::KvCacheKind::kTransform;
  if (c.method != RefreshMethod::kNone && options.kind != runtime::KvCacheKind::kCompressed &&
      !transform) {
    return absl::FailedPreconditionError(
        absl::StrCat("refresh.method needs the compressed or the transform-coded KV cache; this "
                     "server runs --kv-cache=",
                     runtime::KvCacheKindName(options.kind)));
  }
  if (absl::Status s = transform ? CheckTransformRefreshConfig(c) : ValidateRefreshConfig(c);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("refresh: ", s.message()));
  }
  return c;
}

// Deserializes a raw request; on failure says which field is to blame.
template <typename Message>
absl::Status ParseRequest(const grpc::ByteBuffer& wire, Message* out) {
  grpc::ByteBuffer copy(wire);  // Deserialize consumes its buffer; slices are shared, not copied
  {
    // protobuf logs every string that is not UTF-8; the client is told instead.
    google::protobuf::LogSilencer silence;
    if (grpc::SerializationTraits<Message>::Deserialize(&copy, out).ok()) {
      return absl::OkStatus();
    }
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (wire.Dump(&slices).ok()) {
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
  }
  return DiagnoseUnparsable(bytes, *Message::descriptor());
}

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace

SubspaceService::SubspaceService(Metrics* metrics, RequestLimits limits, Authenticator auth)
    : metrics_(metrics), limits_(limits), auth_(std::move(auth)) {}

void SubspaceService::AttachEngine(Engine* engine, CacheDescription cache, ChatSetup chat,
                                   SnapshotIdentity snapshot) {
  cache_ = std::move(cache);
  chat_ = std::move(chat);
  snapshot_ = std::move(snapshot);
  engine_.store(engine, std::memory_order_release);
}

absl::StatusOr<Engine*> SubspaceService::Admit(const grpc::CallbackServerContext& context,
                                               std::string* caller) const {
  absl::StatusOr<std::string> principal = auth_.Authenticate(context);
  if (!principal.ok()) return principal.status();
  if (caller != nullptr) *caller = *std::move(principal);
  Engine* engine = engine_.load(std::memory_order_acquire);
  if (engine == nullptr) return absl::UnavailableError("the server is still loading the model");
  return engine;
}

absl::StatusOr<GenerateRequest> SubspaceService::Prepare(const grpc::ByteBuffer& wire,
                                                         const grpc::CallbackServerContext& context,
                                                         v1::GenerateRequest* request_out,
                                                         Engine** engine_out) const {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(context, &caller);
  if (!engine.ok()) return engine.status();
  if (absl::Status s = ParseRequest(wire, request_out); !s.ok()) return s;
  *engine_out = *engine;
  if (draining_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the server is draining and accepts no new requests");
  }
  return PrepareGenerate(**engine, *request_out, limits_, std::move(caller), DeadlineOf(context));
}

absl::StatusOr<GenerateRequest> SubspaceService::PrepareChat(
    const grpc::ByteBuffer& wire, const grpc::CallbackServerContext& context,
    v1::ChatRequest* request_out, Engine** engine_out) const {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(context, &caller);
  if (!engine.ok()) return engine.status();
  if (absl::Status s = ParseRequest(wire, request_out); !s.ok()) return s;
  *engine_out = *engine;
  if (draining_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the server is draining and accepts no new requests");
  }
  return server::PrepareChat(**engine, *request_out, chat_, limits_, std::move(caller),
                             DeadlineOf(context));
}

void SubspaceService::LogRejected(std::string_view request_id, std::string_view session_id,
                                  const absl::Status& status) const {
  RecordRequestRejected(*metrics_, request_id, session_id, status);
}

template <typename Message>
grpc::ServerUnaryReactor* SubspaceService::StartUnary(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire,
                                                      grpc::ByteBuffer* response,
                                                      PrepareFn<Message> prepare) {
  Message request;
  Engine* engine = nullptr;
  absl::StatusOr<GenerateRequest> prepared = (this->*prepare)(*wire, *context, &request, &engine);
  if (!prepared.ok()) {
    LogRejected(request.request_id(), request.session_id(), prepared.status());
    return FinishUnary(context, prepared.status());
  }
  return StartGenerate(engine, metrics_, *std::move(prepared), response);
}

template <typename Message>
grpc::ServerWriteReactor<grpc::ByteBuffer>* SubspaceService::StartStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire,
    PrepareFn<Message> prepare) {
  Message request;
  Engine* engine = nullptr;
  absl::StatusOr<GenerateRequest> prepared = (this->*prepare)(*wire, *context, &request, &engine);
  if (!prepared.ok()) {
    LogRejected(request.request_id(), request.session_id(), prepared.status());
    return RejectStream(prepared.status());
  }
  return StartGenerateStream(engine, metrics_, *std::move(prepared));
}

grpc::ServerUnaryReactor* SubspaceService::Generate(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* wire,
                                                    grpc::ByteBuffer* response) {
  return StartUnary<v1::GenerateRequest>(context, wire, response, &SubspaceService::Prepare);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* SubspaceService::GenerateStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire) {
  return StartStream<v1::GenerateRequest>(context, wire, &SubspaceService::Prepare);
}

grpc::ServerUnaryReactor* SubspaceService::Chat(grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* wire,
                                                grpc::ByteBuffer* response) {
  return StartUnary<v1::ChatRequest>(context, wire, response, &SubspaceService::PrepareChat);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* SubspaceService::ChatStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire) {
  return StartStream<v1::ChatRequest>(context, wire, &SubspaceService::PrepareChat);
}

grpc::ServerUnaryReactor* SubspaceService::CreateSession(grpc::CallbackServerContext* context,
                                                         const v1::CreateSessionRequest* request,
                                                         v1::Session* response) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  if (request->idle_ttl_seconds() > limits_.max_session_ttl_seconds) {
    return FinishUnary(
        context, absl::InvalidArgumentError(absl::StrCat("idle_ttl_seconds must be at most ",
                                                         limits_.max_session_ttl_seconds, ", got ",
                                                         request->idle_ttl_seconds())));
  }
  if (absl::Status s = ValidateProposedSessionId(request->session_id(), "session_id"); !s.ok()) {
    return FinishUnary(context, s);
  }
  absl::StatusOr<RefreshConfig> refresh = SessionRefresh(*request, cache_.options);
  if (!refresh.ok()) return FinishUnary(context, refresh.status());
  absl::StatusOr<SessionInfo> session = (*engine)->CreateSession(
      absl::Seconds(request->idle_ttl_seconds()), request->session_id(), caller, *refresh);
  if (session.ok()) ToProto(*session, response);
  return FinishUnary(context, session.status());
}

grpc::ServerUnaryReactor* SubspaceService::GetSession(grpc::CallbackServerContext* context,
                                                      const v1::GetSessionRequest* request,
                                                      v1::Session* response) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  if (absl::Status s = ValidateId(request->session_id(), "session_id", limits_); !s.ok()) {
    return FinishUnary(context, s);
  }
  const SessionAccess access(caller, auth_.IsOperator(caller));
  absl::StatusOr<SessionInfo> session =
      (*engine)->GetSession(request->session_id(), access.OwnerOf(**engine, request->session_id()));
  if (session.ok()) ToProto(*session, response);
  return FinishUnary(context, session.status());
}

grpc::ServerUnaryReactor* SubspaceService::ListSessions(grpc::CallbackServerContext* context,
                                                        const v1::ListSessionsRequest* request,
                                                        v1::ListSessionsResponse* response) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  const SessionAccess access(caller, auth_.IsOperator(caller));
  for (const SessionInfo& info : access.List(**engine)) {
    ToProto(info, response->add_sessions());
  }
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* SubspaceService::DeleteSession(grpc::CallbackServerContext* context,
                                                         const v1::DeleteSessionRequest* request,
                                                         v1::DeleteSessionResponse* response) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  if (absl::Status s = ValidateId(request->session_id(), "session_id", limits_); !s.ok()) {
    return FinishUnary(context, s);
  }
  const SessionAccess access(caller, auth_.IsOperator(caller));
  return FinishUnary(context,
                     (*engine)->DeleteSession(request->session_id(),
                                              access.OwnerOf(**engine, request->session_id())));
}

grpc::ServerWriteReactor<v1::SessionSnapshotChunk>* SubspaceService::ExportSession(
    grpc::CallbackServerContext* context, const v1::ExportSessionRequest* request) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  if (!engine.ok()) return RejectSnapshotExport(engine.status());
  if (absl::Status s = ValidateId(request->session_id(), "session_id", limits_); !s.ok()) {
    return RejectSnapshotExport(s);
  }
  const SessionAccess access(caller, auth_.IsOperator(caller));
  absl::StatusOr<Engine::ExportedSession> exported = (*engine)->ExportSession(
      request->session_id(), access.OwnerOf(**engine, request->session_id()));
  if (!exported.ok()) return RejectSnapshotExport(exported.status());
  std::string snapshot = EncodeSessionSnapshot(exported->image, snapshot_);
  spdlog::info("session {} exported: {} tokens, {} cached, {} bytes{}", exported->image.id,
               exported->image.tokens.size(), exported->image.cached, snapshot.size(),
               exported->cache.ok()
                   ? std::string()
                   : absl::StrCat(" (without its KV cache: ", exported->cache.message(), ")"));
  if (metrics_ != nullptr) metrics_->RecordSessionMoved("export");
  return StartSnapshotExport(std::move(snapshot));
}

grpc::ServerReadReactor<v1::SessionSnapshotChunk>* SubspaceService::ImportSession(
    grpc::CallbackServerContext* context, v1::Session* response) {
  std::string caller;
  absl::StatusOr<Engine*> engine = Admit(*context, &caller);
  // A snapshot holds at most a session's share of the pool, and the bases it uses.
  const uint64_t max_bytes =
      2 * static_cast<uint64_t>(std::max<int64_t>(cache_.pool_bytes, 0)) + (uint64_t{256} << 20);
  if (!engine.ok()) return StartSnapshotImport(max_bytes, {}, engine.status());
  Engine* e = *engine;
  const SessionAccess access(caller, auth_.IsOperator(caller));
  return StartSnapshotImport(
      max_bytes, [this, e, access, max_bytes, response](const std::string& bytes) -> absl::Status {
        absl::StatusOr<SessionImage> image = DecodeSessionSnapshot(bytes, snapshot_, max_bytes);
        if (!image.ok()) return image.status();
        if (absl::Status s = access.CheckImport(*image); !s.ok()) return s;
        if (absl::Status s = ValidateId(image->id, "snapshot session id", limits_); !s.ok())
          return s;
        absl::StatusOr<Engine::ImportedSession> imported = e->ImportSession(*image);
        if (!imported.ok()) return imported.status();
        spdlog::info(
            "session {} imported: {} tokens, {} cached{}", imported->info.id, imported->info.tokens,
            imported->info.cached_tokens,
            imported->cache.ok()
                ? std::string()
                : absl::StrCat(" (its KV cache dropped: ", imported->cache.message(), ")"));
        ToProto(imported->info, response);
        if (metrics_ != nullptr) metrics_->RecordSessionMoved("import");
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* SubspaceService::GetModelInfo(grpc::CallbackServerContext* context,
                                                        const v1::GetModelInfoRequest* request,
                                                        v1::ModelInfo* response) {
  absl::StatusOr<Engine*> engine = Admit(*context, /*caller=*/nullptr);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  const ModelConfig& m = (*engine)->model_config();
  const Tokenizer& t = (*engine)->tokenizer();
  response->set_name(m.name);
  response->set_architecture(m.architecture);
  response->set_vocab_size(m.n_vocab);
  response->set_embedding_length(m.dim);
  response->set_layers(m.n_layers);
  response->set_heads(m.n_heads);
  response->set_kv_heads(m.n_kv_heads);
  response->set_head_dim(m.head_dim);
  response->set_feed_forward_length(m.ffn_dim);
  response->set_context_length(m.context_length);
  response->set_rope_theta(m.rope_theta);
  response->set_tokenizer_model(t.model_name());
  response->set_bos_token_id(t.bos_id());
  response->set_eos_token_id(t.eos_id());
  response->set_tokenizer_pre(t.pre_name());
  response->set_add_bos_token(t.add_bos());
  for (int32_t id : t.end_of_generation_ids()) response->add_end_of_generation_token_ids(id);
  response->set_chat_template(chat_.chat_template != nullptr ? chat_.source : "");
  if (!chat_.unavailable.ok() && !chat_.source.empty()) {
    response->set_chat_template_error(std::string(chat_.unavailable.message()));
  }
  v1::CacheConfig* cache = response->mutable_cache();
  const runtime::KvCacheOptions& o = cache_.options;
  cache->set_kind(runtime::KvCacheKindName(o.kind));
  cache->set_pool_bytes(cache_.pool_bytes);
  cache->set_block_size(cache_.block_size);
  cache->set_blocks_total((*engine)->Stats().cache.blocks_total);
  if (o.kind == runtime::KvCacheKind::kQuantized) cache->set_kv_dtype(KvDtypeName(o.kv_dtype));
  if (o.kind == runtime::KvCacheKind::kCompressed) {
    cache->set_rank_k(o.rank_k);
    cache->set_rank_v(o.rank_v);
    cache->set_coeff_dtype(CoeffDtypeName(o.coeff_dtype));
    cache->set_outlier_threshold(o.outlier_threshold);
  }
  if (o.kind == runtime::KvCacheKind::kCompressed || o.kind == runtime::KvCacheKind::kTransform) {
    cache->set_sink_tokens(o.sink_tokens);
    cache->set_window_tokens(o.window_tokens);
    cache->set_refresh_method(RefreshMethodName(o.refresh.method));
    cache->set_refresh_every_tokens(static_cast<uint32_t>(o.refresh.every_tokens));
    cache->set_refresh_max_epochs(static_cast<uint32_t>(o.refresh.max_epochs));
  }
  return FinishUnary(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* SubspaceService::GetCacheStats(grpc::CallbackServerContext* context,
                                                         const v1::GetCacheStatsRequest* request,
                                                         v1::CacheStats* response) {
  absl::StatusOr<Engine*> engine = Admit(*context, /*caller=*/nullptr);
  if (!engine.ok()) return FinishUnary(context, engine.status());
  const EngineStats s = (*engine)->Stats();
  const KvCacheStats& c = s.cache;
  response->set_pool_bytes_total(c.bytes_total);
  response->set_bytes_used_full(c.bytes_used_full);
  response->set_bytes_used_compressed(c.bytes_used_compressed);
  response->set_bytes_used_outlier(c.bytes_used_outlier);
  response->set_blocks_total(c.blocks_total);
  response->set_blocks_free(c.blocks_free);
  response->set_tokens_cached(c.tokens_cached);
  response->set_sessions(s.sessions);
  response->set_running(s.running);
  response->set_waiting(s.waiting);
  response->set_compression_ratio(CompressionRatio(c));
  response->set_epochs_live(static_cast<uint64_t>(c.epochs_live));
  response->set_refreshes_total(static_cast<uint64_t>(c.refresh.refreshes));
  response->set_refresh_failures_total(static_cast<uint64_t>(c.refresh.failures));
  response->set_refresh_observations_dropped_total(
      static_cast<uint64_t>(c.refresh.observations_dropped));
  response->set_blocks_reprojected_total(static_cast<uint64_t>(c.refresh.blocks_reprojected));
  const SessionTierStats& t = s.tiers;
  const SessionTierOptions& caps = (*engine)->config().session_tiers;
  response->set_tier_sessions_host(static_cast<uint32_t>(t.host_sessions));
  response->set_tier_sessions_disk(static_cast<uint32_t>(t.disk_sessions));
  response->set_tier_bytes_host(static_cast<uint64_t>(t.host_bytes));
  response->set_tier_bytes_disk(static_cast<uint64_t>(t.disk_bytes));
  response->set_tier_capacity_bytes_host(static_cast<uint64_t>(caps.host_bytes));
  response->set_tier_capacity_bytes_disk(
      caps.disk_dir.empty() ? 0 : static_cast<uint64_t>(caps.disk_bytes));
  response->set_tier_dropped_total(static_cast<uint64_t>(t.dropped_total));
  return FinishUnary(context, absl::OkStatus());
}

}  // namespace subspace::server
