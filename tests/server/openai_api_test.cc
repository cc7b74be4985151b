// Unit tests of openai_api: OpenAI request bodies into the gRPC API's messages (defaults,
// extensions, every refusal naming its field), field names in the shared validation's messages,
// error bodies and HTTP statuses, and the JSON of answers and stream chunks.
#include "server/openai_api.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::server::openai {
namespace {

using Json = nlohmann::json;

const ApiContext kContext{.model_id = "tiny", .context_length = 256};

absl::StatusOr<CompletionRequest> Completion(const std::string& body) {
  return ParseCompletionRequest(body, kContext);
}
absl::StatusOr<ChatCompletionRequest> Chat(const std::string& body) {
  return ParseChatCompletionRequest(body, kContext);
}

TEST(ParseCompletionRequestTest, FieldsAndOpenAiDefaults) {
  absl::StatusOr<CompletionRequest> r = Completion(R"({"model": "tiny", "prompt": "Hello"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.text(), "Hello");
  EXPECT_EQ(r->request.sampling().max_new_tokens(), 16u);  // OpenAI's completions default
  EXPECT_FLOAT_EQ(r->request.sampling().temperature(), 1.0f);
  EXPECT_FALSE(r->request.sampling().has_seed());
  EXPECT_FALSE(r->stream);
  EXPECT_EQ(r->logprobs, -1);

  r = Completion(R"({"model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 3,
    "temperature": 0, "top_p": 0.5, "seed": -1, "stop": "\n", "logprobs": 2, "stream": true,
    "stream_options": {"include_usage": true}, "n": 1, "echo": false, "best_of": 1,
    "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
    "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": true,
    "session_id": "s1", "suffix": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.tokens().ids_size(), 3);
  const v1::SamplingParams& s = r->request.sampling();
  EXPECT_EQ(s.max_new_tokens(), 3u);
  EXPECT_EQ(s.temperature(), 0.0f);
  EXPECT_FLOAT_EQ(s.top_p(), 0.5f);
  EXPECT_EQ(s.seed(), ~uint64_t{0});  // a negative seed's bits
  ASSERT_EQ(s.stop_size(), 1);
  EXPECT_EQ(s.stop(0), "\n");
  EXPECT_EQ(s.logprobs(), 2u);
  EXPECT_EQ(s.top_k(), 40);
  EXPECT_FLOAT_EQ(s.min_p(), 0.05f);
  EXPECT_FLOAT_EQ(s.repetition_penalty(), 1.1f);
  EXPECT_TRUE(s.ignore_eos());
  EXPECT_EQ(r->request.session_id(), "s1");
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->logprobs, 2);

  r = Completion(R"({"model": "tiny", "prompt": [1, 2]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.tokens().ids_size(), 2);
  r = Completion(R"({"model": "tiny", "prompt": ["one"], "stop": ["a", "b"]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.text(), "one");
  EXPECT_EQ(r->request.sampling().stop_size(), 2);
}

TEST(ParseChatCompletionRequestTest, MessagesPartsAndDefaults) {
  absl::StatusOr<ChatCompletionRequest> r = Chat(R"({"model": "tiny", "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                    "text": "there"}], "name": "ann"},
      {"role": "assistant", "content": null}],
    "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 3,
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
    "chat_template_kwargs": {"enable_thinking": false, "who": "me"},
    "add_generation_prompt": true})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->request.messages_size(), 3);
  EXPECT_EQ(r->request.messages(0).role(), "system");
  EXPECT_EQ(r->request.messages(1).content(), "Hi there");
  EXPECT_EQ(r->request.messages(2).content(), "");
  EXPECT_EQ(r->request.sampling().max_new_tokens(), 5u);
  EXPECT_EQ(r->request.sampling().logprobs(), 3u);
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 3);
  EXPECT_EQ(r->request.template_kwargs().at("enable_thinking"), "false");
  EXPECT_EQ(r->request.template_kwargs().at("who"), "\"me\"");

  // No length limit given: the answer may run to the end of the context.
  r = Chat(R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.sampling().max_new_tokens(), 256u);
  EXPECT_FLOAT_EQ(r->request.sampling().temperature(), 1.0f);
  EXPECT_FALSE(r->logprobs);
  EXPECT_EQ(r->request.sampling().logprobs(), 0u);
}

