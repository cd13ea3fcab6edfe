#include "shardpoint/base/json.h"

#include <algorithm>
#include <numeric>

namespace sp {
namespace {

class JsonParser {
 public:
  JsonParser(std::string_view text, std::string_view what, JsonSyntax syntax)
      : text_(text), what_(what), full_(syntax == JsonSyntax::kFull) {}

  Result<JsonValue> ParseDocument() {
    JsonValue value;
    SP_RETURN_IF_ERROR(ParseValue(&value, 1));
    SkipWhitespace();
    if (pos_ != text_.size()) return Error("unexpected bytes after the JSON value");
    return value;
  }

 private:
  Status Error(std::string_view problem) const { return ErrorAt(problem, pos_); }
  Status ErrorAt(std::string_view problem, size_t offset) const {
    return DataLossError(std::string(what_) + ": " + std::string(problem) + " at byte " +
                         std::to_string(offset));
  }

  void SkipWhitespace() {
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
      ++pos_;
    }
  }

  Status ParseValue(JsonValue* out, int depth) {
    SkipWhitespace();
    if (pos_ >= text_.size()) return Error("unexpected end of JSON");
    char c = text_[pos_];
    if (c == '{' || c == '[') {
      if (depth > kMaxJsonDepth) return Error("JSON nesting deeper than 64");
      return c == '{' ? ParseObject(out, depth) : ParseArray(out, depth);
    }
    if (c == '"') {
      out->kind = JsonValue::Kind::kString;
      return ParseString(&out->string);
    }
    if (full_ && (c == '-' || c == 't' || c == 'f' || c == 'n' || c == 'N' || c == 'I')) {
      return ParseOther(out);
    }
    if (c >= '0' && c <= '9') {
      out->kind = JsonValue::Kind::kNumber;
      if (full_ && !IsPlainInteger()) return ParseOther(out);
      return ParseNumber(&out->number);
    }
    return Error(std::string("unsupported JSON token '") + Printable(c) + "'");
  }

  static std::string Printable(char c) {
    if (c >= 0x20 && c < 0x7f) return std::string(1, c);
    static const char kHex[] = "0123456789abcdef";
    unsigned char u = static_cast<unsigned char>(c);
    return std::string("\\x") + kHex[u >> 4] + kHex[u & 15];
  }

  Status ParseObject(JsonValue* out, int depth) {
    out->kind = JsonValue::Kind::kObject;
    std::vector<size_t> key_offsets;
    ++pos_;  // '{'
    SkipWhitespace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return OkStatus();
    }
    while (true) {
      SkipWhitespace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a string key");
      key_offsets.push_back(pos_);
      SP_RETURN_IF_ERROR(ParseString(&out->keys.emplace_back()));
      SkipWhitespace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      SP_RETURN_IF_ERROR(ParseValue(&out->values.emplace_back(), depth + 1));
      SP_ASSIGN_OR_RETURN(bool more, ParseSeparator('}'));
      if (!more) break;
    }
    return CheckUniqueKeys(out->keys, key_offsets);
  }

