#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/base/json.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_objects.h"
#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::MemoryRangeReader;
using torch_save::ParseTorchSaveTensor;
using torch_save::PlainValue;
using torch_save::RangeReader;
using torch_save::TorchSaveTensorInfo;

namespace {

// Bytes hinted for read-ahead at each end of a tensor item while locating it: its local header
// and data.pkl at the start, its central directory at the end.
constexpr uint64_t kItemEdgeHintBytes = uint64_t{16} << 10;

// The files `.metadata` names, opened, with their sizes.
struct OpenedFiles {
  std::map<std::string, uint32_t> index;  // relative path -> position in metadata.files
  std::vector<std::unique_ptr<ReadableFile>> handles;
};

// The rank in torch's file name "__<rank>_<n>.distcp"; 0 for other names.
int32_t WriterRankOf(std::string_view name) {
  if (!name.starts_with("__")) return 0;
  int64_t rank = 0;
  size_t i = 2;
  for (; i < name.size() && i < 12 && name[i] >= '0' && name[i] <= '9'; ++i) {
    rank = rank * 10 + (name[i] - '0');
  }
  return i > 2 && i < name.size() && name[i] == '_' ? static_cast<int32_t>(rank) : 0;
}

// "'a', 'b' and 3 more": the keys with items in `relative_path`, for messages.
std::string KeysIn(const DcpMetadata& dcp, std::string_view relative_path) {
  std::vector<std::string_view> keys;
  for (const DcpStorageEntry& e : dcp.storage_data) {
    if (e.relative_path == relative_path && (keys.empty() || keys.back() != e.fqn)) {
      keys.push_back(e.fqn);
    }
  }
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 3; ++i) out += (i ? ", '" : "'") + std::string(keys[i]) + "'";
  if (keys.size() > 3) out += " and " + std::to_string(keys.size() - 3) + " more";
  return out;
}

Result<OpenedFiles> OpenDataFiles(Store& store, std::string_view path, const DcpMetadata& dcp,
                                  CheckpointMetadata* out) {
  OpenedFiles files;
  for (const DcpStorageEntry& e : dcp.storage_data) {
    if (files.index.count(e.relative_path)) continue;
    const std::string file_path = JoinPath(path, e.relative_path);
    Result<std::unique_ptr<ReadableFile>> opened = store.OpenInDirectory(path, e.relative_path);
    if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
      return DataLossError("data file " + file_path + " named by " +
                           JoinPath(path, kDcpMetadataFileName) + " is missing (it holds " +
                           KeysIn(dcp, e.relative_path) + ")");
    }
    SP_RETURN_IF_ERROR(opened.status());
    files.index[e.relative_path] = static_cast<uint32_t>(out->files.size());
    const int32_t writer = WriterRankOf(e.relative_path);
    out->files.push_back(DataFile{e.relative_path, 0, (*opened)->size(), writer});
    out->world_size = std::max(out->world_size, writer + 1);
    files.handles.push_back(std::move(opened).value());
  }
  return files;
}

RangeReader FileRangeReader(const ReadableFile& file, uint64_t base) {
  return [&file, base](uint64_t offset, uint64_t n, std::byte* out) {
    return file.ReadAt(base + offset, MutableByteView(out, n));
  };
}

std::string ItemName(const TensorMetadata& t, const Box& box, const DataFile& file,
                     const DcpStorageEntry& e) {
  return "tensor '" + t.name + "' chunk " + box.ToString() + " (item at offset " +
         std::to_string(e.offset) + " of " + file.name + ")";
}

Status CheckView(const TorchSaveTensorInfo& info, const TensorMetadata& t, const Box& box,
                 std::string_view what) {
  if (info.dtype != t.dtype) {
    return DataLossError(std::string(what) + " holds " + std::string(DTypeName(info.dtype)) +
                         ", .metadata says " + std::string(DTypeName(t.dtype)));
  }
  if (info.shape != box.sizes) {
    return DataLossError(std::string(what) + " has shape " + ShapeToString(info.shape) +
                         ", .metadata says " + ShapeToString(box.sizes));
  }
  return OkStatus();
}

