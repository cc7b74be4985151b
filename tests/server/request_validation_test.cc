// Unit tests of request_validation: the UTF-8 and id checks, defaults filled in, BOS handling
// for sessions, and a message naming the field for each kind of bad value.
#include "server/request_validation.h"

#include <google/protobuf/stubs/logging.h>

#include <functional>
#include <set>
#include <string>

#include "core/model/sampler.h"
#include "gtest/gtest.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::server {
namespace {

TEST(ValidUtf8PrefixTest, AcceptsValidAndStopsAtTheFirstBadByte) {
  EXPECT_EQ(ValidUtf8Prefix(""), 0u);
  EXPECT_EQ(ValidUtf8Prefix("plain ascii"), 11u);
  EXPECT_EQ(ValidUtf8Prefix("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), 14u);  // é € 😀
  EXPECT_EQ(ValidUtf8Prefix("ab\x80"), 2u);             // stray continuation byte
  EXPECT_EQ(ValidUtf8Prefix("ab\xc0\xaf"), 2u);         // overlong '/'
  EXPECT_EQ(ValidUtf8Prefix("a\xe0\x80\xaf"), 1u);      // overlong, 3 bytes
  EXPECT_EQ(ValidUtf8Prefix("a\xed\xa0\x80"), 1u);      // surrogate U+D800
  EXPECT_EQ(ValidUtf8Prefix("a\xf4\x90\x80\x80"), 1u);  // past U+10FFFF
  EXPECT_EQ(ValidUtf8Prefix("a\xe2\x82"), 1u);          // truncated
  EXPECT_EQ(ValidUtf8Prefix("a\xff"), 1u);
  EXPECT_EQ(ValidUtf8Prefix(std::string("a\0b", 3)), 3u);  // NUL is valid UTF-8
}

TEST(ToValidUtf8Test, ReplacesEachBadByte) {
  EXPECT_EQ(ToValidUtf8("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(ToValidUtf8("\xe2"), "\xef\xbf\xbd");
  EXPECT_EQ(ToValidUtf8("a\xe2\x82z\xff"), "a\xef\xbf\xbd\xef\xbf\xbdz\xef\xbf\xbd");
  const std::string fixed = ToValidUtf8("\xc0\xaf\xed\xa0\x80ok");  // overlong, surrogate
  EXPECT_EQ(ValidUtf8Prefix(fixed), fixed.size());
  EXPECT_EQ(fixed.substr(fixed.size() - 2), "ok");
}

TEST(ValidateIdTest, PrintableAsciiWithinTheLimit) {
  RequestLimits limits;
  EXPECT_TRUE(ValidateId("abc-123_X.y", "session_id", limits).ok());
  EXPECT_EQ(ValidateId("", "session_id", limits).message(), "session_id must not be empty");
  EXPECT_EQ(ValidateId(std::string(129, 'a'), "request_id", limits).message(),
            "request_id is 129 bytes, at most 128");
  EXPECT_EQ(ValidateId("a\nb", "request_id", limits).message(),
            "request_id must be printable ASCII without spaces (bad byte 0x0a at offset 1)");
}

TEST(DiagnoseUnparsableTest, NamesTheStringThatIsNotUtf8) {
  v1::GenerateRequest r;
  r.set_text("fine");
  r.mutable_sampling()->add_stop("a");
  r.mutable_sampling()->add_stop("b\xff");
  std::string wire;
  {
    google::protobuf::LogSilencer silence;
    ASSERT_TRUE(r.SerializeToString(&wire));
  }
  const absl::Status s = DiagnoseUnparsable(wire, *v1::GenerateRequest::descriptor());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "sampling.stop[1] is not valid UTF-8 (bad byte at offset 1)");
  EXPECT_EQ(DiagnoseUnparsable("\xff\xff\xff", *v1::GenerateRequest::descriptor()).message(),
            "request is not a valid subspace.v1.GenerateRequest message");
}

class ToEngineRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TinyModel> m = testing::LoadTinyModel();
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
  }
  // As the service does: checked once, then converted.
  absl::StatusOr<GenerateRequest> Convert(const v1::GenerateRequest& r, bool continues = false) {
    absl::StatusOr<ValidGenerateRequest> valid =
        ValidateGenerateRequest(r, model_.model->config(), limits_);
    if (!valid.ok()) return valid.status();
    absl::StatusOr<GenerateRequest> out =
        ToEngineRequest(*valid, *model_.tokenizer, model_.model->config(), limits_, continues);
    // What the server accepts, the sampler must accept: the two checks agree.
    if (out.ok()) EXPECT_TRUE(ValidateSamplingParams(out->sampling).ok());
    return out;
  }
  testing::TinyModel model_;
  RequestLimits limits_;
};

TEST_F(ToEngineRequestTest, DefaultsAndGeneratedFields) {
  v1::GenerateRequest r;
  r.set_text("hello world");
  absl::StatusOr<GenerateRequest> a = Convert(r);
  absl::StatusOr<GenerateRequest> b = Convert(r);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->prompt.front(), testing::kTinyBos);
  EXPECT_EQ(a->max_new_tokens, 64);
  EXPECT_EQ(a->sampling.temperature, 0.0f);
  EXPECT_EQ(a->sampling.top_k, 0);
  EXPECT_EQ(a->sampling.top_p, 1.0f);
  EXPECT_EQ(a->sampling.min_p, 0.0f);
  EXPECT_EQ(a->sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(a->sampling.logprobs, 0);
  EXPECT_FALSE(a->ignore_eos);
  EXPECT_EQ(a->deadline, absl::InfiniteFuture());
  EXPECT_EQ(a->request_id.size(), 16u);
  EXPECT_NE(a->request_id, b->request_id);
  EXPECT_NE(a->sampling.seed, b->sampling.seed);  // drawn: equal with probability 2^-64
}

TEST_F(ToEngineRequestTest, ExplicitFieldsPassThrough) {
  v1::GenerateRequest r;
  r.mutable_tokens()->add_ids(5);
  r.mutable_tokens()->add_ids(7);
  r.set_session_id("s1");
  r.set_request_id("r1");
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_max_new_tokens(9);
  s->set_temperature(0.7f);
  s->set_top_k(40);
  s->set_top_p(0.9f);
  s->set_min_p(0.05f);
  s->set_repetition_penalty(1.1f);
  s->set_seed(42);
  s->add_stop("\n\n");
  s->set_logprobs(2);
  s->set_ignore_eos(true);
  absl::StatusOr<GenerateRequest> out = Convert(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->prompt, (std::vector<int32_t>{5, 7}));
  EXPECT_EQ(out->session_id, "s1");
  EXPECT_EQ(out->request_id, "r1");
  EXPECT_EQ(out->max_new_tokens, 9);
  EXPECT_EQ(out->sampling.temperature, 0.7f);
  EXPECT_EQ(out->sampling.top_k, 40);
  EXPECT_EQ(out->sampling.top_p, 0.9f);
  EXPECT_EQ(out->sampling.min_p, 0.05f);
  EXPECT_EQ(out->sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(out->sampling.seed, 42u);
  EXPECT_EQ(out->sampling.logprobs, 2);
  EXPECT_EQ(out->stop, (std::vector<std::string>{"\n\n"}));
  EXPECT_TRUE(out->ignore_eos);
}

TEST_F(ToEngineRequestTest, ContinuingASessionAddsNoBos) {
  v1::GenerateRequest r;
  r.set_text("hello");
  absl::StatusOr<GenerateRequest> fresh = Convert(r, /*continues=*/false);
  absl::StatusOr<GenerateRequest> cont = Convert(r, /*continues=*/true);
  ASSERT_TRUE(fresh.ok() && cont.ok());
  EXPECT_EQ(fresh->prompt.size(), cont->prompt.size() + 1);
  EXPECT_EQ(fresh->prompt.front(), testing::kTinyBos);
  EXPECT_NE(cont->prompt.front(), testing::kTinyBos);
}

TEST_F(ToEngineRequestTest, BadFieldsAreNamed) {
  struct Case {
    std::function<void(v1::GenerateRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::GenerateRequest& r) { r.clear_prompt(); }, "prompt is required: set text or tokens"},
      {[](v1::GenerateRequest& r) { r.set_text("ok \xc3("); },
       "text is not valid UTF-8 (bad byte at offset 3)"},
      {[](v1::GenerateRequest& r) { r.set_text(std::string((1 << 20) + 1, 'a')); },
       "text is 1048577 bytes, at most 1048576"},
      {[](v1::GenerateRequest& r) { r.mutable_tokens()->add_ids(316); },
       "tokens.ids[0] must be in [0, 316), got 316"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->add_stop("\xff"); },
       "sampling.stop[0] is not valid UTF-8 (bad byte at offset 0)"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_p(1.5f); },
       "sampling.top_p must be in (0, 1], got 1.5"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_max_new_tokens(129); },
       "sampling.max_new_tokens must be at most the context length 128, got 129"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r;
    r.set_text("hello");
    c.mutate(r);
    absl::StatusOr<GenerateRequest> out = Convert(r);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(out.status().message(), c.message);
  }
}

}  // namespace
}  // namespace subspace::server
