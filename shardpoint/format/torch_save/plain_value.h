// PlainValue: the plain Python data a checkpoint may hold besides tensors (DCP BYTE_IO items,
// planner_data): None, bool, int (64-bit), float, str, bytes, list, tuple and dict.
//
// It is an owning value type (unlike PickleValue, which lives in an unpickler's arena), so
// callers can build one by hand. Two conversions connect it to pickles: WritePlainValue emits it
// through a PickleWriter exactly as CPython's pickler would (protocol 2), and ToPlainValue turns
// an unpickled value back into a PlainValue, refusing anything that is not plain data. Nesting
// is capped at kMaxPickleWalkDepth in both directions. All functions are pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_PLAIN_VALUE_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_PLAIN_VALUE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/torch_save/pickle.h"
#include "shardpoint/format/torch_save/pickle_writer.h"

namespace sp::torch_save {

struct PlainValue {
  enum class Kind : uint8_t { kNone, kBool, kInt, kFloat, kString, kBytes, kList, kTuple, kDict };

  Kind kind = Kind::kNone;
  bool bool_value = false;
  int64_t int_value = 0;
  double float_value = 0;
  std::string text;               // kString (UTF-8) and kBytes
  std::vector<PlainValue> items;  // kList, kTuple; kDict: key0, value0, key1, value1, ...

  static PlainValue None() { return PlainValue(); }
  static PlainValue Bool(bool v);
  static PlainValue Int(int64_t v);
  static PlainValue Float(double v);
  static PlainValue String(std::string v);
  static PlainValue Bytes(std::string v);
  static PlainValue List(std::vector<PlainValue> items);
  static PlainValue Tuple(std::vector<PlainValue> items);
  static PlainValue Dict(std::vector<std::pair<PlainValue, PlainValue>> pairs);

  bool is(Kind k) const { return kind == k; }
  size_t pair_count() const { return items.size() / 2; }
  const PlainValue& key(size_t i) const { return items[2 * i]; }
  const PlainValue& value(size_t i) const { return items[2 * i + 1]; }

  friend bool operator==(const PlainValue&, const PlainValue&) = default;
};

// Python-like text for messages and tests: None, True, 5, 0.5, 'a', b'\x00', [1, 2], (1,),
// {'k': 1}. Deeper than kMaxPickleWalkDepth prints "...".
std::string PlainValueToString(const PlainValue& v);

// Pushes `v` as CPython's protocol-2 pickler would. kInvalidArgument when nested deeper than
// kMaxPickleWalkDepth or when a str is not valid UTF-8.
Status WritePlainValue(PickleWriter& writer, const PlainValue& v);

// A whole protocol-2 pickle of `v` (PROTO 2 ... STOP).
Result<std::string> EncodePlainPickle(const PlainValue& v);

// Decodes a pickle of plain data (ObjectEncoding::kPlain) with the restricted unpickler and the
// PlainDataGlobals() allowlist, then ToPlainValue. Never runs code; kDataLoss naming `what` for
// anything that is not plain data (the message names a refused global).
Result<PlainValue> DecodePlainPickle(std::string_view pickle, std::string_view what);

// Converts unpickled plain data. Accepted besides the plain kinds: collections.OrderedDict
// (as a dict), _codecs.encode(str, 'latin1') and bytes() (as bytes). Anything else (sets,
// objects, persistent ids) is kDataLoss naming `what` and the value. A value shared by several
// references (memo gets) is converted once per use, so a few bytes can name a subtree many times
// over (40 levels of [x, x] are 2^40 values): more than `max_values` values is kDataLoss too. A
// str or bytes value counts one value more per 64 bytes of its text (a 1 MB text shared 10,000
// times would be 10 GB), so the memory of the result stays within about 64 bytes per value.
Result<PlainValue> ToPlainValue(const PickleValue& v, std::string_view what, uint64_t max_values);

// The values ToPlainValue may produce from a pickle of `pickle_bytes` bytes: 2^16 plus 16 per
// byte. A pickle without shared values makes fewer values than it has bytes; ordinary sharing
// (repeated keys, dtypes) stays well within it; a memo bomb does not.
uint64_t PlainValueBudget(uint64_t pickle_bytes);

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_PLAIN_VALUE_H_
