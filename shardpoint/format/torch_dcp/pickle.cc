#include "shardpoint/format/torch_dcp/pickle.h"

#include <bit>
#include <cstring>
#include <unordered_map>

#include "shardpoint/format/torch_dcp/pickle_opcodes.h"
#include "shardpoint/format/torch_dcp/pickle_util.h"

namespace sp::torch_dcp {

using Kind = PickleValue::Kind;

class Unpickler {
 public:
  Unpickler(ByteView in, const UnpickleOptions& options)
      : in_(in), options_(options), nodes_(std::make_unique<std::deque<PickleValue>>()) {}

  Result<PickleTree> Run();

 private:
  Status Step(uint8_t op);
  Status StepScalar(uint8_t op, bool* handled);
  Status StepText(uint8_t op, bool* handled);
  Status StepContainer(uint8_t op, bool* handled);
  Status StepStack(uint8_t op, bool* handled);
  Status StepObject(uint8_t op, bool* handled);

  Status Fail(const std::string& problem) const;
  Result<uint64_t> ReadUnsigned(size_t n);
  Result<std::string_view> ReadBytes(uint64_t n);
  Result<std::string_view> ReadLine();
  Result<PickleValue*> New(Kind kind);
  Status Push(PickleValue* v);
  Result<PickleValue*> Pop();
  Result<PickleValue*> Top();
  Result<std::vector<PickleValue*>> PopMark();
  Status PushInt(int64_t v);
  Status PushText(Kind kind, uint64_t length);
  Status PushLong(uint64_t length);
  Status PushGlobal(std::string module, std::string name);
  Status PushTuple(std::vector<PickleValue*> items);
  Status MakeObject(PickleValue::Construction how, bool with_kwargs);
  Status Build();
  Status AddPairs(const std::vector<PickleValue*>& flat);
  Status Memoize(uint64_t index);
  Status MemoGet(uint64_t index);

  ByteView in_;
  const UnpickleOptions& options_;
  size_t pos_ = 0;
  size_t op_offset_ = 0;
  uint8_t op_ = 0;
  std::unique_ptr<std::deque<PickleValue>> nodes_;
  std::vector<PickleValue*> stack_;
  std::vector<size_t> marks_;  // stack sizes at each open MARK
  std::unordered_map<uint64_t, PickleValue*> memo_;
};

Status Unpickler::Fail(const std::string& problem) const {
  char hex[8];
  std::snprintf(hex, sizeof(hex), "0x%02x", op_);
  return DataLossError("pickle " + std::string(options_.what) + ": " + problem + " at byte " +
                       std::to_string(op_offset_) + " (opcode " + hex + " " +
                       std::string(PickleOpcodeName(op_)) + ")");
}

Result<uint64_t> Unpickler::ReadUnsigned(size_t n) {
  if (in_.size() - pos_ < n) {
    return Fail("truncated: " + std::to_string(n) + " argument bytes needed, " +
                std::to_string(in_.size() - pos_) + " left");
  }
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
  pos_ += n;
  return v;
}

Result<std::string_view> Unpickler::ReadBytes(uint64_t n) {
  if (in_.size() - pos_ < n) {
    return Fail("truncated: length " + std::to_string(n) + " but only " +
                std::to_string(in_.size() - pos_) + " bytes left");
  }
  std::string_view s(reinterpret_cast<const char*>(in_.data()) + pos_, n);
  pos_ += n;
  return s;
}

Result<std::string_view> Unpickler::ReadLine() {
  std::string_view rest(reinterpret_cast<const char*>(in_.data()) + pos_, in_.size() - pos_);
  size_t end = rest.find('\n');
  if (end == std::string_view::npos) return Fail("truncated: GLOBAL name without a newline");
  if (end > 1024) return Fail("GLOBAL name longer than 1024 bytes");
  pos_ += end + 1;
  return rest.substr(0, end);
}

Result<PickleValue*> Unpickler::New(Kind kind) {
  if (nodes_->size() >= options_.max_nodes) {
    return Fail("more than " + std::to_string(options_.max_nodes) + " values");
  }
  PickleValue& v = nodes_->emplace_back();
  v.kind = kind;
  return &v;
}

Status Unpickler::Push(PickleValue* v) {
  if (stack_.size() >= options_.max_stack) {
    return Fail("stack deeper than " + std::to_string(options_.max_stack) + " values");
  }
  stack_.push_back(v);
  return OkStatus();
}

Result<PickleValue*> Unpickler::Pop() {
  size_t floor = marks_.empty() ? 0 : marks_.back();
  if (stack_.size() <= floor) return Fail("stack underflow");
  PickleValue* v = stack_.back();
  stack_.pop_back();
  return v;
}

Result<PickleValue*> Unpickler::Top() {
  size_t floor = marks_.empty() ? 0 : marks_.back();
  if (stack_.size() <= floor) return Fail("stack underflow");
  return stack_.back();
}

Result<std::vector<PickleValue*>> Unpickler::PopMark() {
  if (marks_.empty()) return Fail("no MARK to pop to");
  size_t start = marks_.back();
  marks_.pop_back();
  std::vector<PickleValue*> items(stack_.begin() + start, stack_.end());
  stack_.resize(start);
  return items;
}

Status Unpickler::PushInt(int64_t v) {
  SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kInt));
  node->int_value = v;
  return Push(node);
}

