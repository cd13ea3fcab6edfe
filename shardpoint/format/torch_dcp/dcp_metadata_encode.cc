// Validating and encoding `.metadata`, and the default planner's planner_data.
#include <map>
#include <set>
#include <unordered_map>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_save/pickle_util.h"
#include "shardpoint/format/torch_save/pickle_writer.h"

namespace sp::torch_dcp {

using torch_save::IsPythonUtf8;
using torch_save::PickleWriter;
using torch_save::PlainValue;
using torch_save::PlainValueToString;

using torch_save::WritePlainValue;

namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata";
constexpr uint64_t kMaxItemBytes = uint64_t{1} << 62;

class Validator {
 public:
  Validator(const DcpMetadata& md, std::string_view path, StatusCode code)
      : md_(md), path_(path), code_(code) {}
  Status Run();

 private:
  Status Err(const std::string& fqn, const std::string& problem) const {
    return Status(code_, "DCP metadata " + std::string(path_) + ": key '" + fqn + "': " + problem);
  }
  Status CheckEntry(const DcpEntry& e);
  Status CheckStorage(const DcpStorageEntry& s);

  const DcpMetadata& md_;
  std::string_view path_;
  StatusCode code_;
  std::unordered_map<std::string_view, const DcpEntry*> by_fqn_;
  std::set<std::pair<std::string_view, std::vector<int64_t>>> chunks_;  // bytes: empty offsets
  std::set<std::pair<std::string_view, std::vector<int64_t>>> stored_;
};

Status Validator::CheckEntry(const DcpEntry& e) {
  if (!IsPythonUtf8(e.fqn)) return Err(e.fqn, "key is not valid UTF-8");
  if (!by_fqn_.emplace(e.fqn, &e).second) return Err(e.fqn, "key appears twice");
  if (e.kind == DcpEntry::Kind::kBytes) {
    chunks_.insert({e.fqn, {}});
    return OkStatus();
  }
  if (e.size.size() > 64) return Err(e.fqn, "more than 64 dimensions");
  for (int64_t d : e.size) {
    if (d < 0) return Err(e.fqn, "negative size in " + ShapeToString(e.size));
  }
  for (const Box& c : e.chunks) {
    if (c.offsets.size() != e.size.size() || c.sizes.size() != e.size.size()) {
      return Err(e.fqn, "chunk " + c.ToString() + " has another rank than size " + ShapeToString(e.size));
    }
    for (size_t d = 0; d < e.size.size(); ++d) {
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > e.size[d] ||
          c.sizes[d] > e.size[d] - c.offsets[d]) {
        return Err(e.fqn, "chunk " + c.ToString() + " is not inside size " + ShapeToString(e.size));
      }
    }
    if (!chunks_.insert({e.fqn, Shape(c.offsets)}).second) {
      return Err(e.fqn, "two chunks at offsets " + ShapeToString(c.offsets));
    }
  }
  return OkStatus();
}

bool SafeRelativePath(std::string_view p) {
  if (p.empty() || p.size() > 4096 || p[0] == '/' || p[0] == '\\' ||
      (p.size() > 1 && p[1] == ':') || p.find('\0') != std::string_view::npos || !IsPythonUtf8(p)) {
    return false;
  }
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find_first_of("/\\", start);
    if (end == std::string_view::npos) end = p.size();
    if (p.substr(start, end - start) == "..") return false;
    start = end + 1;
  }
  return true;
}

Status Validator::CheckStorage(const DcpStorageEntry& s) {
  auto it = by_fqn_.find(s.fqn);
  if (it == by_fqn_.end()) return Err(s.fqn, "storage entry for a key that is not in state_dict_metadata");
  bool tensor = it->second->kind == DcpEntry::Kind::kTensor;
  if (tensor != s.chunk_offsets.has_value()) {
    return Err(s.fqn, tensor ? "storage entry of a tensor without chunk offsets"
                             : "storage entry of a bytes entry with chunk offsets");
  }
  std::vector<int64_t> offsets = s.chunk_offsets.value_or(std::vector<int64_t>());
  if (tensor && !chunks_.contains({s.fqn, offsets})) {
    return Err(s.fqn, "storage entry for chunk offsets " + ShapeToString(offsets) + " that no chunk has");
  }
  if (!stored_.insert({s.fqn, offsets}).second) {
    return Err(s.fqn, "two storage entries for chunk offsets " + ShapeToString(offsets));
  }
  if (!SafeRelativePath(s.relative_path)) {
    return Err(s.fqn, "unsafe relative_path '" + s.relative_path + "'");
  }
  if (s.length > kMaxItemBytes || s.offset > kMaxItemBytes) {
    return Err(s.fqn, "item offset " + std::to_string(s.offset) + " / length " +
                          std::to_string(s.length) + " out of range");
  }
  if (s.index.has_value() && *s.index < 0) return Err(s.fqn, "negative chunk index");
  for (const std::string& d : s.transform_descriptors) {
    if (d.empty() || !IsPythonUtf8(d)) return Err(s.fqn, "empty or invalid transform descriptor");
  }
  return OkStatus();
}

