// A restricted unpickler: Python pickle bytes (protocols 2 to 5) -> a small value tree.
//
// PyTorch DCP's `.metadata` and the `data.pkl` of every torch.save archive are pickles. Reading
// them must never run code, so this unpickler only builds values: None, bool, int (64-bit), float,
// str, bytes, tuple, list, dict (ordered key/value pairs), set, references to globals, "objects"
// (a global called through REDUCE / NEWOBJ / NEWOBJ_EX, with its arguments and the state given to
// BUILD), and persistent ids (BINPERSID, torch.save's storages). What an object means is decided
// by the caller (dcp_metadata.cc, torch_save.cc), never here.
//
// Safety rules (docs/TORCH_DCP.md):
//  - Every GLOBAL / STACK_GLOBAL is checked against the caller's allowlist (unless the caller
//    sets allow_any_global); anything else is refused with kDataLoss naming `module.name` and
//    its byte offset.
//  - Only the opcodes pickle.cc handles are accepted (docs/TORCH_DCP.md §5); any other is refused
//    naming its byte value, its pickle name and its offset.
//  - Caps on open MARKs, stack size, memo entries, live values and string lengths (checked
//    against the bytes that remain); truncated input is a clean kDataLoss.
//  - Memory is bounded by the input size: values that become unreachable (popped by POP or
//    POP_MARK, consumed by STACK_GLOBAL, replaced in the memo) are freed as the stream runs and
//    their nodes reused; None, True, False and () are shared nodes; at most
//    MaxLivePickleNodes(input size) values are alive at once (pickle.cc gives the reasoning).
//  - Integers wider than 64 bits are refused.
// Python 2 module names that protocol-2 pickles from Python 3 carry (`__builtin__`, `copy_reg`)
// are mapped to their Python 3 names before the allowlist check, as Python's unpickler does.
//
// The value tree may share nodes (memo) and, for hostile input, contain cycles; it is owned by a
// PickleTree arena, so neither leaks. Code that walks it generically must bound its recursion
// (see kMaxPickleWalkDepth). All functions are thread-safe; a PickleTree is immutable once built.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"

namespace sp::torch_save {

// Deepest recursion a generic walk of a PickleTree may do (ToPlainValue, DescribePickleValue).
inline constexpr int kMaxPickleWalkDepth = 128;

struct PickleValue {
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kTuple,
    kList,
    kDict,
    kSet,           // set or frozenset
    kGlobal,        // a reference to module.name
    kObject,        // callable(*args) via REDUCE, or cls.__new__(cls, *args) via NEWOBJ(_EX)
    kPersistentId,  // BINPERSID: `args` is the persistent id
  };
  enum class Construction : uint8_t { kReduce, kNewObj };

  Kind kind = Kind::kNone;
  Construction construction = Construction::kReduce;  // kObject
  bool bool_value = false;                            // kBool
  // References to this node from the unpickler's stack, memo and other nodes while it runs
  // (pickle.cc frees a node when they drop to zero); meaningless in a finished tree.
  uint32_t refs = 0;
  int64_t int_value = 0;                              // kInt
  double float_value = 0;                             // kFloat
  std::string text;  // kString (UTF-8), kBytes, kGlobal: the module
  std::string name;  // kGlobal: the qualified name
  // kTuple / kList / kSet: the items. kDict: key0, value0, key1, value1, ... in insertion order.
  // kObject: pairs added by SETITEM(S) (an OrderedDict's contents), laid out as for kDict.
  std::vector<const PickleValue*> items;
  const PickleValue* callable = nullptr;  // kObject: the kGlobal called
  const PickleValue* args = nullptr;      // kObject: the args tuple; kPersistentId: the id
  const PickleValue* kwargs = nullptr;    // kObject built by NEWOBJ_EX: the kwargs dict
  const PickleValue* state = nullptr;     // kObject: what BUILD gave it, or null

