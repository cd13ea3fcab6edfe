#include "shardpoint/base/json.h"

#include <gtest/gtest.h>

#include <random>

namespace sp {
namespace {

void ExpectRejected(std::string_view text, std::string_view fragment) {
  Result<JsonValue> r = ParseJson(text, "hdr");
  ASSERT_FALSE(r.ok()) << text;
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << text;
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << text << " -> " << r.status();
}

TEST(JsonTest, ParsesTheSubset) {
  Result<JsonValue> r = ParseJson(" {\"a\": [1, 18446744073709551615, \"x\"], \"b\":{}, \"c\":[]} \n", "h");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->is_object());
  ASSERT_EQ(r->keys, (std::vector<std::string>{"a", "b", "c"}));
  const JsonValue& a = r->values[0];
  ASSERT_TRUE(a.is_array());
  ASSERT_EQ(a.items.size(), 3u);
  EXPECT_EQ(a.items[0].number, 1u);
  EXPECT_EQ(a.items[1].number, UINT64_MAX);
  EXPECT_EQ(a.items[2].string, "x");
  EXPECT_TRUE(r->values[1].is_object());
  EXPECT_TRUE(r->values[2].is_array());
  EXPECT_TRUE(r->values[2].items.empty());
}

TEST(JsonTest, DecodesEscapes) {
  Result<JsonValue> r = ParseJson(R"("\"\\\/\b\f\n\r\t\u0041\u00e9\u20ac\ud83d\ude00")", "h");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->string, "\"\\/\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  Result<JsonValue> raw = ParseJson("\"h\xc3\xa9llo \xf0\x9f\x98\x80\"", "h");
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->string, "h\xc3\xa9llo \xf0\x9f\x98\x80");
}

TEST(JsonTest, RejectsEverythingOutsideTheSubsetNamingTheOffset) {
  ExpectRejected("true", "unsupported JSON token 't' at byte 0");
  ExpectRejected("[null]", "unsupported JSON token 'n' at byte 1");
  ExpectRejected("[-1]", "unsupported JSON token '-' at byte 1");
  ExpectRejected("[1.5]", "only non-negative integers are supported at byte 2");
  ExpectRejected("[1e3]", "only non-negative integers");
  ExpectRejected("[01]", "leading zero at byte 1");
  ExpectRejected("18446744073709551616", "integer larger than 2^64-1 at byte 0");
  ExpectRejected("{\"a\":1,\"b\":2,\"a\":3}", "duplicate key \"a\" at byte 13");
  ExpectRejected("{\"a\":1,}", "expected a string key at byte 7");
  ExpectRejected("[1,]", "unsupported JSON token ']' at byte 3");
  ExpectRejected("[1 2]", "expected ',' or ']' at byte 3");
  ExpectRejected("{\"a\" 1}", "expected ':' at byte 5");
  ExpectRejected("{} x", "unexpected bytes after the JSON value at byte 3");
  ExpectRejected("", "unexpected end of JSON at byte 0");
  ExpectRejected("{\"a\":[1", "unexpected end of JSON at byte 7");
  ExpectRejected("\"abc", "unterminated string at byte 4");
  ExpectRejected("\"a\nb\"", "raw control character in string at byte 2");
  ExpectRejected(R"("\x")", "invalid escape at byte 1");
  ExpectRejected(R"("\u12zz")", "invalid hex digit in \\u escape at byte 5");
  ExpectRejected(R"("\u12)", "truncated \\u escape");
  ExpectRejected(R"("\ude00")", "lone low surrogate at byte 1");
  ExpectRejected(R"("\ud83d")", "high surrogate without a low surrogate at byte 1");
  ExpectRejected(R"("\ud83d\u0041")", "high surrogate without a low surrogate");
  ExpectRejected("\"\xff\"", "invalid UTF-8 lead byte at byte 1");
  ExpectRejected("\"\xc0\xaf\"", "invalid UTF-8 lead byte");          // overlong '/'
  ExpectRejected("\"\xe0\x80\xaf\"", "invalid UTF-8 code point");     // overlong
  ExpectRejected("\"\xed\xa0\x80\"", "invalid UTF-8 code point");     // encoded surrogate
  ExpectRejected("\"\xf4\x90\x80\x80\"", "invalid UTF-8 code point"); // above U+10FFFF
  ExpectRejected("\"\xc3(\"", "invalid UTF-8 continuation byte");
  ExpectRejected("\"\xe2\x82", "truncated UTF-8 sequence");
}

