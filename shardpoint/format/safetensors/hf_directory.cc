#include "shardpoint/format/safetensors/hf_directory.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/base/json.h"
#include "shardpoint/format/safetensors/safetensors.h"

namespace sp {
namespace {

// Most data files one checkpoint may name; each costs a header read.
constexpr size_t kMaxDataFiles = size_t{1} << 20;
// Largest global offset accepted in DCP_SHARDING_INFO (offsets + sizes must stay in int64).
constexpr uint64_t kMaxOffset = uint64_t{1} << 62;

bool IsSafetensorsName(std::string_view name) {
  return name.size() > sizeof(kSafetensorsSuffix) - 1 && name.front() != '.' &&
         name.ends_with(kSafetensorsSuffix);
}

struct Index {
  std::map<std::string, std::string> weight_map;  // tensor -> file name
  std::map<std::string, std::string> attributes;  // "metadata" members, as text
};

// One data file: its name in the metadata, its path, its header and the DCP offsets of its tensors.
struct FileHeader {
  std::string name;
  std::string path;
  SafetensorsHeader header;
  bool sharded = false;                                   // has DCP_SHARDING_INFO
  std::map<std::string, std::vector<int64_t>> offsets;    // fqn -> global offsets
};

Status CheckFileName(std::string_view name, std::string_view index_path) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255 ||
      name.find('/') != std::string_view::npos || name.find('\0') != std::string_view::npos) {
    return DataLossError(std::string(index_path) + ": weight_map names \"" + std::string(name) +
                         "\", which is not a file name in the checkpoint directory");
  }
  return OkStatus();
}

Status ParseIndexMetadata(const JsonValue& v, std::string_view path, Index* index) {
  if (!v.is_object()) return DataLossError(std::string(path) + ": \"metadata\" is not an object");
  for (size_t i = 0; i < v.keys.size(); ++i) {
    const JsonValue& value = v.values[i];
    if (value.is_number()) {
      index->attributes[v.keys[i]] = std::to_string(value.number);
    } else if (value.is_string() || value.kind == JsonValue::Kind::kOther) {
      index->attributes[v.keys[i]] = value.string;
    }
  }
  return OkStatus();
}

Result<Index> ParseIndex(std::string_view text, std::string_view path) {
  SP_ASSIGN_OR_RETURN(JsonValue root, ParseJson(text, path, JsonSyntax::kFull));
  if (!root.is_object()) return DataLossError(std::string(path) + ": not a JSON object");
  Index index;
  const JsonValue* weight_map = nullptr;
  for (size_t i = 0; i < root.keys.size(); ++i) {
    if (root.keys[i] == "weight_map") weight_map = &root.values[i];
    if (root.keys[i] == "metadata") {
      SP_RETURN_IF_ERROR(ParseIndexMetadata(root.values[i], path, &index));
    }
  }
  if (weight_map == nullptr || !weight_map->is_object()) {
    return DataLossError(std::string(path) + ": no \"weight_map\" object");
  }
  for (size_t i = 0; i < weight_map->keys.size(); ++i) {
    const JsonValue& file = weight_map->values[i];
    if (!file.is_string()) {
      return DataLossError(std::string(path) + ": weight_map value of \"" + weight_map->keys[i] +
                           "\" is not a file name");
    }
    SP_RETURN_IF_ERROR(CheckFileName(file.string, path));
    index.weight_map.emplace(weight_map->keys[i], file.string);
  }
  return index;
}

Result<Index> ReadIndex(Store& store, const std::string& path) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, store.OpenInDirectory(ParentPath(path), kSafetensorsIndexFileName));
  if (file->size() > kMaxSafetensorsIndexBytes) {
    return DataLossError(path + ": " + std::to_string(file->size()) +
                         " bytes, more than the limit of " +
                         std::to_string(kMaxSafetensorsIndexBytes) + " for an index file");
  }
  std::string text(file->size(), '\0');
  SP_RETURN_IF_ERROR(file->ReadAt(0, AsMutableBytes(text.data(), text.size())));
  return ParseIndex(text, path);
}