Status Validator::Run() {
  for (const DcpEntry& e : md_.state_dict_metadata) SP_RETURN_IF_ERROR(CheckEntry(e));
  for (const DcpStorageEntry& s : md_.storage_data) SP_RETURN_IF_ERROR(CheckStorage(s));
  for (const auto& [fqn, offsets] : chunks_) {
    if (!stored_.contains({fqn, offsets})) {
      return Err(std::string(fqn), by_fqn_[fqn]->kind == DcpEntry::Kind::kBytes
                                       ? "no storage entry"
                                       : "no storage entry for the chunk at offsets " + ShapeToString(offsets));
    }
  }
  return OkStatus();
}

// Pushes torch.Size((d0, ...)).
void WriteSize(PickleWriter& w, std::span<const int64_t> dims) {
  w.Global("torch", "Size");
  if (PickleWriter::TupleNeedsMark(dims.size())) w.Mark();
  for (int64_t d : dims) w.Int(d);
  w.Tuple(dims.size());
  w.Tuple(1);
  w.Reduce();
}

// Pushes cls.__new__(cls) and opens its state dict; `fields` writes the key/value pairs.
void WriteDataclass(PickleWriter& w, std::string_view module, std::string_view cls, size_t n,
                    const std::function<void(size_t)>& fields) {
  w.Global(module, cls);
  w.Tuple(0);
  w.NewObj();
  w.EmptyDict();
  w.DictItems(n, fields);
  w.Build();
}

void WriteOptionalString(PickleWriter& w, const std::optional<std::string>& s) {
  if (s.has_value()) {
    w.String(*s);
  } else {
    w.None();
  }
}

void WriteProperties(PickleWriter& w, const DcpTensorProperties& p) {
  w.Global(kMetadataModule, "TensorProperties");
  w.Tuple(0);
  w.NewObj();
  w.Mark();
  w.Global("torch", DTypeName(p.dtype));
  w.Global("torch", "strided");
  w.Bool(p.requires_grad);
  w.Global(kMetadataModule, "_MEM_FORMAT_ENCODING");
  w.Int(static_cast<int64_t>(p.memory_format));
  w.Tuple(1);
  w.Reduce();
  w.Bool(p.pin_memory);
  w.Tuple(5);
  w.Build();
}

void WriteEntry(PickleWriter& w, const DcpEntry& e) {
  if (e.kind == DcpEntry::Kind::kBytes) {
    w.Global(kMetadataModule, "BytesStorageMetadata");
    w.Tuple(0);
    w.NewObj();
    return;
  }
  WriteDataclass(w, kMetadataModule, "TensorStorageMetadata", 3, [&](size_t i) {
    if (i == 0) {
      w.String("properties");
      WriteProperties(w, e.properties);
    } else if (i == 1) {
      w.String("size");
      WriteSize(w, e.size);
    } else {
      w.String("chunks");
      w.EmptyList();
      if (e.chunks.empty()) return;
      w.ListItems(e.chunks.size(), [&](size_t c) {
        WriteDataclass(w, kMetadataModule, "ChunkStorageMetadata", 2, [&](size_t f) {
          w.String(f == 0 ? "offsets" : "sizes");
          WriteSize(w, f == 0 ? e.chunks[c].offsets : e.chunks[c].sizes);
        });
      });
    }
  });
}

void WriteStorageEntry(PickleWriter& w, const DcpStorageEntry& s) {
  size_t key_fields = s.chunk_offsets.has_value() ? 3 : 2;
  WriteDataclass(w, kMetadataModule, "MetadataIndex", key_fields, [&](size_t i) {
    static constexpr std::string_view kNames[] = {"fqn", "index", "offset"};
    w.String(kNames[i]);
    if (i == 0) w.String(s.fqn);
    if (i == 1) s.index.has_value() ? w.Int(*s.index) : w.None();
    if (i == 2) WriteSize(w, *s.chunk_offsets);
  });
  size_t info_fields = s.transform_descriptors.empty() ? 3 : 4;
  WriteDataclass(w, "torch.distributed.checkpoint.filesystem", "_StorageInfo", info_fields, [&](size_t i) {
    static constexpr std::string_view kNames[] = {"relative_path", "offset", "length", "transform_descriptors"};
    w.String(kNames[i]);
    if (i == 0) w.String(s.relative_path);
    if (i == 1) w.Int(static_cast<int64_t>(s.offset));
    if (i == 2) w.Int(static_cast<int64_t>(s.length));
    if (i == 3) {
      w.EmptyList();
      w.ListItems(s.transform_descriptors.size(), [&](size_t d) { w.String(s.transform_descriptors[d]); });
    }
  });
}