// Each bad body: a 400 whose message names what is wrong.
TEST(ParseRequestTest, RefusalsNameTheField) {
  const struct {
    std::string body;
    std::string message;  // a substring
  } cases[] = {
      {"", "body is empty"},
      {"[1, 2]", "must be a JSON object, got array"},
      {"{\"model\": \"tiny\",", "not valid JSON"},
      {"{\"model\": \"tiny\", \"prompt\": \"a\"} trailing", "not valid JSON"},
      {"{\"model\": \"tiny\", \"prompt\": \"\xff\"}", "not valid JSON"},  // invalid UTF-8
      {R"({"prompt": "a"})", "model is required"},
      {R"({"model": 5, "prompt": "a"})", "model must be a string, got number"},
      {R"({"model": "tiny"})", "prompt is required"},
      {R"({"model": "tiny", "prompt": 5})", "prompt must be a string or an array"},
      {R"({"model": "tiny", "prompt": []})", "prompt must not be empty"},
      {R"({"model": "tiny", "prompt": ["a", "b"]})", "one prompt per request (got 2)"},
      {R"({"model": "tiny", "prompt": [1, "a"]})", "prompt[1] must be an integer, got string"},
      {R"({"model": "tiny", "prompt": [-1]})", "prompt[0] must be in [0, 2147483647], got -1"},
      {R"({"model": "tiny", "prompt": "a", "max_tokens": -1})", "max_tokens must be in [0, "},
      {R"({"model": "tiny", "prompt": "a", "max_tokens": 1.5})",
       "max_tokens must be an integer, got number"},
      {R"({"model": "tiny", "prompt": "a", "max_tokens": 99999999999999999999})",
       "max_tokens must be an integer"},
      {R"({"model": "tiny", "prompt": "a", "temperature": "hot"})",
       "temperature must be a number, got string"},
      {R"({"model": "tiny", "prompt": "a", "temperature": 1e300})",
       "temperature must be a finite number"},
      {R"({"model": "tiny", "prompt": "a", "seed": 1.5})", "seed must be an integer"},
      {R"({"model": "tiny", "prompt": "a", "stop": 3})", "stop must be a string or an array"},
      {R"({"model": "tiny", "prompt": "a", "stop": ["a", ""]})", "stop[1] must not be empty"},
      {R"({"model": "tiny", "prompt": "a", "stream": "yes"})", "stream must be a boolean"},
      {R"({"model": "tiny", "prompt": "a", "stream_options": {"include_usage": true}})",
       "stream_options is only allowed when stream is true"},
      {R"({"model": "tiny", "prompt": "a", "stream": true, "stream_options": {"x": 1}})",
       "unknown field 'stream_options.x'"},
      {R"({"model": "tiny", "prompt": "a", "n": 2})", "n is not supported"},
      {R"({"model": "tiny", "prompt": "a", "echo": true})", "echo is not supported"},
      {R"({"model": "tiny", "prompt": "a", "best_of": 3})", "best_of is not supported"},
      {R"({"model": "tiny", "prompt": "a", "suffix": "z"})", "suffix is not supported"},
      {R"({"model": "tiny", "prompt": "a", "presence_penalty": 0.5})",
       "presence_penalty is not supported by this server: use repetition_penalty"},
      {R"({"model": "tiny", "prompt": "a", "logit_bias": {"5": 100}})",
       "logit_bias is not supported"},
      {R"({"model": "tiny", "prompt": "a", "logprobs": 21})", "logprobs must be in [0, 20]"},
      {R"({"model": "tiny", "prompt": "a", "foo": 1})", "unknown field 'foo'"},
      {std::string("{\"model\": \"tiny\", \"prompt\": \"a\", \"") + std::string(200, 'k') +
           "\": 1}",
       "unknown field 'kkkk"},
      {std::string(200, '[') + std::string(200, ']'), "nests deeper than 16 levels"},
  };
  for (const auto& c : cases) {
    const absl::StatusOr<CompletionRequest> r = Completion(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.body << "\n  got: " << r.status().message();
  }
}

TEST(ParseRequestTest, ChatRefusalsNameTheField) {
  const struct {
    std::string body;
    std::string message;
  } cases[] = {
      {R"({"model": "tiny"})", "messages is required"},
      {R"({"model": "tiny", "messages": {}})", "messages must be an array, got object"},
      {R"({"model": "tiny", "messages": []})", "messages must not be empty"},
      {R"({"model": "tiny", "messages": ["hi"]})", "messages[0] must be an object, got string"},
      {R"({"model": "tiny", "messages": [{"content": "hi"}]})", "messages[0].role is required"},
      {R"({"model": "tiny", "messages": [{"role": "user"}]})", "messages[0].content is required"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": 5}]})",
       "messages[0].content must be a string or an array of parts, got number"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "x"}}]}]})",
       "messages[0].content[0].type is not supported by this server: 'image_url'"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]})",
       "messages[0].content[0].text is required"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x", "mood": "ok"}]})",
       "unknown field 'messages[0].mood'"},
      {R"({"model": "tiny", "messages": [{"role": "assistant", "tool_calls": []}]})",
       "messages[0].tool_calls is not supported"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
          "max_completion_tokens": 2})",
       "not both"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
       "top_logprobs needs logprobs set to true"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 1})",
       "logprobs must be a boolean, got number"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_object"}})",
       "response_format is not supported"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function"}]})",
       "tools is not supported"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "chat_template_kwargs": {"a": [1]}})",
       "chat_template_kwargs.a must be a string, number, boolean or null"},
  };
  for (const auto& c : cases) {
    const absl::StatusOr<ChatCompletionRequest> r = Chat(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.body << "\n  got: " << r.status().message();
  }
}

