#include "shardpoint/format/open_checkpoint.h"

#include <algorithm>

#include "shardpoint/format/chunk_grid.h"

#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_objects.h"
#include "shardpoint/format/safetensors/hf_directory.h"

namespace sp {
namespace {

// `prefix` followed by the whole file `name` of the checkpoint directory `dir`.
Result<std::string> ReadWholeFile(Store& store, std::string_view dir, std::string_view name,
                                  std::string_view prefix = {}) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, store.OpenInDirectory(dir, name));
  std::string out(prefix.size() + file->size(), '\0');
  std::copy(prefix.begin(), prefix.end(), out.begin());
  SP_RETURN_IF_ERROR(
      file->ReadAt(0, AsMutableBytes(out.data() + prefix.size(), out.size() - prefix.size())));
  return out;
}

}  // namespace

std::string_view CheckpointFormatName(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::kNative:
      return "native";
    case CheckpointFormat::kTorchDcp:
      return "torch-dcp";
    case CheckpointFormat::kSafetensors:
      return "safetensors";
  }
  return "unknown";
}

Result<CheckpointFormat> ParseCheckpointFormat(std::string_view name) {
  for (CheckpointFormat f : {CheckpointFormat::kNative, CheckpointFormat::kTorchDcp,
                             CheckpointFormat::kSafetensors}) {
    if (name == CheckpointFormatName(f)) return f;
  }
  return InvalidArgumentError("unknown checkpoint format '" + std::string(name) +
                              "' (expected native, torch-dcp or safetensors)");
}

Result<CheckpointFormat> DetectCheckpointFormat(Store& store, std::string_view path) {
  SP_ASSIGN_OR_RETURN(bool native, store.Exists(JoinPath(path, kMetadataFileName)));
  if (native) return CheckpointFormat::kNative;
  SP_ASSIGN_OR_RETURN(bool dcp, store.Exists(JoinPath(path, torch_dcp::kDcpMetadataFileName)));
  if (dcp) return CheckpointFormat::kTorchDcp;
  if (Result<bool> hf = LooksLikeSafetensorsCheckpoint(store, path); hf.ok() && *hf) {
    return CheckpointFormat::kSafetensors;
  }
  return NotFoundError("no committed checkpoint at " + std::string(path) + " (" +
                       std::string(kMetadataFileName) + " is missing)");
}

namespace {

Result<CheckpointMetadata> DecodeWithDriver(Store& store, std::string_view path,
                                            CheckpointFormat format, ThreadPool* pool) {
  switch (format) {
    case CheckpointFormat::kSafetensors:
      return ReadSafetensorsDirectory(store, path, pool);
    case CheckpointFormat::kTorchDcp:
      return torch_dcp::ReadDcpCheckpoint(store, path, pool);
    default:
      break;
  }
  return UnimplementedError("checkpoints in the " + std::string(CheckpointFormatName(format)) +
                            " format cannot be opened by this build");
}

// What every format's metadata passes once decoded.
Status CheckAndIndex(CheckpointMetadata* md, std::string_view path, ThreadPool* pool) {
  // Whatever the driver, no size derived from the files reaches a buffer unchecked.
  SP_RETURN_IF_ERROR(ValidateCheckpointSizes(*md, path, pool));
  // Grids proved once here serve every load plan of this metadata (and travel with it).
  IndexChunkGrids(md, pool);
  return OkStatus();
}

}  // namespace

Result<std::string> ReadNativeMetadataFile(Store& store, std::string_view path,
                                           std::string_view prefix) {
  Result<std::string> bytes = ReadWholeFile(store, path, kMetadataFileName, prefix);
  if (!bytes.ok() && bytes.status().code() == StatusCode::kNotFound) {
    return NotFoundError("no committed checkpoint at " + std::string(path) + " (" +
                         std::string(kMetadataFileName) + " is missing)");
  }
  return bytes;
}

Result<CheckpointMetadata> DecodeNativeCheckpointMetadata(std::string_view bytes,
                                                          std::string_view path,
                                                          ThreadPool* pool,
                                                          const ChunkFilter* filter) {
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md,
                      DecodeMetadata(bytes, JoinPath(path, kMetadataFileName), pool, filter));
  SP_RETURN_IF_ERROR(CheckAndIndex(&md, path, pool));
  return md;
}

Result<CheckpointMetadata> OpenCheckpointMetadata(Store& store, std::string_view path,
                                                  ThreadPool* pool) {
  SP_ASSIGN_OR_RETURN(CheckpointFormat format, DetectCheckpointFormat(store, path));
  if (format == CheckpointFormat::kNative) {
    SP_ASSIGN_OR_RETURN(std::string bytes, ReadNativeMetadataFile(store, path));
    return DecodeNativeCheckpointMetadata(bytes, path, pool);
  }
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, DecodeWithDriver(store, path, format, pool));
  SP_RETURN_IF_ERROR(CheckAndIndex(&md, path, pool));
  return md;
}

Status DecodeStoredChunk(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                         const StoredChunk& chunk, ByteView stored, std::byte* out) {
  if (metadata.format == CheckpointFormat::kTorchDcp) {
    return torch_dcp::DecodeDcpChunk(metadata, tensor, chunk, stored, out);
  }
  return UnimplementedError("tensor '" + tensor.name + "' chunk " + chunk.box.ToString() +
                            " in " + metadata.files.at(chunk.file).name +
                            " needs a decoder the " +
                            std::string(CheckpointFormatName(metadata.format)) +
                            " driver does not provide");
}

Status ReadObjectPayloads(Store& store, std::string_view path, const CheckpointMetadata& metadata,
                          std::span<ObjectEntry> objects, const ObjectReadLimits& limits) {
  bool any = false;
  for (const ObjectEntry& o : objects) any = any || o.stored.has_value();
  if (!any) return OkStatus();
  if (metadata.format == CheckpointFormat::kTorchDcp) {
    return torch_dcp::ReadDcpObjectPayloads(store, path, metadata, objects, limits);
  }
  return UnimplementedError("objects of the " + std::string(CheckpointFormatName(metadata.format)) +
                            " checkpoint at " + std::string(path) + " are not stored as items");
}

}  // namespace sp
