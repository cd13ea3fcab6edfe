#include "shardpoint/format/torch_save/pickle_writer.h"

#include <bit>

#include "shardpoint/format/torch_save/pickle_opcodes.h"

namespace sp::torch_save {

namespace {
constexpr size_t kBatchSize = 1000;  // CPython's BATCHSIZE
}  // namespace

PickleWriter::PickleWriter(bool dedupe_strings) : dedupe_strings_(dedupe_strings) {
  Op(op::kProto);
  Op(2);
}

void PickleWriter::U32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
}

void PickleWriter::MemoGet(uint32_t index) {
  if (index < 256) {
    Op(op::kBinGet);
    Op(static_cast<uint8_t>(index));
  } else {
    Op(op::kLongBinGet);
    U32(index);
  }
}

void PickleWriter::Memoize() {
  if (next_memo_ < 256) {
    Op(op::kBinPut);
    Op(static_cast<uint8_t>(next_memo_));
  } else {
    Op(op::kLongBinPut);
    U32(next_memo_);
  }
  ++next_memo_;
}

void PickleWriter::None() { Op(op::kNone); }
void PickleWriter::Bool(bool v) { Op(v ? op::kNewTrue : op::kNewFalse); }

void PickleWriter::Int(int64_t v) {
  if (v >= 0 && v < 256) {
    Op(op::kBinInt1);
    Op(static_cast<uint8_t>(v));
  } else if (v >= 0 && v < 65536) {
    Op(op::kBinInt2);
    Op(static_cast<uint8_t>(v));
    Op(static_cast<uint8_t>(v >> 8));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    Op(op::kBinInt);
    U32(static_cast<uint32_t>(static_cast<int32_t>(v)));
  } else {
    // Python's encode_long: the fewest little-endian two's-complement bytes.
    uint64_t u = static_cast<uint64_t>(v);
    size_t n = 8;
    while (n > 1) {
      uint8_t top = static_cast<uint8_t>(u >> (8 * (n - 1)));
      uint8_t next_sign = static_cast<uint8_t>(u >> (8 * (n - 2))) & 0x80;
      if ((top == 0x00 && next_sign == 0) || (top == 0xff && next_sign != 0)) {
        --n;
      } else {
        break;
      }
    }
    Op(op::kLong1);
    Op(static_cast<uint8_t>(n));
    for (size_t i = 0; i < n; ++i) Op(static_cast<uint8_t>(u >> (8 * i)));
  }
}

void PickleWriter::Float(double v) {
  Op(op::kBinFloat);
  uint64_t bits = std::bit_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i) Op(static_cast<uint8_t>(bits >> (8 * i)));  // big-endian
}

void PickleWriter::String(std::string_view utf8) {
  if (dedupe_strings_) {
    auto it = strings_.find(utf8);
    if (it != strings_.end()) {
      MemoGet(it->second);
      return;
    }
    strings_.emplace(std::string(utf8), next_memo_);
  }
  Op(op::kBinUnicode);
  U32(static_cast<uint32_t>(utf8.size()));
  out_.append(utf8);
  Memoize();
}

void PickleWriter::Bytes(std::string_view data) {
  if (data.empty()) {
    Global("builtins", "bytes");
    Tuple(0);
    Reduce();
    return;
  }
  Global("_codecs", "encode");
  std::string latin1;  // each byte as the code point of the same value, in UTF-8
  for (char c : data) {
    auto b = static_cast<uint8_t>(c);
    if (b < 0x80) {
      latin1.push_back(c);
    } else {
      latin1.push_back(static_cast<char>(0xc0 | (b >> 6)));
      latin1.push_back(static_cast<char>(0x80 | (b & 0x3f)));
    }
  }
  String(latin1);
  String("latin1");
  Tuple(2);
  Reduce();
}

void PickleWriter::Global(std::string_view module, std::string_view name) {
  std::string m(module);
  if (m == "builtins") m = "__builtin__";
  if (m == "copyreg") m = "copy_reg";
  auto key = std::make_pair(m, std::string(name));
  auto it = globals_.find(key);
  if (it != globals_.end()) {
    MemoGet(it->second);
    return;
  }
  Op(op::kGlobal);
  out_.append(m).push_back('\n');
  out_.append(name).push_back('\n');
  globals_.emplace(std::move(key), next_memo_);
  Memoize();
}

void PickleWriter::Mark() { Op(op::kMark); }

void PickleWriter::Tuple(size_t n) {
  if (n == 0) {
    Op(op::kEmptyTuple);
    return;
  }
  Op(n == 1 ? op::kTuple1 : n == 2 ? op::kTuple2 : n == 3 ? op::kTuple3 : op::kTuple);
  Memoize();
}

void PickleWriter::EmptyList() {
  Op(op::kEmptyList);
  Memoize();
}

void PickleWriter::EmptyDict() {
  Op(op::kEmptyDict);
  Memoize();
}

void PickleWriter::ListItems(size_t n, const std::function<void(size_t)>& write_item) {
  if (n == 1) {
    write_item(0);
    Op(op::kAppend);
    return;
  }
  for (size_t done = 0; done < n;) {
    Op(op::kMark);
    for (size_t in_batch = 0; done < n && in_batch < kBatchSize; ++in_batch) write_item(done++);
    Op(op::kAppends);
  }
}

void PickleWriter::DictItems(size_t n, const std::function<void(size_t)>& write_pair) {
  if (n == 0) return;
  if (n == 1) {
    write_pair(0);
    Op(op::kSetItem);
    return;
  }
  // CPython's batch_dict_exact: a do-while that also writes an empty batch after a full one.
  size_t done = 0;
  size_t in_batch = 0;
  do {
    Op(op::kMark);
    for (in_batch = 0; done < n && in_batch < kBatchSize; ++in_batch) write_pair(done++);
    Op(op::kSetItems);
  } while (in_batch == kBatchSize);
}

void PickleWriter::Reduce() {
  Op(op::kReduce);
  Memoize();
}

void PickleWriter::NewObj() {
  Op(op::kNewObj);
  Memoize();
}

void PickleWriter::Build() { Op(op::kBuild); }
void PickleWriter::BinPersId() { Op(op::kBinPersId); }
void PickleWriter::SetItem() { Op(op::kSetItem); }
void PickleWriter::SetItems() { Op(op::kSetItems); }

std::string PickleWriter::Finish() {
  Op(op::kStop);
  return std::move(out_);
}

}  // namespace sp::torch_save