TEST(ParseRequestTest, AnotherModelIsNotFound) {
  const absl::StatusOr<ChatCompletionRequest> r =
      Chat(R"({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})");
  ASSERT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "the model 'gpt-4o' does not exist; this server serves 'tiny'");
  const Json error = Json::parse(ErrorJson(r.status()));
  EXPECT_EQ(error["error"]["code"], "model_not_found");
  EXPECT_EQ(HttpStatusFor(r.status().code()), 404);
}

// Only the model check says model_not_found: another NOT_FOUND whose message happens to name a
// model (a session id such as "my-model-chat") is a plain not_found.
TEST(ErrorJsonTest, OnlyTheModelCheckIsModelNotFound) {
  const Json session = Json::parse(
      ErrorJson(absl::NotFoundError("session 'my-model-chat' does not exist (or has expired)")));
  EXPECT_EQ(session["error"]["code"], "not_found");
  EXPECT_EQ(session["error"]["type"], "invalid_request_error");
}

TEST(ParseSessionCreateRequestTest, OptionalFields) {
  absl::StatusOr<SessionCreateRequest> r = ParseSessionCreateRequest("");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->idle_ttl_seconds, 0u);
  r = ParseSessionCreateRequest(R"({"ttl_seconds": 60, "session_id": "abc"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->idle_ttl_seconds, 60u);
  EXPECT_EQ(r->session_id, "abc");
  EXPECT_FALSE(ParseSessionCreateRequest(R"({"ttl_seconds": -1})").ok());
  EXPECT_FALSE(ParseSessionCreateRequest(R"({"ttl": 1})").ok());
}

