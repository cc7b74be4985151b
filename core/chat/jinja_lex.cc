// The lexer: template text, {{ }} and {% %} tags and {# #} comments as segments, with
// Jinja2's white-space rules under trim_blocks and lstrip_blocks, and each tag's tokens.
#include <algorithm>
#include <charconv>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/chat/jinja_internal.h"

namespace subspace::jinja {
namespace {

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  absl::StatusOr<std::vector<Segment>> Run() {
    std::vector<Segment> out;
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t open = std::string::npos;
      for (const char* o : {"{{", "{%", "{#"}) open = std::min(open, src_.find(o, pos_));
      if (open == std::string::npos) {
        Emit(&out, src_.substr(pos_));
        pos_ = src_.size();
        break;
      }
      const char kind = src_[open + 1];
      std::string text = src_.substr(pos_, open - pos_);
      const int tag_line = line_ + static_cast<int>(std::count(text.begin(), text.end(), '\n'));
      size_t p = open + 2;
      const char sign = p < src_.size() && (src_[p] == '-' || src_[p] == '+') ? src_[p] : 0;
      if (sign != 0) ++p;
      if (sign == '-') {
        size_t keep = text.size();
        while (keep > 0 && IsSpace(text[keep - 1])) --keep;
        text.resize(keep);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: spaces alone between the line start and a block or comment tag go.
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
            std::all_of(text.begin() + static_cast<ptrdiff_t>(l_pos), text.end(), IsSpace)) {
          text.resize(l_pos);
        }
      }
      Emit(&out, text);
      line_ = tag_line;
      pos_ = p;
      if (kind == '#') {
        JINJA_RETURN_IF_ERROR(SkipComment(&line_starting));
        continue;
      }
      Segment seg{kind == '{' ? SegKind::kVar : SegKind::kStmt, "", {}, tag_line};
      JINJA_RETURN_IF_ERROR(LexTag(kind == '{', &seg.tokens, &line_starting));
      if (seg.kind == SegKind::kStmt && !seg.tokens.empty() && seg.tokens[0].text == "raw") {
        return Unsupported(tag_line, "{% raw %}");
      }
      out.push_back(std::move(seg));
    }
    return out;
  }

 private:
  void Emit(std::vector<Segment>* out, std::string text) {
    line_ += static_cast<int>(std::count(text.begin(), text.end(), '\n'));
    if (!text.empty()) out->push_back({SegKind::kText, std::move(text), {}, line_});
  }

  // After the closing %} or #}: "-" strips all following white space, trim_blocks one newline.
  void AfterBlockEnd(char sign, bool* line_starting) {
    size_t start = pos_;
    if (sign == '-') {
      while (pos_ < src_.size() && IsSpace(src_[pos_])) ++pos_;
    } else if (sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<ptrdiff_t>(start),
                                         src_.begin() + static_cast<ptrdiff_t>(pos_), '\n'));
    *line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
  }

  absl::Status SkipComment(bool* line_starting) {
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) return SyntaxError(line_, "unclosed comment");
    const char sign =
        end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<ptrdiff_t>(pos_),
                                         src_.begin() + static_cast<ptrdiff_t>(end), '\n'));
    pos_ = end + 2;
    AfterBlockEnd(sign, line_starting);
    return absl::OkStatus();
  }

  absl::Status LexTag(bool variable, std::vector<Token>* tokens, bool* line_starting) {
    while (true) {
      while (pos_ < src_.size() && IsSpace(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= src_.size()) return SyntaxError(line_, "unclosed tag");
      const std::string_view rest = std::string_view(src_).substr(pos_);
      const std::string_view close = variable ? "}}" : "%}";
      for (const char sign : {'-', '+', '\0'}) {
        if (sign == '+' && variable) continue;
        const std::string marker =
            sign ? std::string(1, sign) + std::string(close) : std::string(close);
        if (rest.substr(0, marker.size()) == marker) {
          pos_ += marker.size();
          if (variable) {
            if (sign == '-') {
              while (pos_ < src_.size() && IsSpace(src_[pos_])) {
                if (src_[pos_] == '\n') ++line_;
                ++pos_;
              }
            }
            *line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
          } else {
            AfterBlockEnd(sign, line_starting);
          }
          return absl::OkStatus();
        }
      }
      Token tok{Tok::kOp, "", line_};
      const char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
          ++e;
        }
        tok = {Tok::kName, src_.substr(pos_, e - pos_), line_};
        pos_ = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        bool is_float = false;
        while (e < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
          ++e;
        }
        if (e + 1 < src_.size() && src_[e] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        // An exponent: 1e20, 2.5e-3.
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t x = e + 1;
          if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
          if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
            is_float = true;
            e = x;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string text = src_.substr(pos_, e - pos_);
        text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
        tok = {is_float ? Tok::kFloat : Tok::kInt, text, line_};
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        std::string s;
        size_t e = pos_ + 1;
        while (e < src_.size() && src_[e] != c) {
          if (src_[e] == '\\' && e + 1 < src_.size()) {
            const char n = src_[++e];
            switch (n) {
              case 'n':
                s.push_back('\n');
                break;
              case 't':
                s.push_back('\t');
                break;
              case 'r':
                s.push_back('\r');
                break;
              case '\\':
              case '\'':
              case '"':
                s.push_back(n);
                break;
              case '\n':
                break;
              default:
                // Python keeps unknown escapes as written; \x, \u and \N forms are refused.
                if (n == 'x' || n == 'u' || n == 'U' || n == 'N' || n == 'b' || n == 'f' ||
                    n == 'v' || n == 'a' || (n >= '0' && n <= '7')) {
                  return Unsupported(line_,
                                     absl::StrCat("the string escape \\", std::string(1, n)));
                }
                s.push_back('\\');
                s.push_back(n);
            }
            ++e;
            continue;
          }
          if (src_[e] == '\n') ++line_;
          s.push_back(src_[e++]);
        }
        if (e >= src_.size()) return SyntaxError(line_, "unclosed string");
        tok = {Tok::kString, std::move(s), line_};
        pos_ = e + 1;
      } else {
        static constexpr std::string_view kOps[] = {
            "//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
            ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        bool found = false;
        for (std::string_view op : kOps) {
          if (rest.substr(0, op.size()) == op) {
            tok = {Tok::kOp, std::string(op), line_};
            pos_ += op.size();
            found = true;
            break;
          }
        }
        if (!found)
          return SyntaxError(line_, absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      tokens->push_back(std::move(tok));
    }
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
};

}  // namespace

absl::StatusOr<std::vector<Segment>> Lex(std::string source) {
  return Lexer(std::move(source)).Run();
}

}  // namespace subspace::jinja