TEST(JsonTest, NestingLimitIs64) {
  std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(ParseJson(ok, "h").ok());
  std::string deep = std::string(65, '[') + std::string(65, ']');
  ExpectRejected(deep, "JSON nesting deeper than 64 at byte 64");
  std::string very_deep(1 << 20, '[');
  ExpectRejected(very_deep, "deeper than 64");
}

TEST(JsonTest, StringsRoundTripThroughTheWriter) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    // Random code points (no surrogates), encoded as UTF-8, control characters included.
    std::string s;
    for (int n = rng() % 20; n > 0; --n) {
      uint32_t cp = rng() % 4 == 0 ? rng() % 0x20 : rng() % 0x110000;
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = '\\';
      if (cp < 0x80) { s.push_back(static_cast<char>(cp)); }
      else if (cp < 0x800) { s.push_back(0xC0 | (cp >> 6)); s.push_back(0x80 | (cp & 0x3F)); }
      else if (cp < 0x10000) {
        s.push_back(0xE0 | (cp >> 12)); s.push_back(0x80 | ((cp >> 6) & 0x3F)); s.push_back(0x80 | (cp & 0x3F));
      } else {
        s.push_back(0xF0 | (cp >> 18)); s.push_back(0x80 | ((cp >> 12) & 0x3F));
        s.push_back(0x80 | ((cp >> 6) & 0x3F)); s.push_back(0x80 | (cp & 0x3F));
      }
    }
    std::string json;
    AppendJsonString(&json, s);
    Result<JsonValue> r = ParseJson(json, "h");
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->string, s);
  }
  std::string json;
  AppendJsonString(&json, std::string("a\"b\\c\n\x01", 7));
  EXPECT_EQ(json, R"("a\"b\\c\n\u0001")");
}

TEST(JsonTest, FullSyntaxKeepsValuesOutsideTheSubsetAsText) {
  Result<JsonValue> r = ParseJson(
      R"({"a": true, "b": [false, null, -3, 0.5, 1e-3, 2E+10, 18446744073709551616, NaN, Infinity, -Infinity], "c": 7})",
      "idx",
      JsonSyntax::kFull);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->values[0].kind, JsonValue::Kind::kOther);
  EXPECT_EQ(r->values[0].string, "true");
  std::vector<std::string> texts;
  for (const JsonValue& v : r->values[1].items) {
    EXPECT_EQ(v.kind, JsonValue::Kind::kOther);
    texts.push_back(v.string);
  }
  EXPECT_EQ(texts, (std::vector<std::string>{"false", "null", "-3", "0.5", "1e-3", "2E+10",
                                              "18446744073709551616", "NaN", "Infinity",
                                              "-Infinity"}));
  EXPECT_TRUE(r->values[2].is_number());
  EXPECT_EQ(r->values[2].number, 7u);
  // The safetensors subset still refuses them; full JSON still refuses malformed tokens.
  ExpectRejected(R"({"a": true})", "unsupported JSON token 't'");
  for (std::string_view bad : {"-", "01", "-01", "1.", "1e", "tru", "nul", "[1.5.2]", "- 1", "Inf",
                               "NaNa", "-Inf"}) {
    Result<JsonValue> bad_r = ParseJson(bad, "idx", JsonSyntax::kFull);
    EXPECT_FALSE(bad_r.ok()) << bad;
    if (!bad_r.ok()) {
      EXPECT_EQ(bad_r.status().code(), StatusCode::kDataLoss) << bad;
    }
  }
}

}  // namespace
}  // namespace sp
