// Field-by-field validation of GenerateRequest and its conversion to the engine's request.
#include "server/request_validation.h"

#include <google/protobuf/unknown_field_set.h>

#include <atomic>
#include <cmath>
#include <random>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/model/sampler.h"

namespace subspace::server {
namespace {

absl::Status Invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }

absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A seed drawn per request when the client gives none; thread_local so no lock is needed.
uint64_t DrawSeed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

absl::Status ValidateText(std::string_view text, std::string_view field, int64_t max_bytes) {
  if (text.empty()) return Invalid(Absl(field), " must not be empty");
  if (static_cast<int64_t>(text.size()) > max_bytes) {
    return Invalid(Absl(field), " is ", text.size(), " bytes, at most ", max_bytes);
  }
  if (const size_t valid = ValidUtf8Prefix(text); valid != text.size()) {
    return Invalid(Absl(field), " is not valid UTF-8 (bad byte at offset ", valid, ")");
  }
  return absl::OkStatus();
}

// `on_session`: 0 new tokens is allowed (the prompt is only prefilled into the session).
absl::Status ValidateSampling(const v1::SamplingParams& s, const ModelConfig& model,
                              const RequestLimits& limits, bool on_session) {
  if (s.has_max_new_tokens()) {
    if (s.max_new_tokens() < 1 && !on_session) {
      return Invalid("sampling.max_new_tokens must be >= 1 (0 only prefills a session), got ",
                     s.max_new_tokens());
    }
    if (s.max_new_tokens() > static_cast<uint32_t>(model.context_length)) {
      return Invalid("sampling.max_new_tokens must be at most the context length ",
                     model.context_length, ", got ", s.max_new_tokens());
    }
  }
  if (s.has_temperature() && !(std::isfinite(s.temperature()) && s.temperature() >= 0.0f &&
                               s.temperature() <= kMaxTemperature)) {
    return Invalid("sampling.temperature must be in [0, ", kMaxTemperature, "], got ",
                   s.temperature());
  }
  if (s.has_top_k() && s.top_k() < 0) {
    return Invalid("sampling.top_k must be >= 0, got ", s.top_k());
  }
  if (s.has_top_p() && !(s.top_p() > 0.0f && s.top_p() <= 1.0f)) {
    return Invalid("sampling.top_p must be in (0, 1], got ", s.top_p());
  }
  if (s.has_min_p() && !(s.min_p() >= 0.0f && s.min_p() < 1.0f)) {
    return Invalid("sampling.min_p must be in [0, 1), got ", s.min_p());
  }
  if (s.has_repetition_penalty() &&
      !(std::isfinite(s.repetition_penalty()) && s.repetition_penalty() > 0.0f)) {
    return Invalid("sampling.repetition_penalty must be finite and > 0, got ",
                   s.repetition_penalty());
  }
  if (s.stop_size() > limits.max_stop_sequences) {
    return Invalid("sampling.stop has ", s.stop_size(), " entries, at most ",
                   limits.max_stop_sequences);
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (absl::Status st =
            ValidateText(s.stop(i), absl::StrCat("sampling.stop[", i, "]"), limits.max_stop_bytes);
        !st.ok()) {
      return st;
    }
  }
  if (s.has_logprobs() && s.logprobs() > static_cast<uint32_t>(kMaxLogprobs)) {
    return Invalid("sampling.logprobs must be in [0, ", kMaxLogprobs, "], got ", s.logprobs());
  }
  return absl::OkStatus();
}

}  // namespace

size_t ValidUtf8Prefix(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;  // a continuation byte or 0xF8..0xFF where a sequence must start
    }
    if (i + len > n) return i;
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return n;
}

std::string ToValidUtf8(std::string bytes) {
  size_t valid = ValidUtf8Prefix(bytes);
  if (valid == bytes.size()) return bytes;
  std::string out;
  std::string_view rest(bytes);
  while (!rest.empty()) {
    out.append(rest.substr(0, valid));
    rest.remove_prefix(valid);
    if (rest.empty()) break;
    out.append("\xef\xbf\xbd");  // U+FFFD
    rest.remove_prefix(1);
    valid = ValidUtf8Prefix(rest);
  }
  return out;
}

