// PickleValue helpers, the allowlists and the opcode names.
#include <array>
#include <cstdio>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/format/torch_save/pickle.h"
#include "shardpoint/format/torch_save/pickle_util.h"

namespace sp::torch_save {

using Kind = PickleValue::Kind;

bool IsGlobal(const PickleValue& v, std::string_view module, std::string_view name) {
  return v.is(Kind::kGlobal) && v.text == module && v.name == name;
}

bool IsObjectOf(const PickleValue& v, std::string_view module, std::string_view name) {
  return v.is(Kind::kObject) && v.callable != nullptr && IsGlobal(*v.callable, module, name);
}

const PickleValue* FindAttribute(const PickleValue& object, std::string_view attr) {
  const PickleValue* state = object.state;
  if (state == nullptr) return nullptr;
  if (state->is(Kind::kTuple) && state->items.size() == 2) state = state->items[0];
  if (!state->is(Kind::kDict)) return nullptr;
  for (size_t i = 0; i < state->pair_count(); ++i) {
    if (state->key(i).is(Kind::kString) && state->key(i).text == attr) return &state->value(i);
  }
  return nullptr;
}

std::string DescribePickleValue(const PickleValue& v) {
  auto quoted = [](const std::string& s) {
    return "'" + (s.size() > 40 ? s.substr(0, 40) + "..." : s) + "'";
  };
  switch (v.kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return v.bool_value ? "True" : "False";
    case Kind::kInt: return "int " + std::to_string(v.int_value);
    case Kind::kFloat: return "float " + std::to_string(v.float_value);
    case Kind::kString: return "str " + quoted(v.text);
    case Kind::kBytes: return "bytes of length " + std::to_string(v.text.size());
    case Kind::kTuple: return "tuple of " + std::to_string(v.items.size());
    case Kind::kList: return "list of " + std::to_string(v.items.size());
    case Kind::kDict: return "dict of " + std::to_string(v.pair_count());
    case Kind::kSet: return "set of " + std::to_string(v.items.size());
    case Kind::kGlobal: return "global " + v.text + "." + v.name;
    case Kind::kObject:
      return "object " + (v.callable ? v.callable->text + "." + v.callable->name : std::string("?"));
    case Kind::kPersistentId: return "persistent id";
  }
  return "value";
}

bool IsPythonUtf8(std::string_view s) {
  size_t i = 0;
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    unsigned c = b[i];
    size_t n = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xe ? 2 : (c >> 3) == 0x1e ? 3 : 9;
    if (n == 9 || s.size() - i - 1 < n) return false;
    uint32_t cp = n == 0 ? c : n == 1 ? (c & 0x1f) : n == 2 ? (c & 0x0f) : (c & 0x07);
    for (size_t k = 1; k <= n; ++k) {
      if ((b[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (b[i + k] & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff) return false;
    i += n + 1;
  }
  return true;
}

void MapPython2Module(std::string* module) {
  if (*module == "__builtin__") *module = "builtins";
  if (*module == "copy_reg") *module = "copyreg";
}

namespace {

constexpr PickleGlobalName kDcpFixed[] = {
    {"torch.distributed.checkpoint.metadata", "Metadata"},
    {"torch.distributed.checkpoint.metadata", "TensorStorageMetadata"},
    {"torch.distributed.checkpoint.metadata", "BytesStorageMetadata"},
    {"torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"},
    {"torch.distributed.checkpoint.metadata", "TensorProperties"},
    {"torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"},
    {"torch.distributed.checkpoint.metadata", "MetadataIndex"},
    {"torch.distributed.checkpoint.metadata", "StorageMeta"},
    {"torch.distributed.checkpoint.filesystem", "_StorageInfo"},
    // Metadata.all_local_plans, which megatron-core's torch_dist save attaches (each rank's
    // SavePlan); decoded as data and only checked for its shape (dcp_metadata.cc).
    {"torch.distributed.checkpoint.planner", "SavePlan"},
    {"torch.distributed.checkpoint.planner", "WriteItem"},
    {"torch.distributed.checkpoint.planner", "WriteItemType"},
    {"torch.distributed.checkpoint.planner", "TensorWriteData"},
    {"torch.distributed.checkpoint.planner", "BytesIOWriteData"},
    {"torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"},
    {"torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"},
    {"torch", "Size"},
    {"torch", "strided"},
    {"torch.serialization", "_get_layout"},
    {"pathlib", "PosixPath"},
    {"pathlib", "WindowsPath"},
    {"pathlib", "PurePosixPath"},
    {"pathlib", "PureWindowsPath"},
    {"pathlib._local", "PosixPath"},
    {"pathlib._local", "WindowsPath"},
    {"pathlib._local", "PurePosixPath"},
    {"pathlib._local", "PureWindowsPath"},    // bytes inside planner_data, as a protocol-2 pickler writes them (EncodeDcpMetadata does):
    // _codecs.encode(str, 'latin1'), and bytes() for b''.
    {"_codecs", "encode"},
    {"builtins", "bytes"},
};

constexpr PickleGlobalName kTensorFixed[] = {
    {"torch._utils", "_rebuild_tensor_v2"}, {"torch._utils", "_rebuild_tensor_v3"},
    {"collections", "OrderedDict"},         {"torch", "UntypedStorage"},
    {"torch.storage", "UntypedStorage"},    {"torch", "DoubleStorage"},
    {"torch", "FloatStorage"},              {"torch", "HalfStorage"},
    {"torch", "BFloat16Storage"},           {"torch", "LongStorage"},
    {"torch", "IntStorage"},                {"torch", "ShortStorage"},
    {"torch", "CharStorage"},               {"torch", "ByteStorage"},
    {"torch", "BoolStorage"},               {"torch", "ComplexDoubleStorage"},
    {"torch", "ComplexFloatStorage"},
};

constexpr PickleGlobalName kPlain[] = {
    {"collections", "OrderedDict"},
    {"_codecs", "encode"},
    {"builtins", "bytes"},
    {"builtins", "set"},
    {"builtins", "frozenset"},
};

// torch dtypes shardpoint has no DType for; allowed so that the decoders can name them.
constexpr std::string_view kOtherTorchDtypes[] = {"complex32", "float4_e2m1fn_x2", "qint8",
                                                  "quint8", "qint32", "quint4x2"};

std::vector<PickleGlobalName> WithDtypes(std::span<const PickleGlobalName> fixed) {
  std::vector<PickleGlobalName> all(fixed.begin(), fixed.end());
  for (DType d : AllDTypes()) all.push_back({"torch", DTypeName(d)});
  for (std::string_view name : kOtherTorchDtypes) all.push_back({"torch", name});
  return all;
}

}  // namespace

std::span<const PickleGlobalName> DcpMetadataGlobals() {
  static const std::vector<PickleGlobalName>* const kAll =
      new std::vector<PickleGlobalName>(WithDtypes(kDcpFixed));
  return *kAll;
}

std::span<const PickleGlobalName> TorchSaveTensorGlobals() {
  static const std::vector<PickleGlobalName>* const kAll =
      new std::vector<PickleGlobalName>(WithDtypes(kTensorFixed));
  return *kAll;
}

std::span<const PickleGlobalName> PlainDataGlobals() { return kPlain; }

std::string_view PickleOpcodeName(uint8_t opcode) {
  struct Name {
    uint8_t op;
    std::string_view name;
  };
  static constexpr Name kNames[] = {
      {'(', "MARK"}, {'.', "STOP"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"},
      {'F', "FLOAT"}, {'I', "INT"}, {'J', "BININT"}, {'K', "BININT1"}, {'L', "LONG"},
      {'M', "BININT2"}, {'N', "NONE"}, {'P', "PERSID"}, {'Q', "BINPERSID"}, {'R', "REDUCE"},
      {'S', "STRING"}, {'T', "BINSTRING"}, {'U', "SHORT_BINSTRING"}, {'V', "UNICODE"},
      {'X', "BINUNICODE"}, {'a', "APPEND"}, {'b', "BUILD"}, {'c', "GLOBAL"}, {'d', "DICT"},
      {'}', "EMPTY_DICT"}, {'e', "APPENDS"}, {'g', "GET"}, {'h', "BINGET"}, {'i', "INST"},
      {'j', "LONG_BINGET"}, {'l', "LIST"}, {']', "EMPTY_LIST"}, {'o', "OBJ"}, {'p', "PUT"},
      {'q', "BINPUT"}, {'r', "LONG_BINPUT"}, {'s', "SETITEM"}, {'t', "TUPLE"},
      {')', "EMPTY_TUPLE"}, {'u', "SETITEMS"}, {'G', "BINFLOAT"}, {'B', "BINBYTES"},
      {'C', "SHORT_BINBYTES"}, {0x80, "PROTO"}, {0x81, "NEWOBJ"}, {0x82, "EXT1"},
      {0x83, "EXT2"}, {0x84, "EXT4"}, {0x85, "TUPLE1"}, {0x86, "TUPLE2"}, {0x87, "TUPLE3"},
      {0x88, "NEWTRUE"}, {0x89, "NEWFALSE"}, {0x8a, "LONG1"}, {0x8b, "LONG4"},
      {0x8c, "SHORT_BINUNICODE"}, {0x8d, "BINUNICODE8"}, {0x8e, "BINBYTES8"},
      {0x8f, "EMPTY_SET"}, {0x90, "ADDITEMS"}, {0x91, "FROZENSET"}, {0x92, "NEWOBJ_EX"},
      {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"}, {0x95, "FRAME"}, {0x96, "BYTEARRAY8"},
      {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
  };
  for (const Name& n : kNames) {
    if (n.op == opcode) return n.name;
  }
  return "unknown";
}

}  // namespace sp::torch_save
