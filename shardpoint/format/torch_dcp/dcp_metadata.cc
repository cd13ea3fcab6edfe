// Decoding `.metadata` (the encoder and the validation are in dcp_metadata_encode.cc).
#include "shardpoint/format/torch_dcp/dcp_metadata.h"

#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_save/pickle.h"

namespace sp::torch_dcp {

using torch_save::DcpMetadataGlobals;
using torch_save::DescribePickleValue;
using torch_save::FindAttribute;
using torch_save::IsGlobal;
using torch_save::IsObjectOf;
using torch_save::PickleTree;
using torch_save::PickleValue;
using torch_save::ToPlainValue;
using torch_save::Unpickle;

using torch_save::UnpickleOptions;

using Kind = PickleValue::Kind;

namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata";
constexpr char kOldPropertiesModule[] = "torch.distributed._shard.sharded_tensor.metadata";

class Decoder {
 public:
  // `pickle_bytes`: the size of the .metadata, which bounds the plain values decoded from it
  // (torch_save::PlainValueBudget).
  Decoder(std::string_view path, uint64_t pickle_bytes)
      : path_(path), max_plain_values_(torch_save::PlainValueBudget(pickle_bytes)) {}
  Result<DcpMetadata> Decode(const PickleValue& root);

 private:
  Status Err(std::string_view where, const std::string& problem) const {
    return DataLossError("DCP metadata " + std::string(path_) + ": " + std::string(where) + ": " + problem);
  }
  Status ExpectClass(const PickleValue& v, std::string_view module, std::string_view name,
                     std::string_view where) const;
  Result<const PickleValue*> Required(const PickleValue& obj, std::string_view attr,
                                      std::string_view where) const;
  Result<std::vector<int64_t>> DecodeSize(const PickleValue& v, std::string_view where) const;
  Result<std::optional<std::string>> OptionalString(const PickleValue* v, std::string_view where) const;
  Result<DcpTensorProperties> DecodeProperties(const PickleValue& v, std::string_view where) const;
  Result<DcpEntry> DecodeEntry(const std::string& fqn, const PickleValue& v) const;
  Result<DcpStorageEntry> DecodeStorage(const PickleValue& key, const PickleValue& value) const;
  Result<DcpStorageMeta> DecodeStorageMeta(const PickleValue& v) const;
  Result<std::string> DecodePath(const PickleValue& v, std::string_view where) const;
  Status CheckLocalPlans(const PickleValue& root) const;

