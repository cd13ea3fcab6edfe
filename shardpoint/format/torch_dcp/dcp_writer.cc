#include "shardpoint/format/torch_dcp/dcp_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <map>

#include "shardpoint/base/json.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp::torch_dcp {

using torch_save::BuildZip;
using torch_save::DecodePlainPickle;
using torch_save::EncodePlainObjectItem;
using torch_save::PlainValue;
using torch_save::TorchSaveLayout;

namespace {

// Python ints beyond 64 bits: refused rather than rounded to a float.
Status IntegerTooLarge(const std::string& text, std::string_view what) {
  return InvalidArgumentError(std::string(what) + ": integer " + text +
                              " does not fit in 64 bits (PyTorch DCP objects written by shardpoint "
                              "hold 64-bit integers only)");
}

Result<PlainValue> JsonToPlain(const JsonValue& v, std::string_view what) {
  switch (v.kind) {
    case JsonValue::Kind::kString:
      return PlainValue::String(v.string);
    case JsonValue::Kind::kNumber:
      if (v.number > static_cast<uint64_t>(INT64_MAX)) {
        return IntegerTooLarge(std::to_string(v.number), what);
      }
      return PlainValue::Int(static_cast<int64_t>(v.number));
    case JsonValue::Kind::kArray: {
      std::vector<PlainValue> items;
      for (const JsonValue& item : v.items) {
        SP_ASSIGN_OR_RETURN(PlainValue p, JsonToPlain(item, what));
        items.push_back(std::move(p));
      }
      return PlainValue::List(std::move(items));
    }
    case JsonValue::Kind::kObject: {
      std::vector<std::pair<PlainValue, PlainValue>> pairs;
      for (size_t i = 0; i < v.keys.size(); ++i) {
        SP_ASSIGN_OR_RETURN(PlainValue p, JsonToPlain(v.values[i], what));
        pairs.emplace_back(PlainValue::String(v.keys[i]), std::move(p));
      }
      return PlainValue::Dict(std::move(pairs));
    }
    case JsonValue::Kind::kOther:
      break;
  }
  if (v.string == "true" || v.string == "false") return PlainValue::Bool(v.string == "true");
  if (v.string == "null") return PlainValue::None();
  if (v.string == "NaN") return PlainValue::Float(std::numeric_limits<double>::quiet_NaN());
  if (v.string == "Infinity") return PlainValue::Float(std::numeric_limits<double>::infinity());
  if (v.string == "-Infinity") return PlainValue::Float(-std::numeric_limits<double>::infinity());
  const bool fractional = v.string.find_first_of(".eE") != std::string::npos;
  char* end = nullptr;
  if (!fractional) {
    errno = 0;
    long long n = std::strtoll(v.string.c_str(), &end, 10);
    if (errno == 0 && *end == '\0') return PlainValue::Int(n);
    if (errno == ERANGE && *end == '\0') return IntegerTooLarge(v.string, what);
  }
  double d = std::strtod(v.string.c_str(), &end);
  if (*end != '\0') {
    return InvalidArgumentError(std::string(what) + ": cannot store JSON value " + v.string);
  }
  return PlainValue::Float(d);
}

Result<std::string> ObjectItem(const ObjectEntry& o) {
  const std::string what = "object '" + o.name + "'";
  switch (o.encoding) {
    case ObjectEncoding::kJson: {
      SP_ASSIGN_OR_RETURN(JsonValue json, ParseJson(o.payload, what, JsonSyntax::kFull));
      SP_ASSIGN_OR_RETURN(PlainValue value, JsonToPlain(json, what));
      return EncodePlainObjectItem(value);
    }
    case ObjectEncoding::kBytes:
      return EncodePlainObjectItem(PlainValue::Bytes(o.payload));
    case ObjectEncoding::kPlain: {
      SP_ASSIGN_OR_RETURN(PlainValue value, DecodePlainPickle(o.payload, what));
      return EncodePlainObjectItem(value);
    }
    case ObjectEncoding::kPickle:  // torch.load unpickles data.pkl with any protocol
      return BuildZip({{"archive/data.pkl", o.payload},
                       {"archive/byteorder", "little"},
                       {"archive/version", "3\n"}});
    case ObjectEncoding::kTorchSave:
      return o.payload;
  }
  return InvalidArgumentError(what + ": unknown encoding");
}

// An empty dict: torch.distributed.checkpoint stores nothing for one (its flattening never
// reaches a leaf there), and an item for it makes torch's dcp.load of the same structure see a
// key its state dict lacks, which sends it down its pre-2.4 key fallback and fails the load.
bool IsEmptyDict(const ObjectEntry& o) {
  if (o.encoding != ObjectEncoding::kJson) return false;
  Result<JsonValue> json = ParseJson(o.payload, o.name, JsonSyntax::kFull);
  return json.ok() && json->is_object() && json->keys.empty();
}

// Each key's nested path, from the paths attribute; keys it lacks are their own path.
Result<std::vector<DcpPlannerPath>> PlannerPaths(const CheckpointMetadata& md,
                                                 bool with_empty_dicts = false) {
  std::map<std::string, DcpPlannerPath> by_key;
  auto attr = md.attributes.find(kStateDictPathsAttribute);
  if (attr != md.attributes.end()) {
    SP_ASSIGN_OR_RETURN(JsonValue json, ParseJson(attr->second, kStateDictPathsAttribute,
                                                  JsonSyntax::kFull));
    for (const JsonValue& pair : json.items) {
      if (!pair.is_array() || pair.items.size() != 2 || !pair.items[0].is_string() ||
          !pair.items[1].is_array()) {
        return InvalidArgumentError(std::string(kStateDictPathsAttribute) + " is not a list of "
                                    "[key, [component, ...]] pairs");
      }
      DcpPlannerPath path{pair.items[0].string, {}};
      for (const JsonValue& c : pair.items[1].items) {
        if (c.is_number()) {  // a list index
          path.path.emplace_back(static_cast<int64_t>(c.number));
        } else if (c.is_object() && c.keys.size() == 1 && c.keys[0] == "int" && c.values[0].is_number()) {
          // A dict's int key ({"int": n}): DCP's own flattening names dict keys by str(key).
          path.path.emplace_back(std::to_string(c.values[0].number));
        } else if (c.is_string()) {
          path.path.emplace_back(c.string);
        } else {
          return InvalidArgumentError(std::string(kStateDictPathsAttribute) + ": key '" +
                                      path.fqn + "' has a path component that is neither a str, "
                                      "a list index nor {\"int\": n}");
        }
      }
      by_key[path.fqn] = std::move(path);
    }
  }
  std::vector<DcpPlannerPath> paths;
  auto add = [&](const std::string& name) {
    auto it = by_key.find(name);
    paths.push_back(it != by_key.end() ? it->second : DcpPlannerPath{name, {name}});
  };
  for (const TensorMetadata& t : md.tensors) add(t.name);
  for (const ObjectEntry& o : md.objects) {
    if (with_empty_dicts || !IsEmptyDict(o)) add(o.name);
  }
  return paths;
}

}  // namespace

