#include "shardpoint/format/torch_save/plain_value.h"

#include <cstdio>

#include "shardpoint/format/torch_save/pickle_util.h"

namespace sp::torch_save {

using PKind = PickleValue::Kind;

PlainValue PlainValue::Bool(bool v) {
  PlainValue p;
  p.kind = Kind::kBool;
  p.bool_value = v;
  return p;
}
PlainValue PlainValue::Int(int64_t v) {
  PlainValue p;
  p.kind = Kind::kInt;
  p.int_value = v;
  return p;
}
PlainValue PlainValue::Float(double v) {
  PlainValue p;
  p.kind = Kind::kFloat;
  p.float_value = v;
  return p;
}
PlainValue PlainValue::String(std::string v) {
  PlainValue p;
  p.kind = Kind::kString;
  p.text = std::move(v);
  return p;
}
PlainValue PlainValue::Bytes(std::string v) {
  PlainValue p;
  p.kind = Kind::kBytes;
  p.text = std::move(v);
  return p;
}
PlainValue PlainValue::List(std::vector<PlainValue> items) {
  PlainValue p;
  p.kind = Kind::kList;
  p.items = std::move(items);
  return p;
}
PlainValue PlainValue::Tuple(std::vector<PlainValue> items) {
  PlainValue p = List(std::move(items));
  p.kind = Kind::kTuple;
  return p;
}
PlainValue PlainValue::Dict(std::vector<std::pair<PlainValue, PlainValue>> pairs) {
  PlainValue p;
  p.kind = Kind::kDict;
  for (auto& [k, v] : pairs) {
    p.items.push_back(std::move(k));
    p.items.push_back(std::move(v));
  }
  return p;
}

namespace {

void AppendString(std::string* out, const PlainValue& v, int depth) {
  using K = PlainValue::Kind;
  if (depth > kMaxPickleWalkDepth) {
    out->append("...");
    return;
  }
  switch (v.kind) {
    case K::kNone: out->append("None"); return;
    case K::kBool: out->append(v.bool_value ? "True" : "False"); return;
    case K::kInt: out->append(std::to_string(v.int_value)); return;
    case K::kFloat: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.17g", v.float_value);
      out->append(buf);
      return;
    }
    case K::kString: out->append("'" + v.text + "'"); return;
    case K::kBytes: {
      out->append("b'");
      for (char c : v.text) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<uint8_t>(c));
        out->append(buf);
      }
      out->push_back('\'');
      return;
    }
    case K::kList:
    case K::kTuple:
      out->push_back(v.is(K::kList) ? '[' : '(');
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i > 0) out->append(", ");
        AppendString(out, v.items[i], depth + 1);
      }
      if (v.is(K::kTuple) && v.items.size() == 1) out->push_back(',');
      out->push_back(v.is(K::kList) ? ']' : ')');
      return;
    case K::kDict:
      out->push_back('{');
      for (size_t i = 0; i < v.pair_count(); ++i) {
        if (i > 0) out->append(", ");
        AppendString(out, v.key(i), depth + 1);
        out->append(": ");
        AppendString(out, v.value(i), depth + 1);
      }
      out->push_back('}');
      return;
  }
}

Status WriteAt(PickleWriter& w, const PlainValue& v, int depth) {
  using K = PlainValue::Kind;
  if (depth > kMaxPickleWalkDepth) {
    return InvalidArgumentError("plain value nested deeper than " +
                                std::to_string(kMaxPickleWalkDepth));
  }
  Status status;
  auto item = [&](size_t i) {
    if (status.ok()) status = WriteAt(w, v.items[i], depth + 1);
  };
  auto pair = [&](size_t i) {
    item(2 * i);
    item(2 * i + 1);
  };
  switch (v.kind) {
    case K::kNone: w.None(); break;
    case K::kBool: w.Bool(v.bool_value); break;
    case K::kInt: w.Int(v.int_value); break;
    case K::kFloat: w.Float(v.float_value); break;
    case K::kString:
      if (!IsPythonUtf8(v.text)) return InvalidArgumentError("str value is not valid UTF-8");
      w.String(v.text);
      break;
    case K::kBytes: w.Bytes(v.text); break;
    case K::kList:
      w.EmptyList();
      if (!v.items.empty()) w.ListItems(v.items.size(), item);
      break;
    case K::kTuple:
      if (PickleWriter::TupleNeedsMark(v.items.size())) w.Mark();
      for (size_t i = 0; i < v.items.size(); ++i) item(i);
      w.Tuple(v.items.size());
      break;
    case K::kDict:
      w.EmptyDict();
      w.DictItems(v.pair_count(), pair);
      break;
  }
  return status;
}

// A str or bytes value counts one value more per this many bytes of its text, so that a long
// text shared by many references cannot expand to more memory than the budget's values would.
constexpr uint64_t kTextBytesPerValue = 64;

// One conversion: what it names in errors, and how many values it may still produce.
struct Walk {
  std::string_view what;
  uint64_t limit;
  uint64_t left;

  Status Overrun() const {
    return DataLossError(std::string(what) + ": more than " + std::to_string(limit) +
                         " values once its shared references are expanded (each use of a shared "
                         "value counts its values again, and a str or bytes value one more per " +
                         std::to_string(kTextBytesPerValue) + " bytes)");
  }
  // Charges one value, and the text of a str or bytes value.
  Status Take(uint64_t text_bytes = 0) {
    const uint64_t n = 1 + text_bytes / kTextBytesPerValue;
    if (n > left) return Overrun();
    left -= n;
    return OkStatus();
  }
};