TEST(RenameFieldsTest, TheSharedValidationSpeaksThisApi) {
  const auto renamed = [](const std::string& message, bool chat) {
    return std::string(RenameFields(absl::InvalidArgumentError(message), chat).message());
  };
  EXPECT_EQ(renamed("sampling.top_p must be in (0, 1], got 3", false),
            "top_p must be in (0, 1], got 3");
  EXPECT_EQ(renamed("sampling.max_new_tokens must be at most 256", true),
            "max_tokens must be at most 256");
  EXPECT_EQ(renamed("sampling.logprobs must be at most 20", true),
            "top_logprobs must be at most 20");
  EXPECT_EQ(renamed("tokens.ids[3] must be in [0, 100), got 200", false),
            "prompt[3] must be in [0, 100), got 200");
  EXPECT_EQ(renamed("text encodes to no tokens", false), "prompt encodes to no tokens");
  EXPECT_EQ(renamed("template_kwargs[x] is set by the server", true),
            "chat_template_kwargs[x] is set by the server");
  EXPECT_EQ(renamed("messages[0].role must be ...", true), "messages[0].role must be ...");
  EXPECT_TRUE(RenameFields(absl::OkStatus(), true).ok());
  EXPECT_EQ(RenameFields(absl::NotFoundError("x"), true).code(), absl::StatusCode::kNotFound);
}

// OpenAI's `param`: the request field an error is about, as the message names it.
TEST(ErrorJsonTest, ParamNamesTheField) {
  const auto param = [](const absl::Status& st) {
    const Json e = Json::parse(ErrorJson(st));
    return e["error"]["param"].is_null() ? std::string("null")
                                         : e["error"]["param"].get<std::string>();
  };
  const struct {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": "a"})",
       "top_p"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "colour": 1})",
       "colour"},
      {R"({"messages": [{"role": "user", "content": "x"}]})", "model"},
      {R"({"model": "tiny", "messages": []})", "messages"},
      {R"({"model": "tiny", "messages": [{"content": "x"}]})", "messages[0].role"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "stream_options": {"include_usage": true}})",
       "stream_options"},
      {R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "chat_template_kwargs": {"a": [1]}})",
       "chat_template_kwargs.a"},
  };
  for (const auto& c : cases) {
    const absl::StatusOr<ChatCompletionRequest> r = Chat(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(param(r.status()), c.param) << c.body << "\n  " << r.status();
  }
  // The shared validation's messages, renamed: the field is the renamed one.
  EXPECT_EQ(param(RenameFields(
                absl::InvalidArgumentError("sampling.top_p must be in (0, 1], got 3"), false)),
            "top_p");
  EXPECT_EQ(
      param(RenameFields(absl::InvalidArgumentError("tokens.ids[3] must be in [0, 9)"), false)),
      "prompt[3]");
  // Not about a field: null.
  EXPECT_EQ(param(absl::ResourceExhaustedError("the queue is full")), "null");
  EXPECT_EQ(param(absl::InvalidArgumentError("the request body is not valid JSON")), "null");
}

TEST(ErrorJsonTest, StatusesAndShape) {
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kFailedPrecondition), 409);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInternal), 500);
  const Json e = Json::parse(ErrorJson(absl::ResourceExhaustedError("the queue is full")));
  EXPECT_EQ(e["error"]["message"], "the queue is full");
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
  EXPECT_EQ(e["error"]["code"], "rate_limit_exceeded");
  EXPECT_TRUE(e["error"]["param"].is_null());
  // A message with invalid UTF-8 (an echo of client bytes) still makes valid JSON.
  const std::string bad = ErrorJson(absl::InvalidArgumentError("bad \xff byte"));
  EXPECT_NO_THROW(Json::parse(bad));
  EXPECT_EQ(Json::parse(ErrorJsonForHttpStatus(413))["error"]["code"], "payload_too_large");
}

class AnswerJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TinyModel> m = testing::LoadTinyModel();
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
  }
  std::vector<GeneratedTokenEvent> Tokens() const {
    // Two byte tokens: 'h' and 'i', the first with one alternative.
    GeneratedTokenEvent h{.token = testing::kTinyFirstByte + 'h', .text = "h", .logprob = -0.5f};
    h.top.push_back({.token = testing::kTinyFirstByte + 'h', .logprob = -0.5f});
    GeneratedTokenEvent i{.token = testing::kTinyFirstByte + 'i', .text = "i", .logprob = -1.0f};
    return {h, i};
  }
  testing::TinyModel model_;
  const ResponseMeta meta_{.id = "chatcmpl-1", .created = 7, .model = "tiny"};
  const GenerateUsage usage_{.prompt_tokens = 5, .reused_tokens = 2, .generated_tokens = 2};
};