Result<TorchSaveLayout> ChunkItemLayout(DType dtype, const Box& box) {
  return TorchSaveLayout::ForTensor(dtype, Shape(box.sizes));
}

Status LayoutDcpFiles(CheckpointMetadata* md, std::string_view name_suffix) {
  struct Ref {
    StoredChunk* chunk;
    DType dtype;
  };
  std::vector<std::vector<Ref>> by_file(md->files.size());
  for (TensorMetadata& t : md->tensors) {
    for (StoredChunk& c : t.chunks) by_file.at(c.file).push_back(Ref{&c, t.dtype});
  }
  std::map<int32_t, int> next_index;  // writer rank -> files named so far
  for (size_t f = 0; f < md->files.size(); ++f) {
    std::vector<Ref>& refs = by_file[f];
    std::sort(refs.begin(), refs.end(),
              [](const Ref& a, const Ref& b) { return a.chunk->data_offset < b.chunk->data_offset; });
    uint64_t end = 0;
    for (const Ref& r : refs) {
      SP_ASSIGN_OR_RETURN(TorchSaveLayout layout, ChunkItemLayout(r.dtype, r.chunk->box));
      r.chunk->data_offset = end + layout.data_offset(0);
      end += layout.total_size();
    }
    DataFile& file = md->files[f];
    file.name = DcpFileName(file.writer_rank, next_index[file.writer_rank]++, name_suffix);
    file.data_start = 0;
    file.size = end;
  }
  return OkStatus();
}

