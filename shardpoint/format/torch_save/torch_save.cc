// Reading torch.save archives (the writer is in torch_save_writer.cc).
#include "shardpoint/format/torch_save/torch_save.h"

#include "shardpoint/format/torch_save/pickle.h"

namespace sp::torch_save {

using Kind = PickleValue::Kind;

namespace {

struct StorageClass {
  std::string_view name;
  DType dtype;
};

constexpr StorageClass kStorageClasses[] = {
    {"DoubleStorage", DType::kFloat64},        {"FloatStorage", DType::kFloat32},
    {"HalfStorage", DType::kFloat16},          {"BFloat16Storage", DType::kBFloat16},
    {"LongStorage", DType::kInt64},            {"IntStorage", DType::kInt32},
    {"ShortStorage", DType::kInt16},           {"CharStorage", DType::kInt8},
    {"ByteStorage", DType::kUInt8},            {"BoolStorage", DType::kBool},
    {"ComplexDoubleStorage", DType::kComplex128}, {"ComplexFloatStorage", DType::kComplex64},
};

Status Bad(std::string_view what, const std::string& problem) {
  return DataLossError("torch.save archive " + std::string(what) + ": " + problem);
}

// The opened archive: its directory, folder prefix ("archive/") and unpickled data.pkl.
struct OpenedArchive {
  ZipDirectory dir;
  std::string prefix;
  PickleTree pickle;
};

Status CheckSmallRecords(const RangeReader& read, const OpenedArchive& a, std::string_view what) {
  const ZipEntry* version = a.dir.Find(a.prefix + "version");
  if (version == nullptr) version = a.dir.Find(a.prefix + ".data/version");
  if (version == nullptr) return Bad(what, "no '" + a.prefix + "version' record");
  SP_ASSIGN_OR_RETURN(std::string v, ReadZipEntry(read, a.dir, *version, what, 64));
  if (v.empty() || v.find_first_not_of("0123456789\n") != std::string::npos) {
    return Bad(what, "version record is not a number");
  }
  const ZipEntry* byteorder = a.dir.Find(a.prefix + "byteorder");
  if (byteorder == nullptr) return OkStatus();  // torch reads such archives as little-endian
  SP_ASSIGN_OR_RETURN(std::string order, ReadZipEntry(read, a.dir, *byteorder, what, 64));
  if (order == "big") {
    return UnimplementedError("torch.save archive " + std::string(what) +
                              " was written on a big-endian machine; not supported");
  }
  if (order != "little") return Bad(what, "unknown byteorder '" + order + "'");
  return OkStatus();
}

Result<OpenedArchive> Open(const RangeReader& read, uint64_t length, std::string_view what,
                           std::span<const PickleGlobalName> globals, std::string_view list) {
  OpenedArchive a;
  SP_ASSIGN_OR_RETURN(a.dir, ReadZipDirectory(read, length, what));
  if (a.dir.entries.empty()) return Bad(what, "the archive has no entries");
  size_t slash = a.dir.entries[0].name.find('/');
  if (slash == std::string::npos) return Bad(what, "first entry is not inside a folder");
  a.prefix = a.dir.entries[0].name.substr(0, slash + 1);
  SP_RETURN_IF_ERROR(CheckSmallRecords(read, a, what));
  const ZipEntry* pkl = a.dir.Find(a.prefix + "data.pkl");
  if (pkl == nullptr) return Bad(what, "no '" + a.prefix + "data.pkl' record");
  SP_ASSIGN_OR_RETURN(std::string bytes, ReadZipEntry(read, a.dir, *pkl, what, kMaxDataPklBytes));
  std::string pickle_what = std::string(what) + " data.pkl";
  UnpickleOptions options;
  options.what = pickle_what;
  options.allowed_globals = globals;
  options.allowlist_name = list;
  options.allow_persistent_id = true;
  SP_ASSIGN_OR_RETURN(a.pickle, Unpickle(AsBytes(bytes), options));
  return a;
}

Result<DType> TorchDtype(const PickleValue& v, std::string_view what) {
  if (!v.is(Kind::kGlobal) || v.text != "torch") {
    return Bad(what, "expected a torch dtype, got " + DescribePickleValue(v));
  }
  for (DType d : AllDTypes()) {
    if (DTypeName(d) == v.name) return d;
  }
  return UnimplementedError("torch.save archive " + std::string(what) + ": dtype torch." + v.name +
                            " is not supported");
}

Result<std::vector<int64_t>> IntTuple(const PickleValue& v, std::string_view field,
                                      std::string_view what) {
  if (!v.is(Kind::kTuple) || v.items.size() > kMaxTensorRank) {
    return Bad(what, std::string(field) + " must be a tuple of at most 64 ints, got " + DescribePickleValue(v));
  }
  std::vector<int64_t> out;
  for (const PickleValue* item : v.items) {
    if (!item->is(Kind::kInt) || item->int_value < 0) {
      return Bad(what, std::string(field) + " holds " + DescribePickleValue(*item));
    }
    out.push_back(item->int_value);
  }
  return out;
}

// The storage persistent id ("storage", class, key, location, numel) -> key, dtype, bytes.
Status ParseStorage(const PickleValue& pid, const PickleValue* v3_dtype, TorchSaveTensorInfo* info,
                    std::string* key, std::string_view what) {
  const PickleValue* id = pid.args;
  if (!pid.is(Kind::kPersistentId) || !id->is(Kind::kTuple) || id->items.size() != 5 ||
      !id->items[0]->is(Kind::kString) || id->items[0]->text != "storage" ||
      !id->items[1]->is(Kind::kGlobal) || !id->items[2]->is(Kind::kString) ||
      !id->items[4]->is(Kind::kInt) || id->items[4]->int_value < 0) {
    return Bad(what, "tensor storage is not a ('storage', class, key, location, numel) id");
  }
  const PickleValue& cls = *id->items[1];
  *key = id->items[2]->text;
  uint64_t numel = static_cast<uint64_t>(id->items[4]->int_value);
  if (cls.name == "UntypedStorage") {
    if (v3_dtype == nullptr) return Bad(what, "UntypedStorage without a dtype (_rebuild_tensor_v3)");
    SP_ASSIGN_OR_RETURN(info->dtype, TorchDtype(*v3_dtype, what));
    info->storage_bytes = numel;
    return OkStatus();
  }
  for (const StorageClass& sc : kStorageClasses) {
    if (cls.text == "torch" && cls.name == sc.name) {
      info->dtype = sc.dtype;
      if (v3_dtype != nullptr) {
        SP_ASSIGN_OR_RETURN(info->dtype, TorchDtype(*v3_dtype, what));
      }
      if (__builtin_mul_overflow(numel, DTypeSize(sc.dtype), &info->storage_bytes)) {
        return Bad(what, "storage size overflows");
      }
      return OkStatus();
    }
  }
  return UnimplementedError("torch.save archive " + std::string(what) + ": storage class " +
                            cls.text + "." + cls.name + " is not supported");
}

// Checks that every element of the view lies inside the storage.
Status CheckViewInStorage(const TorchSaveTensorInfo& info, std::string_view what) {
  uint64_t itemsize = DTypeSize(info.dtype);
  if (info.storage_bytes % itemsize != 0) return Bad(what, "storage bytes are not whole elements");
  uint64_t elements = info.storage_bytes / itemsize;
  uint64_t last = static_cast<uint64_t>(info.storage_offset);
  for (size_t d = 0; d < info.shape.size(); ++d) {
    if (info.shape[d] == 0) return OkStatus();  // no elements at all
  }
  for (size_t d = 0; d < info.shape.size(); ++d) {
    uint64_t step;
    if (__builtin_mul_overflow(static_cast<uint64_t>(info.shape[d] - 1),
                               static_cast<uint64_t>(info.strides[d]), &step) ||
        __builtin_add_overflow(last, step, &last)) {
      return Bad(what, "tensor view overflows");
    }
  }
  if (last >= elements) {
    return Bad(what, "tensor view of shape " + ShapeToString(info.shape) + " at storage offset " +
                         std::to_string(info.storage_offset) + " reaches element " + std::to_string(last) +
                         " but the storage holds " + std::to_string(elements));
  }
  return OkStatus();
}

// A `_rebuild_tensor_v2/_v3(storage, offset, size, stride, requires_grad, hooks[, dtype][, md])`.
Result<TorchSaveTensorInfo> ParseTensorValue(const RangeReader& read, const OpenedArchive& a,
                                             const PickleValue& v, std::string_view what) {
  bool v2 = IsObjectOf(v, "torch._utils", "_rebuild_tensor_v2");
  bool v3 = IsObjectOf(v, "torch._utils", "_rebuild_tensor_v3");
  if ((!v2 && !v3) || v.construction != PickleValue::Construction::kReduce || v.state != nullptr) {
    return Bad(what, "expected a tensor (torch._utils._rebuild_tensor_v2), got " + DescribePickleValue(v));
  }
  const std::vector<const PickleValue*>& args = v.args->items;
  size_t base = v2 ? 6 : 7;
  if (args.size() != base && args.size() != base + 1) {
    return Bad(what, "tensor rebuild has " + std::to_string(args.size()) + " arguments");
  }
  TorchSaveTensorInfo info;
  std::string key;
  SP_RETURN_IF_ERROR(ParseStorage(*args[0], v3 ? args[6] : nullptr, &info, &key, what));
  if (!args[1]->is(Kind::kInt) || args[1]->int_value < 0) return Bad(what, "bad storage offset");
  info.storage_offset = args[1]->int_value;
  SP_ASSIGN_OR_RETURN(info.shape, IntTuple(*args[2], "size", what));
  SP_ASSIGN_OR_RETURN(info.strides, IntTuple(*args[3], "stride", what));
  if (info.shape.size() != info.strides.size()) return Bad(what, "size and stride ranks differ");
  // A view may repeat storage elements (stride 0), so the storage bounds nothing: the view's own
  // size must be within the shared limit before anything is sized from it (metadata.h).
  SP_RETURN_IF_ERROR(CheckedTensorBytes(info.dtype, info.shape,
                                        "torch.save archive " + std::string(what) + ": tensor view")
                         .status());
  info.record = a.prefix + "data/" + key;
  const ZipEntry* entry = a.dir.Find(info.record);
  if (entry == nullptr) return Bad(what, "no storage record '" + info.record + "'");
  if (entry->size != info.storage_bytes) {
    return Bad(what, "storage record '" + info.record + "' has " + std::to_string(entry->size) +
                         " bytes but the storage declares " + std::to_string(info.storage_bytes));
  }
  SP_ASSIGN_OR_RETURN(info.data_offset, ZipEntryDataOffset(read, a.dir, *entry, what));
  SP_RETURN_IF_ERROR(CheckViewInStorage(info, what));
  return info;
}

}  // namespace

bool TorchSaveTensorInfo::IsDenseRowMajor() const {
  int64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return storage_offset == 0 && storage_bytes == static_cast<uint64_t>(expected) * DTypeSize(dtype);
}

Result<TorchSaveTensorInfo> ParseTorchSaveTensor(const RangeReader& read, uint64_t archive_length,
                                                 std::string_view what) {
  SP_ASSIGN_OR_RETURN(OpenedArchive a, Open(read, archive_length, what, TorchSaveTensorGlobals(),
                                            "torch.save tensor"));
  return ParseTensorValue(read, a, a.pickle.root(), what);
}

Result<std::vector<TorchSaveNamedTensor>> ParseTorchSaveStateDict(const RangeReader& read,
                                                                  uint64_t archive_length,
                                                                  std::string_view what) {
  SP_ASSIGN_OR_RETURN(OpenedArchive a, Open(read, archive_length, what, TorchSaveTensorGlobals(),
                                            "torch.save tensor"));
  const PickleValue& root = a.pickle.root();
  bool ordered = IsObjectOf(root, "collections", "OrderedDict");
  if (!root.is(Kind::kDict) && !ordered) {
    return Bad(what, "expected a dict of tensors, got " + DescribePickleValue(root));
  }
  std::vector<TorchSaveNamedTensor> out;
  for (size_t i = 0; i < root.pair_count(); ++i) {
    if (!root.key(i).is(Kind::kString)) return Bad(what, "state dict key is " + DescribePickleValue(root.key(i)));
    std::string item_what = std::string(what) + " tensor '" + root.key(i).text + "'";
    SP_ASSIGN_OR_RETURN(TorchSaveTensorInfo info, ParseTensorValue(read, a, root.value(i), item_what));
    out.push_back({root.key(i).text, std::move(info)});
  }
  return out;
}

Result<PlainValue> ParseTorchSaveObject(const RangeReader& read, uint64_t archive_length,
                                        std::string_view what) {
  SP_ASSIGN_OR_RETURN(OpenedArchive a,
                      Open(read, archive_length, what, PlainDataGlobals(), "plain data"));
  return ToPlainValue(a.pickle.root(), std::string(what) + " data.pkl",
                      PlainValueBudget(archive_length));
}

ObjectEntry ObjectFromTorchSaveItem(std::string name, std::string archive) {
  if (archive.size() <= kMaxPlainObjectItemBytes) {
    Result<PlainValue> value = ParseTorchSaveObject(MemoryRangeReader(AsBytes(archive)),
                                                    archive.size(), "object '" + name + "'");
    if (value.ok()) {
      Result<std::string> pickle = EncodePlainPickle(*value);
      if (pickle.ok()) return ObjectEntry{std::move(name), ObjectEncoding::kPlain, std::move(*pickle)};
    }
  }
  return ObjectEntry{std::move(name), ObjectEncoding::kTorchSave, std::move(archive)};
}

std::string_view TorchStorageClassName(DType dtype) {
  for (const StorageClass& sc : kStorageClasses) {
    if (sc.dtype == dtype) return sc.name;
  }
  return "";
}

}  // namespace sp::torch_save
