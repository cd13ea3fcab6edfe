// Writing torch.save archives: the layout, data.pkl and the framing around caller-written data.
#include <set>

#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_save {

namespace {

constexpr char kFolder[] = "archive/";

Result<uint64_t> RowMajorBytes(const TorchSaveTensorSpec& t) {
  if (t.shape.size() > kMaxTensorRank) {
    return InvalidArgumentError("tensor '" + t.name + "' has more than 64 dimensions");
  }
  uint64_t bytes = DTypeSize(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) ||
        bytes > (uint64_t{1} << 62)) {
      return InvalidArgumentError("tensor '" + t.name + "' has a bad shape " + ShapeToString(t.shape));
    }
  }
  return bytes;
}

void WriteIntTuple(PickleWriter& w, const std::vector<int64_t>& values) {
  if (PickleWriter::TupleNeedsMark(values.size())) w.Mark();
  for (int64_t v : values) w.Int(v);
  w.Tuple(values.size());
}

// Pushes `_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())` (or _v3 with the
// dtype) for storage `key`, exactly as torch.save's pickler does.
void WriteTensor(PickleWriter& w, const TorchSaveTensorSpec& t, const std::string& key) {
  std::string_view storage_class = TorchStorageClassName(t.dtype);
  bool v3 = storage_class.empty();
  w.Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  w.Mark();
  w.Mark();  // the persistent id tuple
  w.String("storage");
  if (v3) {
    w.Global("torch.storage", "UntypedStorage");
  } else {
    w.Global("torch", storage_class);
  }
  w.String(key);
  w.String("cpu");
  int64_t numel = ShapeVolume(t.shape);
  w.Int(v3 ? numel * static_cast<int64_t>(DTypeSize(t.dtype)) : numel);
  w.Tuple(5);
  w.BinPersId();
  w.Int(0);  // storage offset
  WriteIntTuple(w, t.shape);
  std::vector<int64_t> strides(t.shape.size());
  int64_t stride = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= t.shape[d];
  }
  WriteIntTuple(w, strides);
  w.Bool(false);  // requires_grad
  w.Global("collections", "OrderedDict");
  w.Tuple(0);
  w.Reduce();  // backward hooks
  if (v3) w.Global("torch", DTypeName(t.dtype));
  w.Tuple(v3 ? 7 : 6);
  w.Reduce();
}

std::vector<std::pair<std::string, std::string>> FixedHeadRecords(std::string pickle) {
  return {{std::string(kFolder) + "data.pkl", std::move(pickle)},
          {std::string(kFolder) + ".format_version", "1"},
          {std::string(kFolder) + ".storage_alignment", "64"},
          {std::string(kFolder) + "byteorder", "little"}};
}

}  // namespace

Result<TorchSaveLayout> TorchSaveLayout::Make(std::string pickle,
                                              const std::vector<TorchSaveTensorSpec>& tensors) {
  TorchSaveLayout layout;
  std::vector<ZipEntrySpec> specs;
  for (auto& [name, content] : FixedHeadRecords(std::move(pickle))) {
    specs.push_back({name, content.size()});
    layout.fixed_.push_back(std::move(content));
  }
  layout.pickle_ = layout.fixed_[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    SP_ASSIGN_OR_RETURN(uint64_t bytes, RowMajorBytes(tensors[i]));
    layout.data_bytes_.push_back(bytes);
    specs.push_back({std::string(kFolder) + "data/" + std::to_string(i), bytes});
    layout.fixed_.emplace_back();  // placeholder: tensor data is the caller's
  }
  specs.push_back({std::string(kFolder) + "version", 2});
  layout.fixed_.push_back("3\n");
  SP_ASSIGN_OR_RETURN(layout.zip_, ZipLayout::Plan(std::move(specs)));
  return layout;
}

Result<TorchSaveLayout> TorchSaveLayout::ForTensor(DType dtype, const Shape& shape) {
  TorchSaveTensorSpec spec{"tensor", dtype, shape};
  SP_RETURN_IF_ERROR(RowMajorBytes(spec).status());
  PickleWriter w(/*dedupe_strings=*/true);
  WriteTensor(w, spec, "0");
  return Make(w.Finish(), {spec});
}

Result<TorchSaveLayout> TorchSaveLayout::ForStateDict(std::vector<TorchSaveTensorSpec> tensors) {
  std::set<std::string_view> names;
  for (const TorchSaveTensorSpec& t : tensors) {
    if (!names.insert(t.name).second) {
      return InvalidArgumentError("state dict key '" + t.name + "' is repeated");
    }
    SP_RETURN_IF_ERROR(RowMajorBytes(t).status());
  }
  PickleWriter w(/*dedupe_strings=*/true);
  w.EmptyDict();
  w.DictItems(tensors.size(), [&](size_t i) {
    w.String(tensors[i].name);
    WriteTensor(w, tensors[i], std::to_string(i));
  });
  return Make(w.Finish(), tensors);
}

void TorchSaveLayout::AppendFixed(std::string* out, size_t entry) const {
  const std::string& content = fixed_[entry];
  out->append(zip_.LocalHeader(entry));
  out->append(content);
  out->append(zip_.DataDescriptor(entry, Crc32(0, content.data(), content.size())));
}

std::string TorchSaveLayout::Head() const {
  std::string out;
  for (size_t e = 0; e < kFixedHead; ++e) AppendFixed(&out, e);
  if (tensor_count() > 0) out.append(zip_.LocalHeader(kFixedHead));
  return out;
}

std::string TorchSaveLayout::Between(size_t i, uint32_t crc32) const {
  return zip_.DataDescriptor(kFixedHead + i, crc32) + zip_.LocalHeader(kFixedHead + i + 1);
}

std::string TorchSaveLayout::Tail(std::span<const uint32_t> crc32s) const {
  std::string out;
  size_t n = tensor_count();
  auto crc = [&](size_t i) { return i < crc32s.size() ? crc32s[i] : 0u; };  // precondition: all given
  if (n > 0) out.append(zip_.DataDescriptor(kFixedHead + n - 1, crc(n - 1)));
  size_t version_entry = kFixedHead + n;
  AppendFixed(&out, version_entry);
  std::vector<uint32_t> all;
  for (size_t e = 0; e < zip_.entry_count(); ++e) {
    bool is_data = e >= kFixedHead && e < version_entry;
    all.push_back(is_data ? crc(e - kFixedHead) : Crc32(0, fixed_[e].data(), fixed_[e].size()));
  }
  out.append(zip_.CentralDirectory(all));
  return out;
}

Result<std::string> EncodePlainObjectItem(const PlainValue& value) {
  SP_ASSIGN_OR_RETURN(std::string pickle, EncodePlainPickle(value));
  std::vector<std::pair<std::string, std::string>> records = FixedHeadRecords(std::move(pickle));
  records.push_back({std::string(kFolder) + "version", "3\n"});
  return BuildZip(records);
}

}  // namespace sp::torch_save