Result<DcpObjectFile> BuildDcpObjectFile(const CheckpointMetadata& md, int rank,
                                         std::string_view name_suffix) {
  int index = 0;
  for (const DataFile& f : md.files) index += f.writer_rank == rank ? 1 : 0;
  DcpObjectFile out;
  out.name = DcpFileName(rank, index, name_suffix);
  for (const ObjectEntry& o : md.objects) {
    if (IsEmptyDict(o)) continue;
    SP_ASSIGN_OR_RETURN(std::string item, ObjectItem(o));
    out.items.push_back(DcpObjectItem{o.name, out.bytes.size(), item.size()});
    out.bytes += item;
  }
  return out;
}

Result<std::string> BuildDcpMetadataFile(const CheckpointMetadata& md, const DcpObjectFile& objects,
                                         std::string_view checkpoint_id) {
  DcpMetadata dcp;
  for (const TensorMetadata& t : md.tensors) {
    DcpEntry entry;
    entry.fqn = t.name;
    entry.properties.dtype = t.dtype;
    entry.size = t.shape;
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      const StoredChunk& chunk = t.chunks[c];
      SP_ASSIGN_OR_RETURN(TorchSaveLayout layout, ChunkItemLayout(t.dtype, chunk.box));
      entry.chunks.push_back(chunk.box);
      dcp.storage_data.push_back(DcpStorageEntry{
          t.name, Shape(chunk.box.offsets), static_cast<int64_t>(c), md.files.at(chunk.file).name,
          chunk.data_offset - layout.data_offset(0), layout.total_size(), {}});
    }
    dcp.state_dict_metadata.push_back(std::move(entry));
  }
  for (const DcpObjectItem& item : objects.items) {
    DcpEntry entry;
    entry.fqn = item.name;
    entry.kind = DcpEntry::Kind::kBytes;
    dcp.state_dict_metadata.push_back(std::move(entry));
    dcp.storage_data.push_back(DcpStorageEntry{item.name, std::nullopt, std::nullopt, objects.name,
                                               item.offset, item.length, {}});
  }
  SP_ASSIGN_OR_RETURN(std::vector<DcpPlannerPath> paths, PlannerPaths(md));
  dcp.planner_data = MakeDcpPlannerData(paths);
  dcp.storage_meta = DcpStorageMeta{std::string(checkpoint_id), md.save_id, std::nullopt, {}};
  dcp.version = kDcpVersion;
  return EncodeDcpMetadata(dcp);
}

Result<std::string> BuildMegatronCommonFile(const CheckpointMetadata& md) {
  std::vector<MegatronObjectArchive> archives;
  for (const ObjectEntry& o : md.objects) {
    SP_ASSIGN_OR_RETURN(std::string item, ObjectItem(o));
    archives.push_back(MegatronObjectArchive{o.name, std::move(item)});
  }
  SP_ASSIGN_OR_RETURN(std::vector<DcpPlannerPath> paths,
                      PlannerPaths(md, /*with_empty_dicts=*/true));
  return EncodeMegatronCommon(archives, paths);
}

}  // namespace sp::torch_dcp