  Status CheckUniqueKeys(const std::vector<std::string>& keys,
                         const std::vector<size_t>& key_offsets) const {
    std::vector<size_t> order(keys.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return keys[a] != keys[b] ? keys[a] < keys[b] : a < b;
    });
    for (size_t i = 1; i < order.size(); ++i) {
      if (keys[order[i]] == keys[order[i - 1]]) {
        return ErrorAt("duplicate key \"" + keys[order[i]] + "\"", key_offsets[order[i]]);
      }
    }
    return OkStatus();
  }

  Status ParseArray(JsonValue* out, int depth) {
    out->kind = JsonValue::Kind::kArray;
    ++pos_;  // '['
    SkipWhitespace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return OkStatus();
    }
    while (true) {
      SP_RETURN_IF_ERROR(ParseValue(&out->items.emplace_back(), depth + 1));
      SP_ASSIGN_OR_RETURN(bool more, ParseSeparator(']'));
      if (!more) return OkStatus();
    }
  }

  // After a member or item: ',' (true: more follow) or `close` (false: done).
  Result<bool> ParseSeparator(char close) {
    SkipWhitespace();
    if (pos_ >= text_.size()) return Error("unexpected end of JSON");
    if (text_[pos_] == ',') {
      ++pos_;
      return true;
    }
    if (text_[pos_] == close) {
      ++pos_;
      return false;
    }
    return Error(std::string("expected ',' or '") + close + "'");
  }

  Status ParseNumber(uint64_t* out) {
    size_t start = pos_;
    if (text_[pos_] == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' &&
        text_[pos_ + 1] <= '9') {
      return Error("number with a leading zero");
    }
    uint64_t value = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      uint64_t digit = static_cast<uint64_t>(text_[pos_] - '0');
      if (value > (UINT64_MAX - digit) / 10) return ErrorAt("integer larger than 2^64-1", start);
      value = value * 10 + digit;
      ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
      return Error("only non-negative integers are supported");
    }
    *out = value;
    return OkStatus();
  }

  Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      unsigned char c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        return OkStatus();
      }
      if (c < 0x20) return Error("raw control character in string");
      if (c == '\\') {
        SP_RETURN_IF_ERROR(ParseEscape(out));
      } else if (c < 0x80) {
        out->push_back(static_cast<char>(c));
        ++pos_;
      } else {
        SP_RETURN_IF_ERROR(CopyUtf8Sequence(out));
      }
    }
  }

  Status ParseEscape(std::string* out) {
    if (pos_ + 1 >= text_.size()) return Error("unterminated escape");
    char e = text_[pos_ + 1];
    const char* simple = nullptr;
    switch (e) {
      case '"': simple = "\""; break;
      case '\\': simple = "\\"; break;
      case '/': simple = "/"; break;
      case 'b': simple = "\b"; break;
      case 'f': simple = "\f"; break;
      case 'n': simple = "\n"; break;
      case 'r': simple = "\r"; break;
      case 't': simple = "\t"; break;
      case 'u': return ParseUnicodeEscape(out);
      default: return Error("invalid escape");
    }
    out->push_back(*simple);
    pos_ += 2;
    return OkStatus();
  }

  Result<uint32_t> ReadHex4(size_t at) const {
    if (at + 4 > text_.size()) return ErrorAt("truncated \\u escape", at);
    uint32_t v = 0;
    for (size_t i = at; i < at + 4; ++i) {
      char h = text_[i];
      uint32_t d;
      if (h >= '0' && h <= '9') d = h - '0';
      else if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
      else return ErrorAt("invalid hex digit in \\u escape", i);
      v = v * 16 + d;
    }
    return v;
  }

  Status ParseUnicodeEscape(std::string* out) {
    size_t start = pos_;
    SP_ASSIGN_OR_RETURN(uint32_t cp, ReadHex4(pos_ + 2));
    pos_ += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return ErrorAt("lone low surrogate", start);
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (pos_ + 1 >= text_.size() || text_[pos_] != '\\' || text_[pos_ + 1] != 'u') {
        return ErrorAt("high surrogate without a low surrogate", start);
      }
      SP_ASSIGN_OR_RETURN(uint32_t low, ReadHex4(pos_ + 2));
      if (low < 0xDC00 || low > 0xDFFF) return ErrorAt("high surrogate without a low surrogate", start);
      pos_ += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    AppendUtf8(out, cp);
    return OkStatus();
  }

  static void AppendUtf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // Validates one multi-byte UTF-8 sequence at pos_ (RFC 3629: no overlongs, no surrogates,
  // nothing above U+10FFFF) and copies it.
  Status CopyUtf8Sequence(std::string* out) {
    unsigned char lead = static_cast<unsigned char>(text_[pos_]);
    size_t length;
    uint32_t cp;
    if (lead >= 0xC2 && lead <= 0xDF) { length = 2; cp = lead & 0x1F; }
    else if (lead >= 0xE0 && lead <= 0xEF) { length = 3; cp = lead & 0x0F; }
    else if (lead >= 0xF0 && lead <= 0xF4) { length = 4; cp = lead & 0x07; }
    else return Error("invalid UTF-8 lead byte");
    if (pos_ + length > text_.size()) return Error("truncated UTF-8 sequence");
    for (size_t i = 1; i < length; ++i) {
      unsigned char c = static_cast<unsigned char>(text_[pos_ + i]);
      if ((c & 0xC0) != 0x80) return Error("invalid UTF-8 continuation byte");
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return Error("invalid UTF-8 code point");
    }
    out->append(text_.substr(pos_, length));
    pos_ += length;
    return OkStatus();
  }

  std::string_view text_;
  // At a digit: true when the number is a non-negative integer that fits in 64 bits.
  bool IsPlainInteger() const {
    size_t end = pos_;
    while (end < text_.size() && text_[end] >= '0' && text_[end] <= '9') ++end;
    if (end < text_.size() && (text_[end] == '.' || text_[end] == 'e' || text_[end] == 'E')) {
      return false;
    }
    const std::string_view digits = text_.substr(pos_, end - pos_);
    return digits.size() < 20 || (digits.size() == 20 && digits <= "18446744073709551615");
  }

  // kFull only: true, false, null, or any JSON number, kept as text; also NaN, Infinity and
  // -Infinity, which Python's json module writes for non-finite floats.
  Status ParseOther(JsonValue* out) {
    out->kind = JsonValue::Kind::kOther;
    for (std::string_view word : {"true", "false", "null", "NaN", "Infinity", "-Infinity"}) {
      if (text_.substr(pos_, word.size()) == word) {
        out->string = std::string(word);
        pos_ += word.size();
        return OkStatus();
      }
    }
    const size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    SP_RETURN_IF_ERROR(SkipDigits(/*leading_zero_ok=*/false));
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      SP_RETURN_IF_ERROR(SkipDigits(true));
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      SP_RETURN_IF_ERROR(SkipDigits(true));
    }
    out->string = std::string(text_.substr(start, pos_ - start));
    return OkStatus();
  }

  Status SkipDigits(bool leading_zero_ok) {
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    if (pos_ == start) return Error("invalid JSON token");
    if (!leading_zero_ok && pos_ - start > 1 && text_[start] == '0') {
      return ErrorAt("number with a leading zero", start);
    }
    return OkStatus();
  }

  std::string_view what_;
  size_t pos_ = 0;
  bool full_ = false;
};

}  // namespace

Result<JsonValue> ParseJson(std::string_view text, std::string_view what, JsonSyntax syntax) {
  return JsonParser(text, what, syntax).ParseDocument();
}

void AppendJsonString(std::string* out, std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  out->push_back('"');
  size_t plain = 0;  // the start of the run of characters that need no escape
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out->append(s.data() + plain, i - plain);
    plain = i + 1;
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        out->append("\\u00");
        out->push_back(kHex[c >> 4]);
        out->push_back(kHex[c & 15]);
    }
  }
  out->append(s.data() + plain, s.size() - plain);
  out->push_back('"');
}

}  // namespace sp