// The data files of a directory: those the index names (each must exist), else every
// *.safetensors file in it.
Result<std::vector<std::string>> DataFileNames(const std::vector<DirEntry>& entries,
                                               const Index* index, std::string_view dir) {
  std::set<std::string> present;
  for (const DirEntry& e : entries) {
    if (!e.is_directory) present.insert(e.name);
  }
  std::vector<std::string> names;
  if (index != nullptr) {
    std::set<std::string> named;
    for (const auto& [tensor, file] : index->weight_map) named.insert(file);
    for (const std::string& file : named) {
      if (!present.count(file)) {
        return DataLossError(JoinPath(dir, kSafetensorsIndexFileName) + " names data file " +
                             file + ", which is missing from " + std::string(dir));
      }
    }
    names.assign(named.begin(), named.end());
  } else {
    for (const std::string& name : present) {
      if (IsSafetensorsName(name)) names.push_back(name);
    }
  }
  if (names.empty()) {
    return NotFoundError("no safetensors checkpoint at " + std::string(dir) +
                         " (no *.safetensors files)");
  }
  if (names.size() > kMaxDataFiles) {
    return DataLossError(std::string(dir) + ": " + std::to_string(names.size()) +
                         " data files, more than the limit of " + std::to_string(kMaxDataFiles));
  }
  return names;
}

// Parses DCP_SHARDING_INFO: {fqn: {"saved_offsets": [o0, o1, ...]}} for tensors of this file.
Status ParseShardingInfo(const std::string& text, FileHeader* file) {
  const std::string what = "safetensors file " + file->path + ": " + kDcpShardingInfoKey;
  SP_ASSIGN_OR_RETURN(JsonValue root, ParseJson(text, what, JsonSyntax::kFull));
  if (!root.is_object()) return DataLossError(what + " is not a JSON object");
  std::map<std::string_view, const SafetensorsEntry*> entries;
  for (const SafetensorsEntry& e : file->header.entries) entries.emplace(e.name, &e);
  for (size_t i = 0; i < root.keys.size(); ++i) {
    const std::string& fqn = root.keys[i];
    const std::string prefix = what + ": tensor '" + fqn + "': ";
    auto entry = entries.find(fqn);
    if (entry == entries.end()) return DataLossError(prefix + "not stored in the file");
    const JsonValue* offsets = nullptr;
    const JsonValue& info = root.values[i];
    for (size_t k = 0; info.is_object() && k < info.keys.size(); ++k) {
      if (info.keys[k] == "saved_offsets") offsets = &info.values[k];
    }
    if (offsets == nullptr || !offsets->is_array()) {
      return DataLossError(prefix + "no \"saved_offsets\" array");
    }
    const Shape& sizes = entry->second->shape;
    if (offsets->items.size() != sizes.size()) {
      return DataLossError(prefix + std::to_string(offsets->items.size()) +
                           " saved_offsets for a chunk of shape " + ShapeToString(sizes));
    }
    std::vector<int64_t>& out = file->offsets[fqn];
    for (size_t d = 0; d < sizes.size(); ++d) {
      const JsonValue& o = offsets->items[d];
      if (!o.is_number() || o.number > kMaxOffset ||
          o.number + static_cast<uint64_t>(sizes[d]) > static_cast<uint64_t>(INT64_MAX)) {
        return DataLossError(prefix + "saved_offsets are not integers in [0, 2^62) that keep " +
                             "the chunk of shape " + ShapeToString(sizes) + " inside int64");
      }
      out.push_back(static_cast<int64_t>(o.number));
    }
  }
  return OkStatus();
}