Status Unpickler::PushText(Kind kind, uint64_t length) {
  SP_ASSIGN_OR_RETURN(std::string_view bytes, ReadBytes(length));
  if (kind == Kind::kString && !IsPythonUtf8(bytes)) return Fail("str is not valid UTF-8");
  SP_ASSIGN_OR_RETURN(PickleValue * node, New(kind));
  node->text.assign(bytes);
  return Push(node);
}

// LONG1 / LONG4: little-endian two's complement; only values that fit in int64 are accepted.
Status Unpickler::PushLong(uint64_t length) {
  SP_ASSIGN_OR_RETURN(std::string_view bytes, ReadBytes(length));
  if (bytes.empty()) return PushInt(0);
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  bool negative = (b[length - 1] & 0x80) != 0;
  for (size_t i = 8; i < length; ++i) {
    if (b[i] != (negative ? 0xff : 0x00)) return Fail("integer wider than 64 bits");
  }
  if (length > 8 && ((b[7] & 0x80) != 0) != negative) return Fail("integer wider than 64 bits");
  uint64_t v = negative ? ~uint64_t{0} : 0;
  for (size_t i = 0; i < length && i < 8; ++i) {
    v &= ~(uint64_t{0xff} << (8 * i));
    v |= static_cast<uint64_t>(b[i]) << (8 * i);
  }
  return PushInt(static_cast<int64_t>(v));
}

Status Unpickler::PushGlobal(std::string module, std::string name) {
  MapPython2Module(&module);
  bool allowed = options_.allow_any_global;
  for (const PickleGlobalName& g : options_.allowed_globals) {
    allowed = allowed || (g.module == module && g.name == name);
  }
  if (!allowed) {
    return Fail("global '" + module + "." + name + "' is not in the " +
                std::string(options_.allowlist_name) + " allowlist; refusing to load it");
  }
  SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kGlobal));
  node->text = std::move(module);
  node->name = std::move(name);
  return Push(node);
}

Status Unpickler::PushTuple(std::vector<PickleValue*> items) {
  SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kTuple));
  node->items.assign(items.begin(), items.end());
  return Push(node);
}

Status Unpickler::MakeObject(PickleValue::Construction how, bool with_kwargs) {
  PickleValue* kwargs = nullptr;
  if (with_kwargs) {
    SP_ASSIGN_OR_RETURN(kwargs, Pop());
    if (!kwargs->is(Kind::kDict)) return Fail("kwargs must be a dict, got " + DescribePickleValue(*kwargs));
  }
  SP_ASSIGN_OR_RETURN(PickleValue * args, Pop());
  SP_ASSIGN_OR_RETURN(PickleValue * callable, Pop());
  if (!args->is(Kind::kTuple)) return Fail("arguments must be a tuple, got " + DescribePickleValue(*args));
  if (!callable->is(Kind::kGlobal)) {
    return Fail("can only call a global, got " + DescribePickleValue(*callable));
  }
  SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kObject));
  node->construction = how;
  node->callable = callable;
  node->args = args;
  node->kwargs = kwargs;
  return Push(node);
}

Status Unpickler::Build() {
  SP_ASSIGN_OR_RETURN(PickleValue * state, Pop());
  SP_ASSIGN_OR_RETURN(PickleValue * target, Top());
  if (!target->is(Kind::kObject)) return Fail("BUILD on " + DescribePickleValue(*target));
  if (target->state != nullptr) return Fail("BUILD applied twice to one object");
  target->state = state;
  return OkStatus();
}

Status Unpickler::AddPairs(const std::vector<PickleValue*>& flat) {
  if (flat.size() % 2 != 0) return Fail("odd number of items for a dict");
  SP_ASSIGN_OR_RETURN(PickleValue * target, Top());
  if (!target->is(Kind::kDict) && !target->is(Kind::kObject)) {
    return Fail("setting items on " + DescribePickleValue(*target));
  }
  target->items.insert(target->items.end(), flat.begin(), flat.end());
  return OkStatus();
}

Status Unpickler::Memoize(uint64_t index) {
  SP_ASSIGN_OR_RETURN(PickleValue * top, Top());
  if (memo_.size() >= options_.max_memo && !memo_.contains(index)) {
    return Fail("more than " + std::to_string(options_.max_memo) + " memo entries");
  }
  memo_[index] = top;
  return OkStatus();
}