Result<PlainValue> Convert(const PickleValue& v, Walk& walk, int depth);

Result<PlainValue> ConvertItems(const PickleValue& v, PlainValue out, Walk& walk, int depth) {
  for (const PickleValue* item : v.items) {
    SP_ASSIGN_OR_RETURN(PlainValue converted, Convert(*item, walk, depth + 1));
    out.items.push_back(std::move(converted));
  }
  return out;
}

// _codecs.encode(text, 'latin1') -> the bytes whose values are text's code points (all < 256).
Result<PlainValue> DecodeLatin1(const PickleValue& v, std::string_view what) {
  const PickleValue* args = v.args;
  if (args->items.size() != 2 || !args->items[0]->is(PKind::kString) ||
      !args->items[1]->is(PKind::kString) || args->items[1]->text != "latin1") {
    return DataLossError(std::string(what) + ": _codecs.encode needs (str, 'latin1')");
  }
  const std::string& s = args->items[0]->text;
  std::string bytes;
  for (size_t i = 0; i < s.size(); ++i) {
    auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      bytes.push_back(static_cast<char>(c));
    } else if ((c == 0xc2 || c == 0xc3) && i + 1 < s.size()) {
      bytes.push_back(static_cast<char>(((c & 0x03) << 6) | (static_cast<uint8_t>(s[++i]) & 0x3f)));
    } else {
      return DataLossError(std::string(what) + ": _codecs.encode text is not latin-1");
    }
  }
  return PlainValue::Bytes(std::move(bytes));
}

Result<PlainValue> ConvertObject(const PickleValue& v, Walk& walk, int depth) {
  const std::string_view what = walk.what;
  if (IsObjectOf(v, "collections", "OrderedDict") && v.args->items.empty()) {
    return ConvertItems(v, PlainValue::Dict({}), walk, depth);
  }
  if (IsObjectOf(v, "_codecs", "encode") && v.state == nullptr) {
    Result<PlainValue> bytes = DecodeLatin1(v, what);
    if (bytes.ok()) SP_RETURN_IF_ERROR(walk.Take(bytes->text.size()));
    return bytes;
  }
  if (IsObjectOf(v, "builtins", "bytes") && v.args->items.empty() && v.state == nullptr) {
    return PlainValue::Bytes("");
  }
  return DataLossError(std::string(what) + ": " + DescribePickleValue(v) + " is not plain data");
}

Result<PlainValue> Convert(const PickleValue& v, Walk& walk, int depth) {
  const std::string_view what = walk.what;
  if (depth > kMaxPickleWalkDepth) {
    return DataLossError(std::string(what) + ": value nested deeper than " +
                         std::to_string(kMaxPickleWalkDepth) + " (or a cycle)");
  }
  const bool text = v.kind == PKind::kString || v.kind == PKind::kBytes;
  SP_RETURN_IF_ERROR(walk.Take(text ? v.text.size() : 0));
  switch (v.kind) {
    case PKind::kNone: return PlainValue::None();
    case PKind::kBool: return PlainValue::Bool(v.bool_value);
    case PKind::kInt: return PlainValue::Int(v.int_value);
    case PKind::kFloat: return PlainValue::Float(v.float_value);
    case PKind::kString: return PlainValue::String(v.text);
    case PKind::kBytes: return PlainValue::Bytes(v.text);
    case PKind::kList: return ConvertItems(v, PlainValue::List({}), walk, depth);
    case PKind::kTuple: return ConvertItems(v, PlainValue::Tuple({}), walk, depth);
    case PKind::kDict: return ConvertItems(v, PlainValue::Dict({}), walk, depth);
    case PKind::kObject: return ConvertObject(v, walk, depth);
    default:
      return DataLossError(std::string(what) + ": " + DescribePickleValue(v) +
                           " is not plain data");
  }
}

}  // namespace

std::string PlainValueToString(const PlainValue& v) {
  std::string out;
  AppendString(&out, v, 0);
  return out;
}

Status WritePlainValue(PickleWriter& writer, const PlainValue& v) { return WriteAt(writer, v, 0); }

Result<std::string> EncodePlainPickle(const PlainValue& v) {
  PickleWriter writer;
  SP_RETURN_IF_ERROR(WritePlainValue(writer, v));
  return writer.Finish();
}

uint64_t PlainValueBudget(uint64_t pickle_bytes) {
  constexpr uint64_t kBase = uint64_t{1} << 16;
  constexpr uint64_t kPerByte = 16;
  return pickle_bytes > (UINT64_MAX - kBase) / kPerByte ? UINT64_MAX : kBase + kPerByte * pickle_bytes;
}

Result<PlainValue> ToPlainValue(const PickleValue& v, std::string_view what, uint64_t max_values) {
  Walk walk{what, max_values, max_values};
  return Convert(v, walk, 0);
}

Result<PlainValue> DecodePlainPickle(std::string_view pickle, std::string_view what) {
  UnpickleOptions options;
  options.what = what;
  options.allowed_globals = PlainDataGlobals();
  options.allowlist_name = "plain data";
  SP_ASSIGN_OR_RETURN(PickleTree tree, Unpickle(AsBytes(pickle), options));
  return ToPlainValue(tree.root(), what, PlainValueBudget(pickle.size()));
}

}  // namespace sp::torch_save
