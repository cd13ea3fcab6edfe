#include "shardpoint/format/torch_save/pickle.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "shardpoint/format/torch_save/pickle_opcodes.h"
#include "shardpoint/format/torch_save/pickle_util.h"

namespace sp::torch_save {

using Kind = PickleValue::Kind;

// The live-value limit. Every opcode creates at most one value, so a pickle of n bytes could
// build n of them. What CPython (protocols 2 to 5) and torch write needs at most one per two
// bytes: opcodes that create a value take an argument (BININT1 and up: >= 2 bytes), or pop
// values that took bytes of their own (TUPLE1-3, REDUCE, NEWOBJ, STACK_GLOBAL, BINPERSID, LIST,
// DICT ...), or are one byte and then memoized by the pickler (EMPTY_LIST / DICT / SET, MEMOIZE
// or BINPUT: >= 2 bytes in all); the one-byte values CPython does not memoize (None, True, False,
// ()) are shared nodes here and cost nothing. The constant covers small pickles. A node is
// ~150 bytes with its items, so a pickle of n bytes holds at most ~75 n bytes + 10 MB of values.
size_t MaxLivePickleNodes(size_t input_bytes) { return input_bytes / 2 + (size_t{1} << 16); }

namespace {

// Longest module or name a GLOBAL or STACK_GLOBAL may carry.
constexpr size_t kMaxGlobalNameBytes = 1024;

}  // namespace

// Values are nodes of an arena (a deque: stable addresses). While the stream runs, each node
// counts the references the stack, the memo and other nodes hold (PickleValue::refs); a node
// whose count drops to zero is released with what it alone holds and reused by New(). Cycles
// (hostile input) are never released; they stay counted against the live limit.
class Unpickler {
 public:
  Unpickler(ByteView in, const UnpickleOptions& options)
      : in_(in),
        options_(options),
        nodes_(std::make_unique<std::deque<PickleValue>>()),
        live_limit_(std::min(options.max_nodes, MaxLivePickleNodes(in.size()))) {}

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
  Result<PickleValue*> Shared(Kind kind, bool bool_value = false);
  void Release(PickleValue* v);
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
  size_t live_limit_;
  std::vector<PickleValue*> free_;     // released nodes, reused by New()
  std::vector<PickleValue*> release_;  // Release()'s work list
  PickleValue* shared_[4] = {};        // None, False, True, (): created once, never released
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
  if (end > kMaxGlobalNameBytes) {
    return Fail("GLOBAL name longer than " + std::to_string(kMaxGlobalNameBytes) + " bytes");
  }
  pos_ += end + 1;
  return rest.substr(0, end);
}

Result<PickleValue*> Unpickler::New(Kind kind) {
  if (nodes_->size() - free_.size() >= live_limit_) {
    return Fail("more than " + std::to_string(live_limit_) + " values alive at once (the limit for " +
                std::to_string(in_.size()) + " bytes of pickle)");
  }
  PickleValue* v = nullptr;
  if (free_.empty()) {
    v = &nodes_->emplace_back();
  } else {
    v = free_.back();
    free_.pop_back();
  }
  v->kind = kind;
  return v;
}

Result<PickleValue*> Unpickler::Shared(Kind kind, bool bool_value) {
  const size_t slot = kind == Kind::kNone ? 0 : kind == Kind::kBool ? 1 + bool_value : 3;
  if (shared_[slot] == nullptr) {
    SP_ASSIGN_OR_RETURN(shared_[slot], New(kind));
    shared_[slot]->bool_value = bool_value;
    shared_[slot]->refs = 1;  // held for the whole run
  }
  return shared_[slot];
}

// Drops one reference to `v`; releases what is no longer referenced, iteratively (chains of
// nested values may be as long as the input). Nodes are owned (non-const) by the arena, so the
// const of PickleValue's child pointers may be cast away here.
void Unpickler::Release(PickleValue* v) {
  release_.push_back(v);
  while (!release_.empty()) {
    PickleValue* n = release_.back();
    release_.pop_back();
    if (--n->refs != 0) continue;
    for (const PickleValue* c : n->items) release_.push_back(const_cast<PickleValue*>(c));
    for (const PickleValue* c : {n->callable, n->args, n->kwargs, n->state}) {
      if (c != nullptr) release_.push_back(const_cast<PickleValue*>(c));
    }
    std::string().swap(n->text);  // give the memory back, not just the contents
    std::string().swap(n->name);
    std::vector<const PickleValue*>().swap(n->items);
    n->callable = n->args = n->kwargs = n->state = nullptr;
    n->construction = PickleValue::Construction::kReduce;
    n->bool_value = false;
    n->int_value = 0;
    n->float_value = 0;
    free_.push_back(n);
  }
}

// The stack holds a reference to each value on it; Pop() and PopMark() hand theirs to the caller,
// which stores the values into another (keeping the reference) or releases them.
Status Unpickler::Push(PickleValue* v) {
  if (stack_.size() >= options_.max_stack) {
    return Fail("stack deeper than " + std::to_string(options_.max_stack) + " values");
  }
  ++v->refs;
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
  if (items.empty()) {
    SP_ASSIGN_OR_RETURN(PickleValue * empty, Shared(Kind::kTuple));
    return Push(empty);
  }
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
  ++top->refs;
  PickleValue*& slot = memo_[index];
  PickleValue* replaced = slot;
  slot = top;
  if (replaced != nullptr) Release(replaced);
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
      SP_ASSIGN_OR_RETURN(PickleValue * node, Shared(Kind::kNone));
      return Push(node);
    }
    case op::kNewTrue:
    case op::kNewFalse: {
      SP_ASSIGN_OR_RETURN(PickleValue * node, Shared(Kind::kBool, op == op::kNewTrue));
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
      if (module->text.size() > kMaxGlobalNameBytes || name->text.size() > kMaxGlobalNameBytes) {
        return Fail("STACK_GLOBAL name longer than " + std::to_string(kMaxGlobalNameBytes) + " bytes");
      }
      std::string module_text = module->text;
      std::string name_text = name->text;
      Release(name);
      Release(module);
      return PushGlobal(std::move(module_text), std::move(name_text));
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
      if (stack_.size() > floor) {
        SP_ASSIGN_OR_RETURN(PickleValue * v, Pop());
        Release(v);
        return OkStatus();
      }
      SP_ASSIGN_OR_RETURN(std::vector<PickleValue*> dropped, PopMark());
      for (PickleValue* v : dropped) Release(v);
      return OkStatus();
    }
    case op::kPopMark: {
      SP_ASSIGN_OR_RETURN(std::vector<PickleValue*> dropped, PopMark());
      for (PickleValue* v : dropped) Release(v);
      return OkStatus();
    }
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
  if (in_.size() >= std::numeric_limits<uint32_t>::max() / 2) {  // PickleValue::refs stays 32-bit
    return DataLossError("pickle " + std::string(options_.what) + ": " + std::to_string(in_.size()) +
                         " bytes; pickles of 2 GiB or more are refused");
  }
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

}  // namespace sp::torch_save