TEST_F(AnswerJsonTest, ChatCompletion) {
  const Json j = Json::parse(ChatCompletionJson(meta_, "hi", Tokens(), /*logprobs=*/true,
                                                FinishReason::kEos, usage_, *model_.tokenizer));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_EQ(j["created"], 7);
  EXPECT_FALSE(j.contains("session_id"));
  const Json& choice = j["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_EQ(choice["message"]["content"], "hi");
  EXPECT_EQ(choice["finish_reason"], "stop");
  const Json& lp = choice["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0]["token"], "h");
  EXPECT_EQ(lp[0]["bytes"], Json::array({int{'h'}}));
  EXPECT_FLOAT_EQ(lp[0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 1u);
  EXPECT_EQ(lp[1]["top_logprobs"].size(), 0u);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["completion_tokens"], 2);
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
}

TEST_F(AnswerJsonTest, CompletionWithLogprobsAndSession) {
  ResponseMeta meta = meta_;
  meta.session_id = "s";
  const Json j = Json::parse(CompletionJson(meta, "hi", Tokens(), /*logprobs=*/1,
                                            FinishReason::kLength, usage_, *model_.tokenizer));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["session_id"], "s");
  const Json& choice = j["choices"][0];
  EXPECT_EQ(choice["text"], "hi");
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(choice["logprobs"]["tokens"], Json::array({"h", "i"}));
  EXPECT_EQ(choice["logprobs"]["text_offset"], Json::array({0, 1}));
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][0].size(), 1u);
  EXPECT_TRUE(Json::parse(CompletionJson(meta, "hi", Tokens(), -1, FinishReason::kLength, usage_,
                                         *model_.tokenizer))["choices"][0]["logprobs"]
                  .is_null());
}

// "data: {...}\n\n" -> the object.
Json EventJson(const std::string& event) {
  EXPECT_EQ(event.rfind("data: ", 0), 0u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
  return Json::parse(event.substr(6, event.size() - 8));
}

TEST_F(AnswerJsonTest, StreamChunks) {
  const Tokenizer& tok = *model_.tokenizer;
  Json first = EventJson(ChatChunk(meta_, "", {}, false, /*first=*/true, std::nullopt,
                                   /*include_usage=*/true, tok));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], (Json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  Json mid = EventJson(ChatChunk(meta_, "hi", Tokens(), true, false, std::nullopt, false, tok));
  EXPECT_EQ(mid["choices"][0]["delta"], (Json{{"content", "hi"}}));
  EXPECT_EQ(mid["choices"][0]["logprobs"]["content"].size(), 2u);
  EXPECT_FALSE(mid.contains("usage"));
  Json last = EventJson(ChatChunk(meta_, "", {}, true, false, FinishReason::kStop, false, tok));
  EXPECT_EQ(last["choices"][0]["delta"], Json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  Json usage = EventJson(UsageChunk(meta_, /*chat=*/true, usage_));
  EXPECT_EQ(usage["choices"], Json::array());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
  Json text = EventJson(CompletionChunk(meta_, "hi", Tokens(), 0, std::nullopt, false, tok));
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  EXPECT_EQ(text["choices"][0]["logprobs"]["top_logprobs"][0].size(), 0u);  // 0 alternatives
  Json error = EventJson(ErrorChunk(absl::InternalError("boom")));
  EXPECT_EQ(error["error"]["message"], "boom");
}

TEST(ModelJsonTest, ListAndOne) {
  const Json list = Json::parse(ModelListJson("tiny", 3));
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0], Json::parse(ModelJson("tiny", 3)));
  EXPECT_EQ(list["data"][0]["id"], "tiny");
  EXPECT_EQ(list["data"][0]["object"], "model");
}

}  // namespace
}  // namespace subspace::server::openai