Status ReadOneHeader(Store& store, FileHeader* file) {
  // A single-file checkpoint (no name) is the file itself, which may be a link.
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> handle,
                      file->name.empty() ? store.OpenReadable(file->path)
                                         : store.OpenInDirectory(ParentPath(file->path), file->name));
  SP_ASSIGN_OR_RETURN(file->header, ReadSafetensorsHeader(*handle));
  const std::map<std::string, std::string>& md = file->header.metadata;
  if (auto it = md.find("format"); it != md.end() && it->second == "shardpoint") {
    // Never load a native save that was not committed (docs/DESIGN.md decision 4).
    return NotFoundError("no committed checkpoint at " + ParentPath(file->path) + " (" +
                         file->path +
                         " is a data file of a shardpoint save whose metadata is missing)");
  }
  if (auto it = md.find(kDcpShardingInfoKey); it != md.end()) {
    file->sharded = true;
    SP_RETURN_IF_ERROR(ParseShardingInfo(it->second, file));
  }
  return OkStatus();
}

// Where each tensor is stored: one occurrence per (file, entry).
struct Occurrence {
  uint32_t file = 0;
  const SafetensorsEntry* entry = nullptr;
  const std::vector<int64_t>* offsets = nullptr;  // null: the whole tensor (offsets 0)
};

using OccurrenceMap = std::map<std::string, std::vector<Occurrence>>;

OccurrenceMap CollectOccurrences(const std::vector<FileHeader>& files) {
  OccurrenceMap by_name;
  for (uint32_t f = 0; f < files.size(); ++f) {
    for (const SafetensorsEntry& e : files[f].header.entries) {
      auto it = files[f].offsets.find(e.name);
      by_name[e.name].push_back(
          Occurrence{f, &e, it == files[f].offsets.end() ? nullptr : &it->second});
    }
  }
  return by_name;
}

// The index must list every tensor of its files under the file that holds it, and nothing else.
Status CheckIndex(const Index& index, const OccurrenceMap& by_name,
                  const std::vector<FileHeader>& files, const std::string& index_path) {
  for (const auto& [name, occurrences] : by_name) {
    auto it = index.weight_map.find(name);
    for (const Occurrence& o : occurrences) {
      if (it == index.weight_map.end()) {
        return DataLossError(index_path + ": tensor '" + name + "' of " + files[o.file].name +
                             " is not in the weight_map");
      }
      if (it->second != files[o.file].name) {
        return DataLossError(index_path + ": weight_map puts tensor '" + name + "' in " +
                             it->second + ", but it is stored in " + files[o.file].name);
      }
    }
  }
  for (const auto& [name, file] : index.weight_map) {
    if (!by_name.count(name)) {
      return DataLossError(index_path + ": weight_map puts tensor '" + name + "' in " + file +
                           ", whose header does not hold it");
    }
  }
  return OkStatus();
}

Result<TensorMetadata> BuildTensor(const std::string& name, const std::vector<Occurrence>& occ,
                                   const std::vector<FileHeader>& files) {
  const SafetensorsEntry& first = *occ[0].entry;
  const bool whole = occ.size() == 1 && occ[0].offsets == nullptr;
  for (size_t i = 1; i < occ.size(); ++i) {
    const std::string where = "tensor '" + name + "' is in both " + files[occ[0].file].path +
                              " and " + files[occ[i].file].path;
    if (occ[0].offsets == nullptr || occ[i].offsets == nullptr) {
      return DataLossError(where + " (without DCP sharding offsets, a tensor must be in one file)");
    }
    if (occ[i].entry->dtype != first.dtype || occ[i].entry->shape.size() != first.shape.size()) {
      return DataLossError(where + " with different dtypes or ranks (" +
                           std::string(DTypeName(first.dtype)) + " " +
                           ShapeToString(first.shape) + " vs " +
                           std::string(DTypeName(occ[i].entry->dtype)) + " " +
                           ShapeToString(occ[i].entry->shape) + ")");
    }
  }
  TensorMetadata t;
  t.name = name;
  t.dtype = first.dtype;
  t.shape = whole ? first.shape : Shape(first.shape.size(), 0);
  for (const Occurrence& o : occ) {
    Box box(o.offsets ? *o.offsets : std::vector<int64_t>(o.entry->shape.size(), 0),
            o.entry->shape);
    for (size_t d = 0; !whole && d < box.rank(); ++d) {
      t.shape[d] = std::max(t.shape[d], box.exclusive_max(d));
    }
    if (box.empty()) continue;
    StoredChunk chunk;
    chunk.box = std::move(box);
    chunk.file = o.file;
    chunk.data_offset = o.entry->begin;
    chunk.byte_length = o.entry->end - o.entry->begin;
    t.chunks.push_back(std::move(chunk));
  }
  if (!whole) {
    // The shape is the chunks' farthest extent: bounded only by DCP_SHARDING_INFO's offsets.
    std::string where = "tensor '" + name + "' (DCP_SHARDING_INFO of ";
    for (size_t i = 0; i < occ.size() && i < 3; ++i) {
      where += (i ? ", " : "") + files[occ[i].file].path;
    }
    where += occ.size() > 3 ? " and " + std::to_string(occ.size() - 3) + " more)" : ")";
    SP_RETURN_IF_ERROR(CheckedTensorBytes(t.dtype, t.shape, where).status());
  }
  std::sort(t.chunks.begin(), t.chunks.end(),
            [](const StoredChunk& a, const StoredChunk& b) { return a.box < b.box; });
  return t;
}