// CheckView at decode time, where the box may be lifted into a fused target's coordinates
// (engine/mapped_metadata.h: size-1 dims inserted, which leaves the row-major bytes as they are):
// the item's shape must be the box's sizes up to dims of size 1.
Status CheckDecodedView(const TorchSaveTensorInfo& info, const TensorMetadata& t, const Box& box,
                        std::string_view what) {
  auto squeezed = [](std::span<const int64_t> shape) {
    Shape out;
    for (int64_t s : shape) {
      if (s != 1) out.push_back(s);
    }
    return out;
  };
  if (info.dtype == t.dtype && info.shape != box.sizes &&
      squeezed(info.shape) == squeezed(box.sizes)) {
    return OkStatus();
  }
  return CheckView(info, t, box, what);
}

// Locates one tensor chunk's bytes in its item.
Status ResolveChunk(const OpenedFiles& files, const CheckpointMetadata& md,
                    const TensorMetadata& t, const DcpStorageEntry& e, StoredChunk* chunk) {
  chunk->file = files.index.at(e.relative_path);
  const DataFile& file = md.files[chunk->file];
  const std::string what = ItemName(t, chunk->box, file, e);
  if (e.offset > file.size || e.length > file.size - e.offset) {
    return DataLossError(what + ": bytes [" + std::to_string(e.offset) + ", +" +
                         std::to_string(e.length) + ") lie past the end of the file (" +
                         std::to_string(file.size) + " bytes)");
  }
  chunk->byte_length = static_cast<uint64_t>(chunk->box.volume()) * DTypeSize(t.dtype);
  if (!e.transform_descriptors.empty()) {
    if (e.transform_descriptors.size() != 1 ||
        !e.transform_descriptors[0].starts_with("stream.zstd/1")) {
      std::string list;
      for (const std::string& d : e.transform_descriptors) list += (list.empty() ? "" : ", ") + d;
      return UnimplementedError(what + ": stream transforms [" + list +
                                "] are not supported (only stream.zstd/1)");
    }
    chunk->encoding = ChunkEncoding::kDriverDecoded;
    chunk->driver_tag = kDcpItemZstd;
    chunk->data_offset = e.offset;
    chunk->stored_length = e.length;
    return OkStatus();
  }
  SP_ASSIGN_OR_RETURN(TorchSaveTensorInfo info,
                      ParseTorchSaveTensor(FileRangeReader(*files.handles[chunk->file], e.offset),
                                           e.length, what));
  SP_RETURN_IF_ERROR(CheckView(info, t, chunk->box, what));
  if (info.IsDenseRowMajor()) {
    chunk->data_offset = e.offset + info.data_offset;
  } else {
    chunk->encoding = ChunkEncoding::kDriverDecoded;
    chunk->driver_tag = kDcpItemPlain;
    chunk->data_offset = e.offset;
    chunk->stored_length = e.length;
  }
  return OkStatus();
}

// planner_data -> the JSON paths attribute ([[key, [components]], ...]).
std::string JsonQuoteString(std::string_view s) {
  std::string out;
  AppendJsonString(&out, s);
  return out;
}

Result<std::string> PathsAttribute(const PlainValue& planner_data) {
  SP_ASSIGN_OR_RETURN(std::vector<DcpPlannerPath> paths, ParseDcpPlannerData(planner_data));
  std::string out = "[";
  for (size_t i = 0; i < paths.size(); ++i) {
    out += (i ? ", [" : "[") + JsonQuoteString(paths[i].fqn) + ", [";
    for (size_t j = 0; j < paths[i].path.size(); ++j) {
      if (j) out += ", ";
      const auto& part = paths[i].path[j];
      out += std::holds_alternative<int64_t>(part) ? std::to_string(std::get<int64_t>(part))
                                                   : JsonQuoteString(std::get<std::string>(part));
    }
    out += "]]";
  }
  return out + "]";
}

Result<DcpMetadata> ReadDcpMetadataFile(Store& store, std::string_view path) {
  const std::string metadata_path = JoinPath(path, kDcpMetadataFileName);
  SP_ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(store, metadata_path, kMaxDcpMetadataBytes));
  return DecodeDcpMetadata(AsBytes(bytes), metadata_path);
}

}  // namespace

