#include "shardpoint/format/torch_dcp/megatron_emit.h"

#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::BuildZip;
using torch_save::DescribePickleValue;
using torch_save::MemoryRangeReader;
using torch_save::PickleValue;
using torch_save::PickleWriter;
using torch_save::RangeReader;
using torch_save::ReadZipDirectory;
using torch_save::ReadZipEntry;
using torch_save::Unpickle;
using torch_save::UnpickleOptions;
using torch_save::ZipEntry;
using torch_save::kMaxDataPklBytes;

using torch_save::kMaxPickleWalkDepth;

using Kind = PickleValue::Kind;

namespace {

// torch.save names storage records data/<key> with decimal keys; anything beyond letters,
// digits and '_' (a '/', "..") is refused so that no record name can be steered.
bool SafeStorageKey(std::string_view key) {
  if (key.empty() || key.size() > 64) return false;
  for (char c : key) {
    const bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    c == '_';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

Result<SourceArchive> OpenSourceArchive(ByteView bytes, std::string_view what) {
  SourceArchive a;
  a.bytes = bytes;
  const RangeReader read = MemoryRangeReader(bytes);
  SP_ASSIGN_OR_RETURN(a.dir, ReadZipDirectory(read, bytes.size(), what));
  auto bad = [&](const std::string& problem) {
    return DataLossError("torch.save archive " + std::string(what) + ": " + problem);
  };
  if (a.dir.entries.empty()) return bad("the archive has no entries");
  const size_t slash = a.dir.entries[0].name.find('/');
  if (slash == std::string::npos) return bad("first entry is not inside a folder");
  a.prefix = a.dir.entries[0].name.substr(0, slash + 1);
  if (const ZipEntry* order = a.dir.Find(a.prefix + "byteorder")) {
    SP_ASSIGN_OR_RETURN(std::string text, ReadZipEntry(read, a.dir, *order, what, 64));
    if (text == "big") {
      return UnimplementedError("torch.save archive " + std::string(what) +
                                " was written on a big-endian machine; not supported");
    }
    if (text != "little") return bad("unknown byteorder '" + text + "'");
  }
  const ZipEntry* pkl = a.dir.Find(a.prefix + "data.pkl");
  if (pkl == nullptr) return bad("no '" + a.prefix + "data.pkl' record");
  SP_ASSIGN_OR_RETURN(std::string pickle, ReadZipEntry(read, a.dir, *pkl, what, kMaxDataPklBytes));
  const std::string pickle_what = std::string(what) + " data.pkl";
  UnpickleOptions options;
  options.what = pickle_what;
  options.allow_any_global = true;
  options.allow_persistent_id = true;
  SP_ASSIGN_OR_RETURN(a.pickle, Unpickle(AsBytes(pickle), options));
  return a;
}

Status ArchiveEmitter::Err(const std::string& problem) const {
  return DataLossError("torch.save archive " + what_ + ": " + problem);
}

Status ArchiveEmitter::Emit(const PickleValue& v, const SourceArchive& source, int depth) {
  keys_.clear();
  return EmitAt(v, source, depth);
}

Status ArchiveEmitter::Count(int depth) {
  if (depth > kMaxPickleWalkDepth) {
    return Err("values nested deeper than " + std::to_string(kMaxPickleWalkDepth));
  }
  if (++values_ > kMaxReemittedValues) {
    return Err("more than " + std::to_string(kMaxReemittedValues) + " values to write");
  }
  return OkStatus();
}

Status ArchiveEmitter::EmitItems(const std::vector<const PickleValue*>& items,
                                 const SourceArchive& source, int depth) {
  for (const PickleValue* item : items) SP_RETURN_IF_ERROR(EmitAt(*item, source, depth + 1));
  return OkStatus();
}

Status ArchiveEmitter::EmitAt(const PickleValue& v, const SourceArchive& source, int depth) {
  SP_RETURN_IF_ERROR(Count(depth));
  PickleWriter& w = writer_;
  switch (v.kind) {
    case Kind::kNone: w.None(); return OkStatus();
    case Kind::kBool: w.Bool(v.bool_value); return OkStatus();
    case Kind::kInt: w.Int(v.int_value); return OkStatus();
    case Kind::kFloat: w.Float(v.float_value); return OkStatus();
    case Kind::kString: w.String(v.text); return OkStatus();
    case Kind::kBytes: w.Bytes(v.text); return OkStatus();
    case Kind::kGlobal: w.Global(v.text, v.name); return OkStatus();
    case Kind::kTuple:
      if (PickleWriter::TupleNeedsMark(v.items.size())) w.Mark();
      SP_RETURN_IF_ERROR(EmitItems(v.items, source, depth));
      w.Tuple(v.items.size());
      return OkStatus();
    case Kind::kList:
    case Kind::kSet: {
      if (v.is(Kind::kSet)) w.Global("builtins", "set");
      w.EmptyList();
      Status status;
      w.ListItems(v.items.size(), [&](size_t i) {
        if (status.ok()) status = EmitAt(*v.items[i], source, depth + 1);
      });
      SP_RETURN_IF_ERROR(status);
      if (v.is(Kind::kSet)) {
        w.Tuple(1);
        w.Reduce();
      }
      return OkStatus();
    }
    case Kind::kDict: {
      w.EmptyDict();
      Status status;
      w.DictItems(v.pair_count(), [&](size_t i) {
        if (status.ok()) status = EmitAt(v.key(i), source, depth + 1);
        if (status.ok()) status = EmitAt(v.value(i), source, depth + 1);
      });
      return status;
    }
    case Kind::kObject: return EmitObject(v, source, depth);
    case Kind::kPersistentId: return EmitStorage(*v.args, source, depth);
  }
  return Err("unknown value kind");
}

// callable(*args) / cls.__new__(cls, *args [, **kwargs]), then SETITEMS pairs and BUILD state.
Status ArchiveEmitter::EmitObject(const PickleValue& v, const SourceArchive& source, int depth) {
  PickleWriter& w = writer_;
  if (v.kwargs != nullptr) {
    // Protocol 2 has no NEWOBJ_EX: copyreg.__newobj_ex__(cls, args, kwargs) does the same.
    w.Global("copyreg", "__newobj_ex__");
    w.Global(v.callable->text, v.callable->name);
    SP_RETURN_IF_ERROR(EmitAt(*v.args, source, depth + 1));
    SP_RETURN_IF_ERROR(EmitAt(*v.kwargs, source, depth + 1));
    w.Tuple(3);
    w.Reduce();
  } else {
    w.Global(v.callable->text, v.callable->name);
    SP_RETURN_IF_ERROR(EmitAt(*v.args, source, depth + 1));
    if (v.construction == PickleValue::Construction::kNewObj) {
      w.NewObj();
    } else {
      w.Reduce();
    }
  }
  Status status;
  if (!v.items.empty()) {
    w.DictItems(v.pair_count(), [&](size_t i) {
      if (status.ok()) status = EmitAt(v.key(i), source, depth + 1);
      if (status.ok()) status = EmitAt(v.value(i), source, depth + 1);
    });
    SP_RETURN_IF_ERROR(status);
  }
  if (v.state != nullptr) {
    SP_RETURN_IF_ERROR(EmitAt(*v.state, source, depth + 1));
    w.Build();
  }
  return OkStatus();
}

// ('storage', cls, key, location, numel): the record data/<key> is copied under a new key.
Status ArchiveEmitter::EmitStorage(const PickleValue& id, const SourceArchive& source, int depth) {
  if (!id.is(Kind::kTuple) || id.items.size() != 5 || !id.items[0]->is(Kind::kString) ||
      id.items[0]->text != "storage" || !id.items[2]->is(Kind::kString)) {
    return Err("persistent id is " + DescribePickleValue(id) + ", expected a storage id");
  }
  const std::string& key = id.items[2]->text;
  if (!SafeStorageKey(key)) {
    return Err("storage key '" + key.substr(0, 80) + "' is not a plain name");
  }
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    const ZipEntry* record = source.dir.Find(source.prefix + "data/" + key);
    if (record == nullptr) {
      return Err("no record '" + source.prefix + "data/" + key + "' for a storage");
    }
    SP_ASSIGN_OR_RETURN(std::string bytes, ReadZipEntry(MemoryRangeReader(source.bytes), source.dir,
                                                        *record, what_, source.bytes.size()));
    it = keys_.emplace(key, std::to_string(storages_.size())).first;
    storages_.emplace_back(it->second, std::move(bytes));
  }
  PickleWriter& w = writer_;
  w.Mark();
  w.String("storage");
  SP_RETURN_IF_ERROR(EmitAt(*id.items[1], source, depth + 1));
  w.String(it->second);
  SP_RETURN_IF_ERROR(EmitAt(*id.items[3], source, depth + 1));
  SP_RETURN_IF_ERROR(EmitAt(*id.items[4], source, depth + 1));
  w.Tuple(5);
  w.BinPersId();
  return OkStatus();
}

Result<std::string> ArchiveEmitter::Finish(std::string_view folder) {
  const std::string f(folder);
  std::vector<std::pair<std::string, std::string>> records = {
      {f + "data.pkl", writer_.Finish()},
      {f + ".format_version", "1"},
      {f + ".storage_alignment", "64"},
      {f + "byteorder", "little"}};
  for (auto& [key, bytes] : storages_) records.emplace_back(f + "data/" + key, std::move(bytes));
  records.emplace_back(f + "version", "3\n");
  return BuildZip(records);
}

}  // namespace sp::torch_dcp