Status Unpickler::MemoGet(uint64_t index) {
  auto it = memo_.find(index);
  if (it == memo_.end()) return Fail("memo entry " + std::to_string(index) + " was never stored");
  return Push(it->second);
}

Status Unpickler::StepScalar(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case op::kNone: {
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kNone));
      return Push(node);
    }
    case op::kNewTrue:
    case op::kNewFalse: {
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kBool));
      node->bool_value = op == op::kNewTrue;
      return Push(node);
    }
    case op::kBinInt1: { SP_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(1)); return PushInt(static_cast<int64_t>(v)); }
    case op::kBinInt2: { SP_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(2)); return PushInt(static_cast<int64_t>(v)); }
    case op::kBinInt: {
      SP_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(4));
      return PushInt(static_cast<int32_t>(static_cast<uint32_t>(v)));
    }
    case op::kLong1: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(1)); return PushLong(n); }
    case op::kLong4: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(4)); return PushLong(n); }
    case op::kBinFloat: {
      SP_ASSIGN_OR_RETURN(std::string_view raw, ReadBytes(8));
      uint64_t bits = 0;
      for (char c : raw) bits = (bits << 8) | static_cast<uint8_t>(c);  // big-endian
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kFloat));
      node->float_value = std::bit_cast<double>(bits);
      return Push(node);
    }
    default: *handled = false; return OkStatus();
  }
}

Status Unpickler::StepText(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case op::kShortBinUnicode: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(1)); return PushText(Kind::kString, n); }
    case op::kBinUnicode: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(4)); return PushText(Kind::kString, n); }
    case op::kBinUnicode8: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(8)); return PushText(Kind::kString, n); }
    case op::kShortBinBytes: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(1)); return PushText(Kind::kBytes, n); }
    case op::kBinBytes: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(4)); return PushText(Kind::kBytes, n); }
    case op::kBinBytes8: { SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(8)); return PushText(Kind::kBytes, n); }
    case op::kGlobal: {
      SP_ASSIGN_OR_RETURN(std::string_view module, ReadLine());
      SP_ASSIGN_OR_RETURN(std::string_view name, ReadLine());
      return PushGlobal(std::string(module), std::string(name));
    }
    case op::kStackGlobal: {
      SP_ASSIGN_OR_RETURN(PickleValue * name, Pop());
      SP_ASSIGN_OR_RETURN(PickleValue * module, Pop());
      if (!name->is(Kind::kString) || !module->is(Kind::kString)) {
        return Fail("STACK_GLOBAL needs two str, got " + DescribePickleValue(*module) + " and " +
                    DescribePickleValue(*name));
      }
      return PushGlobal(module->text, name->text);
    }
    default: *handled = false; return OkStatus();
  }
}

Status Unpickler::StepContainer(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case op::kEmptyTuple: return PushTuple({});
    case op::kTuple1:
    case op::kTuple2:
    case op::kTuple3: {
      std::vector<PickleValue*> items(op - op::kTuple1 + 1);
      for (size_t i = items.size(); i-- > 0;) {
        SP_ASSIGN_OR_RETURN(items[i], Pop());
      }
      return PushTuple(std::move(items));
    }
    case op::kTuple: { SP_ASSIGN_OR_RETURN(auto items, PopMark()); return PushTuple(std::move(items)); }
    case op::kEmptyList: case op::kEmptyDict: case op::kEmptySet: {
      Kind kind = op == op::kEmptyList ? Kind::kList : op == op::kEmptyDict ? Kind::kDict : Kind::kSet;
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(kind));
      return Push(node);
    }
    case op::kList: case op::kFrozenSet: case op::kDict: {
      SP_ASSIGN_OR_RETURN(auto items, PopMark());
      if (op == op::kDict && items.size() % 2 != 0) return Fail("odd number of items for a dict");
      Kind kind = op == op::kList ? Kind::kList : op == op::kDict ? Kind::kDict : Kind::kSet;
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(kind));
      node->items.assign(items.begin(), items.end());
      return Push(node);
    }
    case op::kAppend: case op::kAppends: case op::kAddItems: {
      std::vector<PickleValue*> items;
      if (op == op::kAppend) {
        SP_ASSIGN_OR_RETURN(PickleValue * v, Pop());
        items.push_back(v);
      } else {
        SP_ASSIGN_OR_RETURN(items, PopMark());
      }
      SP_ASSIGN_OR_RETURN(PickleValue * target, Top());
      Kind want = op == op::kAddItems ? Kind::kSet : Kind::kList;
      if (!target->is(want)) return Fail("adding items to " + DescribePickleValue(*target));
      target->items.insert(target->items.end(), items.begin(), items.end());
      return OkStatus();
    }
    case op::kSetItem: {
      SP_ASSIGN_OR_RETURN(PickleValue * value, Pop());
      SP_ASSIGN_OR_RETURN(PickleValue * key, Pop());
      return AddPairs({key, value});
    }
    case op::kSetItems: { SP_ASSIGN_OR_RETURN(auto items, PopMark()); return AddPairs(items); }
    default: *handled = false; return OkStatus();
  }
}