void WriteStorageMeta(PickleWriter& w, const DcpStorageMeta& m) {
  WriteDataclass(w, kMetadataModule, "StorageMeta", 4, [&](size_t i) {
    static constexpr std::string_view kNames[] = {"checkpoint_id", "save_id", "load_id", "modules"};
    w.String(kNames[i]);
    if (i == 0) WriteOptionalString(w, m.checkpoint_id);
    if (i == 1) WriteOptionalString(w, m.save_id);
    if (i == 2) WriteOptionalString(w, m.load_id);
    if (i == 3) {
      w.EmptyList();
      if (!m.modules.empty()) w.ListItems(m.modules.size(), [&](size_t k) { w.String(m.modules[k]); });
    }
  });
}

}  // namespace

Status ValidateDcpMetadata(const DcpMetadata& metadata, std::string_view path, StatusCode code) {
  Validator validator(metadata, path, code);
  return validator.Run();
}

Result<std::string> EncodeDcpMetadata(const DcpMetadata& md) {
  SP_RETURN_IF_ERROR(ValidateDcpMetadata(md, "(being encoded)"));
  PickleWriter w(/*dedupe_strings=*/true);
  Status status;
  WriteDataclass(w, kMetadataModule, "Metadata", 5, [&](size_t i) {
    static constexpr std::string_view kNames[] = {"state_dict_metadata", "planner_data", "storage_data",
                                                  "storage_meta", "version"};
    w.String(kNames[i]);
    if (i == 0) {
      w.EmptyDict();
      w.DictItems(md.state_dict_metadata.size(), [&](size_t k) {
        w.String(md.state_dict_metadata[k].fqn);
        WriteEntry(w, md.state_dict_metadata[k]);
      });
    } else if (i == 1) {
      if (md.planner_data.has_value()) {
        status = WritePlainValue(w, *md.planner_data);
      } else {
        w.None();
      }
    } else if (i == 2) {
      w.EmptyDict();
      w.DictItems(md.storage_data.size(), [&](size_t k) { WriteStorageEntry(w, md.storage_data[k]); });
    } else if (i == 3) {
      md.storage_meta.has_value() ? WriteStorageMeta(w, *md.storage_meta) : w.None();
    } else {
      WriteOptionalString(w, md.version);
    }
  });
  SP_RETURN_IF_ERROR(status);
  return w.Finish();
}

PlainValue MakeDcpPlannerData(const std::vector<DcpPlannerPath>& paths) {
  std::vector<std::pair<PlainValue, PlainValue>> pairs;
  for (const DcpPlannerPath& p : paths) {
    std::vector<PlainValue> parts;
    for (const auto& part : p.path) {
      parts.push_back(std::holds_alternative<std::string>(part)
                          ? PlainValue::String(std::get<std::string>(part))
                          : PlainValue::Int(std::get<int64_t>(part)));
    }
    pairs.emplace_back(PlainValue::String(p.fqn), PlainValue::Tuple(std::move(parts)));
  }
  return PlainValue::Dict(std::move(pairs));
}

Result<std::vector<DcpPlannerPath>> ParseDcpPlannerData(const PlainValue& planner_data) {
  using K = PlainValue::Kind;
  if (!planner_data.is(K::kDict)) return DataLossError("planner_data is not a dict");
  std::vector<DcpPlannerPath> out;
  for (size_t i = 0; i < planner_data.pair_count(); ++i) {
    const PlainValue& key = planner_data.key(i);
    const PlainValue& value = planner_data.value(i);
    if (!key.is(K::kString) || !value.is(K::kTuple)) {
      return DataLossError("planner_data entry " + PlainValueToString(key) + " is not str -> tuple");
    }
    DcpPlannerPath p{key.text, {}};
    for (const PlainValue& part : value.items) {
      if (part.is(K::kString)) {
        p.path.emplace_back(part.text);
      } else if (part.is(K::kInt)) {
        p.path.emplace_back(part.int_value);
      } else {
        return DataLossError("planner_data path of '" + key.text + "' holds " + PlainValueToString(part));
      }
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace sp::torch_dcp
