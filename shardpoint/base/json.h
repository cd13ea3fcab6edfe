// A strict JSON subset, enough for safetensors headers.
//
// The subset: objects, arrays, strings and non-negative integers up to 2^64-1. No true / false /
// null, no negative, fractional or exponent numbers. Strings must be valid UTF-8 without raw
// control characters; escapes include \uXXXX with surrogate pairs. Duplicate object keys, nesting
// deeper than kMaxJsonDepth and anything outside the subset are refused with kDataLoss naming the
// byte offset. docs/FORMAT.md §2.1 specifies it. JsonSyntax::kFull also accepts the rest of JSON
// (true, false, null, negative, fractional and exponent numbers, and the NaN / Infinity /
// -Infinity that Python's json module writes) for documents that are not
// safetensors headers, such as model.safetensors.index.json. All functions are pure and
// thread-safe.
#ifndef SHARDPOINT_BASE_JSON_H_
#define SHARDPOINT_BASE_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"

namespace sp {

inline constexpr int kMaxJsonDepth = 64;

struct JsonValue {
  // kOther (JsonSyntax::kFull only): true, false, null, or a number outside the subset;
  // `string` holds its text.
  enum class Kind : uint8_t { kString, kNumber, kArray, kObject, kOther };

  Kind kind = Kind::kNumber;
  uint64_t number = 0;                 // kNumber
  std::string string;                  // kString
  std::vector<JsonValue> items;        // kArray
  std::vector<std::string> keys;       // kObject: keys in document order, unique
  std::vector<JsonValue> values;       // kObject: values[i] belongs to keys[i]

  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kNumber; }
  bool is_array() const { return kind == Kind::kArray; }
  bool is_object() const { return kind == Kind::kObject; }
};

enum class JsonSyntax : uint8_t {
  kSafetensors,  // the subset above
  kFull,         // all of JSON; values outside the subset parse as Kind::kOther
};

// Parses `text` as one JSON value followed only by whitespace. Errors are kDataLoss:
// "<what>: <problem> at byte <offset>", where offset counts from the start of `text`.
Result<JsonValue> ParseJson(std::string_view text, std::string_view what,
                            JsonSyntax syntax = JsonSyntax::kSafetensors);

// Appends `s` as a quoted JSON string. '"', '\\' and control characters are escaped; other bytes
// are copied unchanged (callers pass UTF-8).
void AppendJsonString(std::string* out, std::string_view s);

}  // namespace sp

#endif  // SHARDPOINT_BASE_JSON_H_