Result<CheckpointMetadata> Assemble(std::vector<FileHeader>& files, const Index* index,
                                    const std::string& index_path) {
  const OccurrenceMap by_name = CollectOccurrences(files);
  if (index != nullptr) SP_RETURN_IF_ERROR(CheckIndex(*index, by_name, files, index_path));
  CheckpointMetadata md;
  md.format = CheckpointFormat::kSafetensors;
  md.checksum_block_bytes = 0;
  if (index != nullptr) md.attributes = index->attributes;
  for (const FileHeader& f : files) {
    DataFile file;
    file.name = f.name;
    file.data_start = f.header.data_start;
    file.size = f.header.data_start +
                (f.header.entries.empty() ? 0 : f.header.entries.back().end);
    md.files.push_back(std::move(file));
  }
  for (const auto& [name, occurrences] : by_name) {
    SP_ASSIGN_OR_RETURN(TensorMetadata t, BuildTensor(name, occurrences, files));
    md.tensors.push_back(std::move(t));
  }
  return md;
}

Status ReadHeaders(Store& store, ThreadPool* pool, std::vector<FileHeader>& files) {
  return ParallelFor(pool, static_cast<int64_t>(files.size()),
                     [&](int64_t i) { return ReadOneHeader(store, &files[i]); });
}

}  // namespace

Result<bool> LooksLikeSafetensorsCheckpoint(Store& store, std::string_view path) {
  SP_ASSIGN_OR_RETURN(bool is_directory, store.IsDirectory(path));
  if (!is_directory) {
    std::string_view base = path.substr(path.rfind('/') + 1);
    return IsSafetensorsName(base);
  }
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(path));
  for (const DirEntry& e : entries) {
    if (e.is_directory) continue;
    if (e.name == kSafetensorsIndexFileName || IsSafetensorsName(e.name)) return true;
  }
  return false;
}

Result<CheckpointMetadata> ReadSafetensorsDirectory(Store& store, std::string_view path,
                                                    ThreadPool* pool) {
  const std::string dir(path);
  SP_ASSIGN_OR_RETURN(bool is_directory, store.IsDirectory(dir));
  std::vector<FileHeader> files;
  std::unique_ptr<Index> index;
  const std::string index_path = JoinPath(dir, kSafetensorsIndexFileName);
  if (!is_directory) {
    files.emplace_back().path = dir;
  } else {
    SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(dir));
    for (const DirEntry& e : entries) {
      if (!e.is_directory && e.name == kSafetensorsIndexFileName) {
        SP_ASSIGN_OR_RETURN(Index parsed, ReadIndex(store, index_path));
        index = std::make_unique<Index>(std::move(parsed));
      }
    }
    SP_ASSIGN_OR_RETURN(std::vector<std::string> names,
                        DataFileNames(entries, index.get(), dir));
    for (std::string& name : names) {
      FileHeader& file = files.emplace_back();
      file.path = JoinPath(dir, name);
      file.name = std::move(name);
    }
  }
  SP_RETURN_IF_ERROR(ReadHeaders(store, pool, files));
  return Assemble(files, index.get(), index_path);
}

}  // namespace sp