  std::string_view path_;
  uint64_t max_plain_values_;
};

Status Decoder::ExpectClass(const PickleValue& v, std::string_view module, std::string_view name,
                            std::string_view where) const {
  if (IsObjectOf(v, module, name)) return OkStatus();
  return Err(where, "expected " + std::string(module) + "." + std::string(name) + ", got " +
                        DescribePickleValue(v));
}

Result<const PickleValue*> Decoder::Required(const PickleValue& obj, std::string_view attr,
                                             std::string_view where) const {
  const PickleValue* v = FindAttribute(obj, attr);
  if (v == nullptr) return Err(where, "missing attribute '" + std::string(attr) + "'");
  return v;
}

// torch.Size((d0, d1, ...)) (a plain tuple of ints is accepted too).
Result<std::vector<int64_t>> Decoder::DecodeSize(const PickleValue& v, std::string_view where) const {
  const PickleValue* tuple = &v;
  if (IsObjectOf(v, "torch", "Size")) {
    if (v.args->items.size() != 1) return Err(where, "torch.Size needs one tuple argument");
    tuple = v.args->items[0];
  }
  if (!tuple->is(Kind::kTuple) || tuple->items.size() > 64) {
    return Err(where, "expected a torch.Size of at most 64 dimensions, got " + DescribePickleValue(v));
  }
  std::vector<int64_t> out;
  for (const PickleValue* item : tuple->items) {
    if (!item->is(Kind::kInt) || item->int_value < 0) {
      return Err(where, "size element is " + DescribePickleValue(*item) + ", expected an int >= 0");
    }
    out.push_back(item->int_value);
  }
  return out;
}

Result<std::optional<std::string>> Decoder::OptionalString(const PickleValue* v,
                                                           std::string_view where) const {
  if (v == nullptr || v->is(Kind::kNone)) return std::optional<std::string>();
  if (!v->is(Kind::kString)) return Err(where, "expected a str or None, got " + DescribePickleValue(*v));
  return std::optional<std::string>(v->text);
}

// TensorProperties' state: (dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(n), pin_memory).
Result<DcpTensorProperties> Decoder::DecodeProperties(const PickleValue& v, std::string_view where) const {
  if (!IsObjectOf(v, kMetadataModule, "TensorProperties") &&
      !IsObjectOf(v, kOldPropertiesModule, "TensorProperties")) {
    return Err(where, "expected TensorProperties, got " + DescribePickleValue(v));
  }
  const PickleValue* s = v.state;
  if (s == nullptr || !s->is(Kind::kTuple) || s->items.size() != 5) {
    return Err(where, "TensorProperties state is not a 5-tuple");
  }
  DcpTensorProperties p;
  const PickleValue& dtype = *s->items[0];
  bool known = false;
  for (DType d : AllDTypes()) {
    if (IsGlobal(dtype, "torch", DTypeName(d))) p.dtype = d, known = true;
  }
  if (!known && dtype.is(Kind::kGlobal) && dtype.text == "torch") {
    return UnimplementedError("DCP metadata " + std::string(path_) + ": " + std::string(where) +
                              ": dtype torch." + dtype.name + " is not supported");
  }
  if (!known) return Err(where, "dtype is " + DescribePickleValue(dtype));
  const PickleValue& layout = *s->items[1];
  bool strided = IsGlobal(layout, "torch", "strided") ||
                 (IsObjectOf(layout, "torch.serialization", "_get_layout") &&
                  layout.args->items.size() == 1 && layout.args->items[0]->is(Kind::kString) &&
                  layout.args->items[0]->text == "torch.strided");
  if (!strided) {
    return UnimplementedError("DCP metadata " + std::string(path_) + ": " + std::string(where) +
                              ": layout " + DescribePickleValue(layout) + " is not supported (only torch.strided)");
  }
  const PickleValue& fmt = *s->items[3];
  bool enum_ok = (IsObjectOf(fmt, kMetadataModule, "_MEM_FORMAT_ENCODING") ||
                  IsObjectOf(fmt, kOldPropertiesModule, "MEM_FORMAT_ENCODING")) &&
                 fmt.args->items.size() == 1 && fmt.args->items[0]->is(Kind::kInt) &&
                 fmt.args->items[0]->int_value >= 0 && fmt.args->items[0]->int_value <= 2;
  if (!enum_ok) return Err(where, "memory format is " + DescribePickleValue(fmt));
  p.memory_format = static_cast<DcpMemoryFormat>(fmt.args->items[0]->int_value);
  if (!s->items[2]->is(Kind::kBool) || !s->items[4]->is(Kind::kBool)) {
    return Err(where, "requires_grad / pin_memory are not bools");
  }
  p.requires_grad = s->items[2]->bool_value;
  p.pin_memory = s->items[4]->bool_value;
  return p;
}

Result<DcpEntry> Decoder::DecodeEntry(const std::string& fqn, const PickleValue& v) const {
  std::string where = "key '" + fqn + "'";
  DcpEntry e;
  e.fqn = fqn;
  if (IsObjectOf(v, kMetadataModule, "BytesStorageMetadata")) {
    e.kind = DcpEntry::Kind::kBytes;
    return e;
  }
  SP_RETURN_IF_ERROR(ExpectClass(v, kMetadataModule, "TensorStorageMetadata", where));
  SP_ASSIGN_OR_RETURN(const PickleValue* props, Required(v, "properties", where));
  SP_ASSIGN_OR_RETURN(e.properties, DecodeProperties(*props, where));
  SP_ASSIGN_OR_RETURN(const PickleValue* size, Required(v, "size", where));
  SP_ASSIGN_OR_RETURN(e.size, DecodeSize(*size, where + " size"));
  // The size bounds every chunk's volume and byte length computed from it (metadata.h).
  SP_RETURN_IF_ERROR(CheckedTensorBytes(e.properties.dtype, e.size,
                                        "DCP metadata " + std::string(path_) + ": " + where + " size")
                         .status());
  SP_ASSIGN_OR_RETURN(const PickleValue* chunks, Required(v, "chunks", where));
  if (!chunks->is(Kind::kList)) return Err(where, "chunks is " + DescribePickleValue(*chunks));
  for (size_t i = 0; i < chunks->items.size(); ++i) {
    std::string cw = where + " chunk " + std::to_string(i);
    const PickleValue& c = *chunks->items[i];
    SP_RETURN_IF_ERROR(ExpectClass(c, kMetadataModule, "ChunkStorageMetadata", cw));
    SP_ASSIGN_OR_RETURN(const PickleValue* offsets, Required(c, "offsets", cw));
    SP_ASSIGN_OR_RETURN(const PickleValue* sizes, Required(c, "sizes", cw));
    Box box;
    SP_ASSIGN_OR_RETURN(box.offsets, DecodeSize(*offsets, cw + " offsets"));
    SP_ASSIGN_OR_RETURN(box.sizes, DecodeSize(*sizes, cw + " sizes"));
    e.chunks.push_back(std::move(box));
  }
  return e;
}

Result<DcpStorageEntry> Decoder::DecodeStorage(const PickleValue& key, const PickleValue& value) const {
  DcpStorageEntry s;
  SP_RETURN_IF_ERROR(ExpectClass(key, kMetadataModule, "MetadataIndex", "storage_data key"));
  SP_ASSIGN_OR_RETURN(const PickleValue* fqn, Required(key, "fqn", "storage_data key"));
  if (!fqn->is(Kind::kString)) return Err("storage_data key", "fqn is " + DescribePickleValue(*fqn));
  s.fqn = fqn->text;
  std::string where = "storage entry of key '" + s.fqn + "'";
  const PickleValue* offset = FindAttribute(key, "offset");
  if (offset != nullptr && !offset->is(Kind::kNone)) {
    SP_ASSIGN_OR_RETURN(s.chunk_offsets, DecodeSize(*offset, where + " offset"));
  }
  const PickleValue* index = FindAttribute(key, "index");
  if (index != nullptr && !index->is(Kind::kNone)) {
    if (!index->is(Kind::kInt) || index->int_value < 0) return Err(where, "index is " + DescribePickleValue(*index));
    s.index = index->int_value;
  }
  SP_RETURN_IF_ERROR(ExpectClass(value, "torch.distributed.checkpoint.filesystem", "_StorageInfo", where));
  SP_ASSIGN_OR_RETURN(const PickleValue* rel, Required(value, "relative_path", where));
  SP_ASSIGN_OR_RETURN(const PickleValue* off, Required(value, "offset", where));
  SP_ASSIGN_OR_RETURN(const PickleValue* len, Required(value, "length", where));
  if (!rel->is(Kind::kString) || !off->is(Kind::kInt) || !len->is(Kind::kInt) ||
      off->int_value < 0 || len->int_value < 0) {
    return Err(where, "needs a str relative_path and int offset and length >= 0");
  }
  s.relative_path = rel->text;
  s.offset = static_cast<uint64_t>(off->int_value);
  s.length = static_cast<uint64_t>(len->int_value);
  const PickleValue* td = FindAttribute(value, "transform_descriptors");
  if (td != nullptr && !td->is(Kind::kNone)) {
    if (!td->is(Kind::kList) && !td->is(Kind::kTuple)) return Err(where, "transform_descriptors is " + DescribePickleValue(*td));
    for (const PickleValue* d : td->items) {
      if (!d->is(Kind::kString)) return Err(where, "transform descriptor is " + DescribePickleValue(*d));
      s.transform_descriptors.push_back(d->text);
    }
  }
  return s;
}

// pathlib.PosixPath(*parts) / WindowsPath(*parts) -> the joined path; a str as it is.
Result<std::string> Decoder::DecodePath(const PickleValue& v, std::string_view where) const {
  if (v.is(Kind::kString)) return v.text;
  bool posix = IsObjectOf(v, "pathlib", "PosixPath") || IsObjectOf(v, "pathlib._local", "PosixPath") ||
               IsObjectOf(v, "pathlib", "PurePosixPath") || IsObjectOf(v, "pathlib._local", "PurePosixPath");
  bool windows = IsObjectOf(v, "pathlib", "WindowsPath") || IsObjectOf(v, "pathlib._local", "WindowsPath") ||
                 IsObjectOf(v, "pathlib", "PureWindowsPath") || IsObjectOf(v, "pathlib._local", "PureWindowsPath");
  if (!posix && !windows) return Err(where, "checkpoint_id is " + DescribePickleValue(v));
  char sep = posix ? '/' : '\\';
  std::string out;
  for (const PickleValue* part : v.args->items) {
    if (!part->is(Kind::kString)) return Err(where, "path part is " + DescribePickleValue(*part));
    if (!out.empty() && out.back() != sep) out.push_back(sep);
    out += part->text;
  }
  return out.empty() ? std::string(".") : out;
}

Result<DcpStorageMeta> Decoder::DecodeStorageMeta(const PickleValue& v) const {
  constexpr char kWhere[] = "storage_meta";
  SP_RETURN_IF_ERROR(ExpectClass(v, kMetadataModule, "StorageMeta", kWhere));
  DcpStorageMeta m;
  const PickleValue* id = FindAttribute(v, "checkpoint_id");
  if (id != nullptr && !id->is(Kind::kNone)) {
    SP_ASSIGN_OR_RETURN(m.checkpoint_id, DecodePath(*id, kWhere));
  }
  SP_ASSIGN_OR_RETURN(m.save_id, OptionalString(FindAttribute(v, "save_id"), kWhere));
  SP_ASSIGN_OR_RETURN(m.load_id, OptionalString(FindAttribute(v, "load_id"), kWhere));
  const PickleValue* modules = FindAttribute(v, "modules");
  if (modules != nullptr && !modules->is(Kind::kNone)) {
    if (!modules->is(Kind::kList)) return Err(kWhere, "modules is " + DescribePickleValue(*modules));
    for (const PickleValue* mod : modules->items) {
      if (!mod->is(Kind::kString)) return Err(kWhere, "module is " + DescribePickleValue(*mod));
      m.modules.push_back(mod->text);
    }
  }
  return m;
}

// Metadata.all_local_plans (megatron-core writes every rank's SavePlan there; torch's planners
// may read it back to reuse plans). Nothing here needs it, so it is only checked to be a list
// of SavePlan objects whose `items` are WriteItem objects; mcore_data, which older megatron-core
// versions attach, must be plain data. Both are otherwise ignored.
Status Decoder::CheckLocalPlans(const PickleValue& root) const {
  constexpr char kPlanner[] = "torch.distributed.checkpoint.planner";
  const PickleValue* plans = FindAttribute(root, "all_local_plans");
  if (plans != nullptr && !plans->is(Kind::kNone)) {
    if (!plans->is(Kind::kList)) return Err("all_local_plans", "is " + DescribePickleValue(*plans));
    for (size_t i = 0; i < plans->items.size(); ++i) {
      const std::string where = "all_local_plans[" + std::to_string(i) + "]";
      SP_RETURN_IF_ERROR(ExpectClass(*plans->items[i], kPlanner, "SavePlan", where));
      const PickleValue* items = FindAttribute(*plans->items[i], "items");
      if (items == nullptr) continue;
      if (!items->is(Kind::kList)) return Err(where, "items is " + DescribePickleValue(*items));
      for (const PickleValue* item : items->items) {
        SP_RETURN_IF_ERROR(ExpectClass(*item, kPlanner, "WriteItem", where + " item"));
      }
    }
  }
  const PickleValue* mcore = FindAttribute(root, "mcore_data");
  if (mcore != nullptr && !mcore->is(Kind::kNone)) {
    const std::string what = "DCP metadata " + std::string(path_) + ": mcore_data";
    SP_RETURN_IF_ERROR(ToPlainValue(*mcore, what, max_plain_values_).status());
  }
  return OkStatus();
}

Result<DcpMetadata> Decoder::Decode(const PickleValue& root) {
  DcpMetadata md;
  SP_RETURN_IF_ERROR(ExpectClass(root, kMetadataModule, "Metadata", "root"));
  SP_ASSIGN_OR_RETURN(const PickleValue* sdm, Required(root, "state_dict_metadata", "Metadata"));
  if (!sdm->is(Kind::kDict)) return Err("state_dict_metadata", "is " + DescribePickleValue(*sdm));
  for (size_t i = 0; i < sdm->pair_count(); ++i) {
    if (!sdm->key(i).is(Kind::kString)) return Err("state_dict_metadata", "key is " + DescribePickleValue(sdm->key(i)));
    SP_ASSIGN_OR_RETURN(DcpEntry e, DecodeEntry(sdm->key(i).text, sdm->value(i)));
    md.state_dict_metadata.push_back(std::move(e));
  }
  const PickleValue* planner = FindAttribute(root, "planner_data");
  if (planner != nullptr && !planner->is(Kind::kNone)) {
    std::string what = "DCP metadata " + std::string(path_) + ": planner_data";
    SP_ASSIGN_OR_RETURN(md.planner_data, ToPlainValue(*planner, what, max_plain_values_));
  }
  SP_ASSIGN_OR_RETURN(const PickleValue* storage, Required(root, "storage_data", "Metadata"));
  if (!storage->is(Kind::kDict)) return Err("storage_data", "is " + DescribePickleValue(*storage));
  for (size_t i = 0; i < storage->pair_count(); ++i) {
    SP_ASSIGN_OR_RETURN(DcpStorageEntry s, DecodeStorage(storage->key(i), storage->value(i)));
    md.storage_data.push_back(std::move(s));
  }
  const PickleValue* meta = FindAttribute(root, "storage_meta");
  if (meta != nullptr && !meta->is(Kind::kNone)) {
    SP_ASSIGN_OR_RETURN(md.storage_meta, DecodeStorageMeta(*meta));
  }
  SP_ASSIGN_OR_RETURN(md.version, OptionalString(FindAttribute(root, "version"), "version"));
  SP_RETURN_IF_ERROR(CheckLocalPlans(root));
  SP_RETURN_IF_ERROR(ValidateDcpMetadata(md, path_, StatusCode::kDataLoss));
  return md;
}

}  // namespace