std::string DcpFileName(int rank, int index, std::string_view suffix) {
  return "__" + std::to_string(rank) + "_" + std::to_string(index) + std::string(suffix) +
         ".distcp";
}

Result<CheckpointMetadata> ReadDcpCheckpoint(Store& store, std::string_view path, ThreadPool* pool) {
  SP_ASSIGN_OR_RETURN(DcpMetadata dcp, ReadDcpMetadataFile(store, path));
  CheckpointMetadata md;
  md.format = CheckpointFormat::kTorchDcp;
  md.checksum_block_bytes = 0;
  md.save_id = "dcp";
  if (dcp.storage_meta && dcp.storage_meta->save_id && !dcp.storage_meta->save_id->empty()) {
    md.save_id = *dcp.storage_meta->save_id;
  }
  if (dcp.version) md.attributes["torch_dcp.version"] = *dcp.version;
  if (dcp.planner_data && dcp.planner_data->is(PlainValue::Kind::kDict)) {
    SP_ASSIGN_OR_RETURN(md.attributes[kStateDictPathsAttribute], PathsAttribute(*dcp.planner_data));
  }
  SP_ASSIGN_OR_RETURN(OpenedFiles files, OpenDataFiles(store, path, dcp, &md));
  struct Work {
    size_t tensor;
    size_t chunk;
    const DcpStorageEntry* entry;
  };
  // (fqn, chunk offsets) -> storage entry; bytes entries have no offsets. Decoding checked that
  // every chunk and bytes entry has exactly one.
  std::map<std::pair<std::string_view, std::vector<int64_t>>, const DcpStorageEntry*> chunk_items;
  std::map<std::string_view, const DcpStorageEntry*> object_items;
  for (const DcpStorageEntry& s : dcp.storage_data) {
    if (s.chunk_offsets) {
      chunk_items[{s.fqn, *s.chunk_offsets}] = &s;
    } else {
      object_items[s.fqn] = &s;
    }
  }
  std::vector<Work> work;
  std::vector<std::pair<std::string, const DcpStorageEntry*>> objects;
  for (const DcpEntry& e : dcp.state_dict_metadata) {
    if (e.kind == DcpEntry::Kind::kBytes) {
      auto it = object_items.find(e.fqn);
      if (it == object_items.end()) {
        return DataLossError(JoinPath(path, kDcpMetadataFileName) + ": object '" + e.fqn +
                             "' has no storage entry");
      }
      objects.emplace_back(e.fqn, it->second);
      continue;
    }
    TensorMetadata t{e.fqn, e.properties.dtype, e.size, {}};
    for (size_t c = 0; c < e.chunks.size(); ++c) {
      auto it = chunk_items.find({e.fqn, Shape(e.chunks[c].offsets)});
      if (it == chunk_items.end()) {
        return DataLossError(JoinPath(path, kDcpMetadataFileName) + ": tensor '" + e.fqn +
                             "' chunk " + e.chunks[c].ToString() + " has no storage entry");
      }
      t.chunks.push_back(StoredChunk{e.chunks[c], 0, 0, 0, {}, ChunkEncoding::kRaw, 0, 0});
      work.push_back(Work{md.tensors.size(), c, it->second});
    }
    md.tensors.push_back(std::move(t));
  }
  // A few small reads per item, at its start (local header, data.pkl) and at its end (the ZIP's
  // central directory). The store is first asked to fetch all of them, so that the device works
  // on many at once however few threads read them; then they are spread over the pool (or run
  // here when there is none).
  for (const Work& w : work) {
    const ReadableFile& file = *files.handles[files.index.at(w.entry->relative_path)];
    const uint64_t edge = std::min<uint64_t>(w.entry->length, kItemEdgeHintBytes);
    file.Prefetch(w.entry->offset, edge);
    if (w.entry->length > edge) file.Prefetch(w.entry->offset + w.entry->length - edge, edge);
  }
  TaskGroup group(pool);
  for (const Work& w : work) {
    group.Run([&files, &md, w] {
      TensorMetadata& t = md.tensors[w.tensor];
      return ResolveChunk(files, md, t, *w.entry, &t.chunks[w.chunk]);
    });
  }
  SP_RETURN_IF_ERROR(group.Wait());
  for (const auto& [name, entry] : objects) {  // located, not read (dcp_objects.h)
    const uint32_t f = files.index.at(entry->relative_path);
    SP_ASSIGN_OR_RETURN(ObjectEntry object, DcpObjectEntry(name, *entry, f, md.files[f], path));
    md.objects.push_back(std::move(object));
  }
  std::sort(md.tensors.begin(), md.tensors.end(),
            [](const TensorMetadata& a, const TensorMetadata& b) { return a.name < b.name; });
  std::sort(md.objects.begin(), md.objects.end(),
            [](const ObjectEntry& a, const ObjectEntry& b) { return a.name < b.name; });
  SP_RETURN_IF_ERROR(AddMegatronFiles(store, path, &md));  // metadata.json, common.pt (megatron.h)
  return md;
}

