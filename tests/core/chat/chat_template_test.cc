// ChatTemplate on the stored templates: the prompts they give for a known conversation (the
// byte-for-byte comparison with python3-jinja2 over many more is chat_template_oracle), how a
// template's own rejection and an unsupported construct surface as statuses, and the limits
// that keep a hostile template from hanging or exhausting the stack.
#include "core/chat/chat_template.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::FixturePath;
using ::subspace::testing::ReadFileOrDie;

ChatTemplate Load(const std::string& name) {
  absl::StatusOr<ChatTemplate> t =
      ChatTemplate::Parse(ReadFileOrDie(FixturePath("chat_templates/" + name)));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

const std::vector<ChatMessage> kConversation = {
    {"system", "You are helpful."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};

TEST(ChatTemplateTest, ChatMlAndQwen) {
  const std::string want =
      "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(*Load("chatml.jinja").Apply(kConversation, {}), want);
  EXPECT_EQ(*Load("Qwen-Qwen2.5-7B-Instruct.jinja").Apply(kConversation, {}), want);
  // Qwen3 with thinking switched off opens an empty think block.
  EXPECT_EQ(*Load("Qwen-Qwen3.jinja")
                 .Apply(kConversation, {.extra = {{"enable_thinking", jinja::Value::Bool(false)}}}),
            want + "<think>\n\n</think>\n\n");
}

TEST(ChatTemplateTest, Llama3) {
  const std::string got = *Load("meta-llama-Llama-3.1-8B-Instruct.jinja")
                               .Apply(kConversation, {.bos_token = "<|begin_of_text|>"});
  EXPECT_EQ(got,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            "You are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, TheTemplatesOwnRulesAreInvalidArgument) {
  // Gemma has no system role and wants user/assistant alternation.
  const ChatTemplate gemma = Load("google-gemma-2-2b-it.jinja");
  absl::StatusOr<std::string> r = gemma.Apply(kConversation, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("System role not supported"), std::string::npos);
  const std::vector<ChatMessage> twice = {{"user", "a"}, {"user", "b"}};
  EXPECT_EQ(gemma.Apply(twice, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*gemma.Apply({{{"user", "a"}}}, {.bos_token = "<bos>"}),
            "<bos><start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\n");
}

TEST(ChatTemplateTest, UnsupportedConstructsAreFailedPreconditionNamingThem) {
  absl::StatusOr<ChatTemplate> hermes = ChatTemplate::Parse(ReadFileOrDie(
      FixturePath("chat_templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja")));
  ASSERT_FALSE(hermes.ok());
  EXPECT_EQ(hermes.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(hermes.status().message().find("macro"), std::string::npos);
  for (const char* source : {"{% include 'x' %}", "{{ '%s' % x }}", "{% set x %}y{% endset %}",
                             "{{ a|wordwrap }}", "{{ x is divisibleby }}"}) {
    SCOPED_TRACE(source);
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
    absl::Status st = t.ok() ? t->Apply(kConversation, {}).status() : t.status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  }
  for (const char* source : {"{% if %}", "{{ (1 }}", "{% for x in %}{% endfor %}", "{{ 'a }}",
                             "{% endif %}", "{% if true %}"}) {
    SCOPED_TRACE(source);
    EXPECT_EQ(ChatTemplate::Parse(source).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

// Python's integers are unbounded; ours are 64-bit and refuse to wrap (UBSan would catch a
// wrap, the fuzzer looks for one).
TEST(ChatTemplateTest, IntegerOverflowIsRefusedNotWrapped) {
  for (const char* source : {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
                             "{{ 4611686018427387904 * 2 }}", "{{ 2 ** 64 }}", "{{ 1e300 | int }}",
                             "{{ (-9223372036854775807 - 1) // -1 }}"}) {
    SCOPED_TRACE(source);
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->Apply(kConversation, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  absl::StatusOr<ChatTemplate> fine = ChatTemplate::Parse(
      "{{ 2 ** 62 }} {{ (-1) ** 5 }} {{ [1, 2, 3][::9223372036854775807] }} "
      "{{ range(9223372036854775806, 9223372036854775807) | list }}");
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(*fine->Apply(kConversation, {}), "4611686018427387904 -1 [1] [9223372036854775806]");
}

TEST(ChatTemplateTest, LimitsOnNestingWorkAndOutput) {
  std::string deep = "{{ ";
  for (int i = 0; i < 5000; ++i) deep += "(";
  EXPECT_EQ(ChatTemplate::Parse(deep).status().code(), absl::StatusCode::kFailedPrecondition);
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if true %}";
  EXPECT_EQ(ChatTemplate::Parse(blocks).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<ChatTemplate> slow = ChatTemplate::Parse(
      "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}");
  ASSERT_TRUE(slow.ok());
  absl::StatusOr<std::string> r = slow->Apply(kConversation, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
}

}  // namespace
}  // namespace subspace