namespace {

// One message level of DiagnoseUnparsable; `prefix` is the path of the enclosing field.
absl::Status DiagnoseFields(std::string_view wire, const google::protobuf::Descriptor& descriptor,
                            const std::string& prefix, int depth) {
  google::protobuf::UnknownFieldSet fields;
  if (depth > 16 || !fields.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) {
    return Invalid(prefix.empty() ? "request" : prefix, " is not a valid ", descriptor.full_name(),
                   " message");
  }
  absl::flat_hash_map<int, int> seen;  // field number -> occurrences so far (repeated index)
  for (int i = 0; i < fields.field_count(); ++i) {
    const google::protobuf::UnknownField& f = fields.field(i);
    const google::protobuf::FieldDescriptor* fd = descriptor.FindFieldByNumber(f.number());
    const int index = seen[f.number()]++;
    if (fd == nullptr || f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      continue;
    }
    std::string path = absl::StrCat(prefix, fd->name());
    if (fd->is_repeated()) absl::StrAppend(&path, "[", index, "]");
    if (fd->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
      const std::string& value = f.length_delimited();
      if (const size_t valid = ValidUtf8Prefix(value); valid != value.size()) {
        return Invalid(path, " is not valid UTF-8 (bad byte at offset ", valid, ")");
      }
    } else if (fd->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      if (absl::Status s = DiagnoseFields(f.length_delimited(), *fd->message_type(),
                                          absl::StrCat(path, "."), depth + 1);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DiagnoseUnparsable(std::string_view wire,
                                const google::protobuf::Descriptor& descriptor) {
  absl::Status s = DiagnoseFields(wire, descriptor, "", 0);
  if (!s.ok()) return s;
  return Invalid("request is not a valid ", descriptor.full_name(), " message");
}

absl::Status ValidateId(std::string_view id, std::string_view field, const RequestLimits& limits) {
  if (id.empty()) return Invalid(Absl(field), " must not be empty");
  if (static_cast<int>(id.size()) > limits.max_id_bytes) {
    return Invalid(Absl(field), " is ", id.size(), " bytes, at most ", limits.max_id_bytes);
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c < 0x21 || c > 0x7E) {
      return Invalid(Absl(field), " must be printable ASCII without spaces (bad byte 0x",
                     absl::Hex(c, absl::kZeroPad2), " at offset ", i, ")");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateProposedSessionId(std::string_view id, std::string_view field) {
  if (id.empty()) return absl::OkStatus();
  if (static_cast<int>(id.size()) < kMinProposedSessionIdBytes ||
      static_cast<int>(id.size()) > kMaxProposedSessionIdBytes) {
    return Invalid(Absl(field), " must be ", kMinProposedSessionIdBytes, " to ",
                   kMaxProposedSessionIdBytes, " characters, got ", id.size());
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    c == '_' || c == '-';
    if (!ok) {
      return Invalid(Absl(field), " may hold only [A-Za-z0-9_-] (bad byte 0x",
                     absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2), " at offset ", i,
                     ")");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidGenerateRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                             const ModelConfig& model,
                                                             const RequestLimits& limits) {
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (absl::Status s = ValidateText(request.text(), "text", limits.max_prompt_bytes); !s.ok()) {
        return s;
      }
      break;
    case v1::GenerateRequest::kTokens: {
      const auto& ids = request.tokens().ids();
      if (ids.empty()) return Invalid("tokens.ids must not be empty");
      if (ids.size() > model.context_length) {
        return Invalid("tokens.ids has ", ids.size(), " tokens, more than the context length ",
                       model.context_length);
      }
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= model.n_vocab) {
          return Invalid("tokens.ids[", i, "] must be in [0, ", model.n_vocab, "), got ", ids[i]);
        }
      }
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return Invalid("prompt is required: set text or tokens");
  }
  if (!request.session_id().empty()) {
    if (absl::Status s = ValidateId(request.session_id(), "session_id", limits); !s.ok()) return s;
  }
  if (!request.request_id().empty()) {
    if (absl::Status s = ValidateId(request.request_id(), "request_id", limits); !s.ok()) return s;
  }
  if (request.has_sampling()) {
    if (absl::Status s = ValidateSampling(request.sampling(), model, limits,
                                          /*on_session=*/!request.session_id().empty());
        !s.ok()) {
      return s;
    }
  }
  return ValidGenerateRequest(request);
}

absl::StatusOr<GenerateRequest> ToEngineRequest(const ValidGenerateRequest& valid,
                                                const Tokenizer& tokenizer,
                                                const ModelConfig& model,
                                                const RequestLimits& limits,
                                                bool continues_session) {
  const v1::GenerateRequest& request = valid.get();
  GenerateRequest out;
  out.request_id = request.request_id().empty() ? NewRequestId() : request.request_id();
  out.session_id = request.session_id();
  if (request.prompt_case() == v1::GenerateRequest::kText) {
    // BOS starts a sequence; a session that already has tokens continues one.
    out.prompt = tokenizer.Encode(
        request.text(),
        {.add_bos = tokenizer.add_bos() && !continues_session, .parse_special = false});
    if (out.prompt.empty()) return Invalid("text encodes to no tokens");
    if (static_cast<int64_t>(out.prompt.size()) > model.context_length) {
      return Invalid("text encodes to ", out.prompt.size(),
                     " tokens, more than the context length ", model.context_length);
    }
  } else {
    out.prompt.assign(request.tokens().ids().begin(), request.tokens().ids().end());
  }

  const v1::SamplingParams& s = request.sampling();
  out.max_new_tokens = s.has_max_new_tokens() ? static_cast<int32_t>(s.max_new_tokens())
                                              : limits.default_max_new_tokens;
  out.sampling.temperature = s.has_temperature() ? s.temperature() : 0.0f;
  out.sampling.top_k = s.has_top_k() ? s.top_k() : 0;
  out.sampling.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  out.sampling.min_p = s.has_min_p() ? s.min_p() : 0.0f;
  out.sampling.repetition_penalty = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  out.sampling.seed = s.has_seed() ? s.seed() : DrawSeed();
  out.sampling.logprobs = s.has_logprobs() ? static_cast<int32_t>(s.logprobs()) : 0;
  out.stop.assign(s.stop().begin(), s.stop().end());
  out.ignore_eos = s.ignore_eos();
  return out;
}

std::string NewRequestId() {
  static const uint32_t kProcessPrefix = std::random_device{}();
  static std::atomic<uint32_t> counter{0};
  return absl::StrFormat("%08x%08x", kProcessPrefix,
                         counter.fetch_add(1, std::memory_order_relaxed));
}

}  // namespace subspace::server