const DcpEntry* DcpMetadata::Find(std::string_view fqn) const {
  for (const DcpEntry& e : state_dict_metadata) {
    if (e.fqn == fqn) return &e;
  }
  return nullptr;
}

const DcpStorageEntry* DcpMetadata::FindStorage(std::string_view fqn,
                                                const std::vector<int64_t>* offsets) const {
  for (const DcpStorageEntry& s : storage_data) {
    if (s.fqn != fqn || s.chunk_offsets.has_value() != (offsets != nullptr)) continue;
    if (offsets == nullptr || *s.chunk_offsets == *offsets) return &s;
  }
  return nullptr;
}

Result<DcpMetadata> DecodeDcpMetadata(ByteView bytes, std::string_view path) {
  if (bytes.size() > kMaxDcpMetadataBytes) {
    return DataLossError("DCP metadata " + std::string(path) + ": " + std::to_string(bytes.size()) +
                         " bytes is larger than the limit");
  }
  UnpickleOptions options;
  options.what = path;
  options.allowed_globals = DcpMetadataGlobals();
  options.allowlist_name = "DCP metadata";
  SP_ASSIGN_OR_RETURN(PickleTree tree, Unpickle(bytes, options));
  Decoder decoder(path, bytes.size());
  return decoder.Decode(tree.root());
}

}  // namespace sp::torch_dcp