Status Unpickler::StepStack(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case op::kMark:
      if (marks_.size() >= options_.max_open_marks) {
        return Fail("more than " + std::to_string(options_.max_open_marks) + " nested MARKs");
      }
      marks_.push_back(stack_.size());
      return OkStatus();
    case op::kPop: {
      size_t floor = marks_.empty() ? 0 : marks_.back();
      if (stack_.size() > floor) return Pop().status();
      return PopMark().status();
    }
    case op::kPopMark: return PopMark().status();
    case op::kDup: { SP_ASSIGN_OR_RETURN(PickleValue * top, Top()); return Push(top); }
    case op::kMemoize: return Memoize(memo_.size());
    case op::kBinPut: { SP_ASSIGN_OR_RETURN(uint64_t i, ReadUnsigned(1)); return Memoize(i); }
    case op::kLongBinPut: { SP_ASSIGN_OR_RETURN(uint64_t i, ReadUnsigned(4)); return Memoize(i); }
    case op::kBinGet: { SP_ASSIGN_OR_RETURN(uint64_t i, ReadUnsigned(1)); return MemoGet(i); }
    case op::kLongBinGet: { SP_ASSIGN_OR_RETURN(uint64_t i, ReadUnsigned(4)); return MemoGet(i); }
    case op::kFrame: {
      SP_ASSIGN_OR_RETURN(uint64_t n, ReadUnsigned(8));
      if (n > in_.size() - pos_) return Fail("truncated: frame of " + std::to_string(n) + " bytes");
      return OkStatus();
    }
    case op::kProto: {
      SP_ASSIGN_OR_RETURN(uint64_t v, ReadUnsigned(1));
      if (v < 2 || v > 5) return Fail("unsupported pickle protocol " + std::to_string(v));
      return OkStatus();
    }
    default: *handled = false; return OkStatus();
  }
}

Status Unpickler::StepObject(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case op::kReduce: return MakeObject(PickleValue::Construction::kReduce, false);
    case op::kNewObj: return MakeObject(PickleValue::Construction::kNewObj, false);
    case op::kNewObjEx: return MakeObject(PickleValue::Construction::kNewObj, true);
    case op::kBuild: return Build();
    case op::kBinPersId: {
      if (!options_.allow_persistent_id) return Fail("persistent ids are not allowed here");
      SP_ASSIGN_OR_RETURN(PickleValue * pid, Pop());
      SP_ASSIGN_OR_RETURN(PickleValue * node, New(Kind::kPersistentId));
      node->args = pid;
      return Push(node);
    }
    default: *handled = false; return OkStatus();
  }
}

Status Unpickler::Step(uint8_t op) {
  bool handled = false;
  SP_RETURN_IF_ERROR(StepScalar(op, &handled));
  if (!handled) SP_RETURN_IF_ERROR(StepText(op, &handled));
  if (!handled) SP_RETURN_IF_ERROR(StepContainer(op, &handled));
  if (!handled) SP_RETURN_IF_ERROR(StepStack(op, &handled));
  if (!handled) SP_RETURN_IF_ERROR(StepObject(op, &handled));
  if (!handled) return Fail("unsupported opcode");
  return OkStatus();
}

Result<PickleTree> Unpickler::Run() {
  if (in_.empty() || static_cast<uint8_t>(in_[0]) != op::kProto) {
    op_ = in_.empty() ? 0 : static_cast<uint8_t>(in_[0]);
    return Fail("not a protocol 2-5 pickle: it must start with PROTO");
  }
  while (pos_ < in_.size()) {
    op_offset_ = pos_;
    op_ = static_cast<uint8_t>(in_[pos_++]);
    if (op_ == op::kStop) {
      SP_ASSIGN_OR_RETURN(PickleValue * result, Pop());
      if (pos_ != in_.size()) {
        return Fail(std::to_string(in_.size() - pos_) + " bytes after STOP");
      }
      PickleTree tree;
      tree.nodes_ = std::move(nodes_);
      tree.root_ = result;
      return tree;
    }
    SP_RETURN_IF_ERROR(Step(op_));
  }
  op_offset_ = pos_;
  return DataLossError("pickle " + std::string(options_.what) + ": truncated: no STOP opcode in " +
                       std::to_string(in_.size()) + " bytes");
}

Result<PickleTree> Unpickle(ByteView bytes, const UnpickleOptions& options) {
  Unpickler unpickler(bytes, options);
  return unpickler.Run();
}

}  // namespace sp::torch_dcp
