// The Chat and ChatStream RPCs on an in-process server: the prompt is the conversation as the
// template renders it (equal to Generate on those tokens), a session re-sent with new messages
// prefills only the new tokens and continues exactly, streams carry the same text, and every
// refusal is the documented status: no template or one we cannot render FAILED_PRECONDITION,
// a conversation the template rejects or a bad field INVALID_ARGUMENT naming it.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/chat/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::FixturePath;
using ::subspace::testing::ReadFileOrDie;
using ::subspace::testing::TestServerConfig;

struct Running {
  std::unique_ptr<server::ServerApp> app;
  std::unique_ptr<v1::Subspace::Stub> stub;
};

Running Start(const std::string& chat_template_path) {
  server::ServerAppConfig config = TestServerConfig();
  config.chat_template_path = chat_template_path;
  absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
  EXPECT_TRUE(app.ok()) << app.status();
  if (!app.ok()) return {};
  Running r{*std::move(app), nullptr};
  r.stub = v1::Subspace::NewStub(ChannelTo(r.app->port()));
  return r;
}

v1::ChatRequest Conversation(const std::vector<std::pair<std::string, std::string>>& turns,
                             uint32_t max_new = 12) {
  v1::ChatRequest r;
  for (const auto& [role, content] : turns) {
    v1::ChatMessage* m = r.add_messages();
    m->set_role(role);
    m->set_content(content);
  }
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

grpc::Status Chat(v1::Subspace::Stub& stub, const v1::ChatRequest& request,
                  v1::GenerateResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return stub.Chat(&context, request, response);
}

std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

const char* const kChatMl = "chat_templates/chatml.jinja";

TEST(ChatServerTest, PromptIsTheRenderedConversation) {
  Running s = Start(FixturePath(kChatMl));
  ASSERT_NE(s.app, nullptr);
  const v1::ChatRequest request = Conversation({{"system", "Be brief."}, {"user", "Hello there"}});
  v1::GenerateResponse chat;
  ASSERT_TRUE(Chat(*s.stub, request, &chat).ok());
  EXPECT_EQ(chat.token_ids_size(), 12);

  // The same prompt through Generate, rendered and encoded here.
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(ReadFileOrDie(FixturePath(kChatMl)));
  ASSERT_TRUE(t.ok());
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hello there"}};
  const std::string text = *t->Apply(messages, {.add_generation_prompt = true});
  const Tokenizer& tok = s.app->engine().tokenizer();
  const std::vector<int32_t> ids = tok.Encode(text, {.add_bos = false, .parse_special = true});
  EXPECT_EQ(chat.usage().prompt_tokens(), ids.size());
  v1::GenerateRequest generate;
  generate.mutable_tokens()->mutable_ids()->Add(ids.begin(), ids.end());
  generate.mutable_sampling()->set_max_new_tokens(12);
  generate.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  v1::GenerateResponse direct;
  ASSERT_TRUE(s.stub->Generate(&context, generate, &direct).ok());
  EXPECT_EQ(Ids(chat), Ids(direct));
  EXPECT_EQ(chat.text(), direct.text());

  grpc::ClientContext info_context;
  v1::ModelInfo info;
  ASSERT_TRUE(s.stub->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.chat_template(), "file");
  EXPECT_EQ(info.tokenizer_model(), "llama");
  EXPECT_GE(info.end_of_generation_token_ids_size(), 1);
}

TEST(ChatServerTest, SessionPrefillsOnlyTheNewTurnAndContinuesExactly) {
  Running s = Start(FixturePath(kChatMl));
  ASSERT_NE(s.app, nullptr);
  grpc::ClientContext create_context;
  v1::Session session;
  ASSERT_TRUE(s.stub->CreateSession(&create_context, v1::CreateSessionRequest(), &session).ok());
  v1::ChatRequest first = Conversation({{"user", "Tell me a story"}}, 10);
  first.set_session_id(session.session_id());
  v1::GenerateResponse reply;
  ASSERT_TRUE(Chat(*s.stub, first, &reply).ok());

  // The follow-up re-sends the conversation with the reply and a new question.
  const std::vector<std::pair<std::string, std::string>> turns = {
      {"user", "Tell me a story"}, {"assistant", reply.text()}, {"user", "And then?"}};
  v1::ChatRequest second = Conversation(turns, 10);
  second.set_session_id(session.session_id());
  v1::GenerateResponse continued;
  ASSERT_TRUE(Chat(*s.stub, second, &continued).ok());
  // At least the first call's prompt is reused (its generated tokens too, as far as the reply's
  // text encodes back to them: the random tiny model writes text that does not); only the
  // rest of the conversation is prefilled.
  EXPECT_GE(continued.usage().reused_tokens(), reply.usage().prompt_tokens());
  // Identical to the same conversation without a session.
  v1::GenerateResponse fresh;
  ASSERT_TRUE(Chat(*s.stub, Conversation(turns, 10), &fresh).ok());
  EXPECT_EQ(Ids(continued), Ids(fresh));
  EXPECT_EQ(fresh.usage().reused_tokens(), 0u);
  EXPECT_EQ(continued.usage().prompt_tokens() + continued.usage().reused_tokens(),
            fresh.usage().prompt_tokens());
}

TEST(ChatServerTest, StreamCarriesTheSameText) {
  Running s = Start(FixturePath(kChatMl));
  ASSERT_NE(s.app, nullptr);
  const v1::ChatRequest request = Conversation({{"user", "Count to five"}}, 16);
  v1::GenerateResponse unary;
  ASSERT_TRUE(Chat(*s.stub, request, &unary).ok());
  grpc::ClientContext context;
  auto reader = s.stub->ChatStream(&context, request);
  std::string text;
  v1::GenerateStreamResponse event;
  bool final_seen = false;
  while (reader->Read(&event)) {
    if (event.has_chunk()) text += event.chunk().text();
    if (event.has_final()) final_seen = true;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(final_seen);
  EXPECT_EQ(text, unary.text());
}

TEST(ChatServerTest, RefusalsAreTheDocumentedStatuses) {
  {
    // The tiny model's GGUF has no chat template.
    Running s = Start("");
    ASSERT_NE(s.app, nullptr);
    v1::GenerateResponse r;
    const grpc::Status st = Chat(*s.stub, Conversation({{"user", "hi"}}), &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "no chat template")) << st.error_message();
    grpc::ClientContext context;
    v1::ModelInfo info;
    ASSERT_TRUE(s.stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
    EXPECT_EQ(info.chat_template(), "");
  }
  {
    // Gemma's template has no system role and wants alternation: its own message comes back.
    Running s = Start(FixturePath("chat_templates/google-gemma-2-2b-it.jinja"));
    ASSERT_NE(s.app, nullptr);
    v1::GenerateResponse r;
    grpc::Status st = Chat(*s.stub, Conversation({{"system", "x"}, {"user", "hi"}}), &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "System role not supported"));
    struct Bad {
      std::function<void(v1::ChatRequest&)> mutate;
      const char* field;
    };
    for (const Bad& bad : std::vector<Bad>{
             {[](v1::ChatRequest& q) { q.clear_messages(); }, "messages must not be empty"},
             {[](v1::ChatRequest& q) { q.mutable_messages(0)->set_role("robot"); },
              "messages[0].role"},
             {[](v1::ChatRequest& q) { (*q.mutable_template_kwargs())["x y"] = "1"; },
              "template_kwargs"},
             {[](v1::ChatRequest& q) { (*q.mutable_template_kwargs())["flag"] = "yes"; },
              "template_kwargs[flag]"},
             {[](v1::ChatRequest& q) { q.mutable_sampling()->set_top_p(2.0f); }, "top_p"},
             {[](v1::ChatRequest& q) { q.set_session_id("no spaces allowed"); }, "session_id"},
         }) {
      v1::ChatRequest q = Conversation({{"user", "hi"}});
      bad.mutate(q);
      st = Chat(*s.stub, q, &r);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.field;
      EXPECT_TRUE(absl::StrContains(st.error_message(), bad.field)) << st.error_message();
    }
    v1::ChatRequest unknown = Conversation({{"user", "hi"}});
    unknown.set_session_id("0123456789abcdef0123456789abcdef");
    EXPECT_EQ(Chat(*s.stub, unknown, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // A template the renderer does not implement stops the start, naming the construct.
  server::ServerAppConfig config = TestServerConfig();
  config.chat_template_path =
      FixturePath("chat_templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja");
  const absl::Status st = server::ServerApp::Start(config).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "macro")) << st;
}

}  // namespace
}  // namespace subspace