namespace {

// Copies the view (shape, strides, storage_offset) of `storage` into row-major `out`.
void GatherView(const TorchSaveTensorInfo& info, const std::byte* storage, std::byte* out) {
  const size_t es = DTypeSize(info.dtype);
  const size_t n = info.shape.size();
  const int64_t volume = ShapeVolume(info.shape);
  if (volume == 0) return;
  if (n == 0) {
    std::memcpy(out, storage + info.storage_offset * es, es);
    return;
  }
  const int64_t inner = info.shape[n - 1];
  const int64_t inner_stride = info.strides[n - 1];
  std::vector<int64_t> index(n, 0);
  for (int64_t done = 0; done < volume; done += inner) {
    int64_t at = info.storage_offset;
    for (size_t d = 0; d + 1 < n; ++d) at += index[d] * info.strides[d];
    if (inner_stride == 1) {
      std::memcpy(out, storage + at * es, static_cast<size_t>(inner) * es);
      out += inner * es;
    } else {
      for (int64_t i = 0; i < inner; ++i, out += es) {
        std::memcpy(out, storage + (at + i * inner_stride) * es, es);
      }
    }
    for (size_t d = n - 1; d-- > 0;) {  // odometer over the outer dims
      if (++index[d] < info.shape[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace

Status DecodeDcpChunk(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                      const StoredChunk& chunk, ByteView stored, std::byte* out) {
  const DataFile& file = metadata.files.at(chunk.file);
  const std::string what = "tensor '" + tensor.name + "' chunk " + chunk.box.ToString() +
                           " (item at offset " + std::to_string(chunk.data_offset) + " of " +
                           file.name + ")";
  std::string decoded;
  ByteView archive = stored;
  if (chunk.driver_tag == kDcpItemZstd) {
    const std::string zstd[] = {kZstdTransformDescriptor};
    const uint64_t cap = 4 * chunk.byte_length + (uint64_t{64} << 20);
    SP_ASSIGN_OR_RETURN(decoded, DecodeTransformedItem(zstd, stored, cap, what));
    archive = AsBytes(decoded);
  } else if (chunk.driver_tag != kDcpItemPlain) {
    return DataLossError(what + ": unknown item kind " + std::to_string(chunk.driver_tag));
  }
  SP_ASSIGN_OR_RETURN(TorchSaveTensorInfo info,
                      ParseTorchSaveTensor(MemoryRangeReader(archive), archive.size(), what));
  SP_RETURN_IF_ERROR(CheckDecodedView(info, tensor, chunk.box, what));
  // `out` holds chunk.byte_length bytes: the view must fill exactly that (its size was checked
  // against the 2^62-byte limit when the item was parsed, so the product cannot wrap).
  const uint64_t view_bytes = static_cast<uint64_t>(ShapeVolume(info.shape)) * DTypeSize(info.dtype);
  if (view_bytes != chunk.byte_length) {
    return DataLossError(what + ": the item's view of shape " + ShapeToString(info.shape) + " holds " +
                         std::to_string(view_bytes) + " bytes, the chunk " +
                         std::to_string(chunk.byte_length));
  }
  GatherView(info, archive.data() + info.data_offset, out);
  return OkStatus();
}

}  // namespace sp::torch_dcp