  bool is(Kind k) const { return kind == k; }
  size_t pair_count() const { return items.size() / 2; }  // kDict / kObject
  const PickleValue& key(size_t i) const { return *items[2 * i]; }
  const PickleValue& value(size_t i) const { return *items[2 * i + 1]; }
};

// True when `v` is a kGlobal module.name, or a kObject whose callable is module.name.
bool IsGlobal(const PickleValue& v, std::string_view module, std::string_view name);
bool IsObjectOf(const PickleValue& v, std::string_view module, std::string_view name);

// For an object whose BUILD state is a dict (or a (dict, slots) tuple): the value of attribute
// `attr`, or null when the state has no such key. Keys must be str.
const PickleValue* FindAttribute(const PickleValue& object, std::string_view attr);

// A short description for error messages: "None", "int 5", "str 'w'", "tuple of 2",
// "object torch.Size", "global torch.float32".
std::string DescribePickleValue(const PickleValue& v);

// An unpickled value and the arena that owns all of its nodes. Move-only.
class PickleTree {
 public:
  PickleTree() = default;
  PickleTree(PickleTree&&) noexcept = default;
  PickleTree& operator=(PickleTree&&) noexcept = default;

  const PickleValue& root() const { return *root_; }
  // Nodes the arena holds: the most values that were alive at once while unpickling (freed nodes
  // are reused), not the number of values the stream created.
  size_t node_count() const { return nodes_ ? nodes_->size() : 0; }

 private:
  friend class Unpickler;
  std::unique_ptr<std::deque<PickleValue>> nodes_;  // the deque never moves: stable addresses
  const PickleValue* root_ = nullptr;
};

struct PickleGlobalName {
  std::string_view module;
  std::string_view name;
};

struct UnpickleOptions {
  // Names the input in messages ("/ckpt/.metadata", "__0_0.distcp item 'w' data.pkl").
  std::string_view what;
  // Globals that may be referenced; anything else is refused. `allowlist_name` names the list in
  // the message ("DCP metadata").
  std::span<const PickleGlobalName> allowed_globals;
  std::string_view allowlist_name = "allowlist";
  // Accept every global (still never called: the tree stays inert). For callers that only
  // re-emit a pickle's objects without interpreting them (megatron.h), never for decoders that
  // act on what they find.
  bool allow_any_global = false;
  // BINPERSID is refused unless set (torch.save's data.pkl uses it; DCP metadata never does).
  bool allow_persistent_id = false;
  size_t max_open_marks = 256;   // nesting of MARK ... TUPLE/LIST/DICT/SETITEMS/APPENDS
  size_t max_stack = 1u << 20;   // values on the stack at once
  size_t max_memo = 1u << 24;    // memo entries
  size_t max_nodes = 1u << 26;   // values alive at once (also capped by MaxLivePickleNodes)
};

// The most values a pickle of `input_bytes` bytes may hold alive at once: input_bytes / 2 + 65536
// (pickle.cc explains why every pickle CPython or torch writes stays under it).
size_t MaxLivePickleNodes(size_t input_bytes);

// Unpickles `bytes`. The stream must start with PROTO 2..5 and end with STOP; trailing bytes
// after STOP are refused. Errors are kDataLoss: "pickle <what>: <problem> at byte <offset>".
Result<PickleTree> Unpickle(ByteView bytes, const UnpickleOptions& options);

// The globals a DCP `.metadata` written by torch >= 2.0 references (docs/TORCH_DCP.md §2).
std::span<const PickleGlobalName> DcpMetadataGlobals();
// The globals of a torch.save data.pkl holding tensors (rebuild functions, storage classes,
// dtypes, collections.OrderedDict for the backward-hooks argument and state dicts).
std::span<const PickleGlobalName> TorchSaveTensorGlobals();
// The globals plain Python data needs in a protocol-2 pickle (collections.OrderedDict,
// _codecs.encode and builtins.bytes for bytes, builtins.set / frozenset).
std::span<const PickleGlobalName> PlainDataGlobals();

// The pickle name of an opcode byte ("REDUCE"), or "unknown".
std::string_view PickleOpcodeName(uint8_t opcode);

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_H_
