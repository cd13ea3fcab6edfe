#include "shardpoint/format/torch_dcp/dcp_objects.h"

#include <map>
#include <memory>
#include <vector>

#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::ObjectFromTorchSaveItem;

namespace {

std::string ItemWhat(std::string_view name, uint64_t offset, uint64_t length,
                     std::string_view file_path) {
  return "object '" + std::string(name) + "' (item of " + std::to_string(length) +
         " bytes at offset " + std::to_string(offset) + " of " + std::string(file_path) + ")";
}

bool IsZstdV1(std::string_view descriptor) {
  return descriptor == kZstdTransformDescriptor ||
         descriptor.starts_with(std::string(kZstdTransformDescriptor) + ".");
}

// The data files the items lie in, each opened once, when first needed.
class ItemFiles {
 public:
  ItemFiles(Store& store, std::string_view path, const CheckpointMetadata& md)
      : store_(store), path_(path), md_(md), handles_(md.files.size()) {}

  std::string PathOf(uint32_t file) const { return JoinPath(path_, md_.files[file].name); }

  Result<const ReadableFile*> Get(uint32_t file) {
    if (!handles_[file]) {
      // Through the checkpoint directory: links out of it are refused as for tensor data.
      Result<std::unique_ptr<ReadableFile>> opened =
          store_.OpenInDirectory(path_, md_.files[file].name);
      if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
        return DataLossError("data file " + PathOf(file) + " named by " +
                             JoinPath(path_, kDcpMetadataFileName) + " is missing");
      }
      SP_ASSIGN_OR_RETURN(handles_[file], std::move(opened));
    }
    return handles_[file].get();
  }

 private:
  Store& store_;
  std::string path_;
  const CheckpointMetadata& md_;
  std::vector<std::unique_ptr<ReadableFile>> handles_;
};

// One item's bytes, read and (zstd) decoded, at most limits.max_object_bytes of them.
Result<std::string> ReadItem(ItemFiles& files, const CheckpointMetadata& md,
                             const StoredObjectItem& item, std::string_view name,
                             uint64_t max_bytes) {
  if (item.file >= md.files.size()) {
    return DataLossError("object '" + std::string(name) + "': data file index " +
                         std::to_string(item.file) + " out of range");
  }
  const std::string what = ItemWhat(name, item.offset, item.length, files.PathOf(item.file));
  if (item.driver_tag != kDcpItemPlain && item.driver_tag != kDcpItemZstd) {
    return DataLossError(what + ": unknown item kind " + std::to_string(item.driver_tag));
  }
  // A raw item is its payload; zstd never stores more than 1/128 above what it decodes to (plus
  // a frame header), so a longer compressed item would decode past the limit anyway.
  const uint64_t max_stored = max_bytes + max_bytes / 64 + 1024;
  if (item.length > (item.driver_tag == kDcpItemPlain ? max_bytes : max_stored)) {
    return ResourceExhaustedError(what + " is larger than the limit of " +
                                  std::to_string(max_bytes) + " bytes for one object");
  }
  SP_ASSIGN_OR_RETURN(const ReadableFile* file, files.Get(item.file));
  if (item.offset > file->size() || item.length > file->size() - item.offset) {
    return DataLossError(what + " lies past the end of the file (" + std::to_string(file->size()) +
                         " bytes)");
  }
  std::string bytes(item.length, '\0');
  SP_RETURN_IF_ERROR(file->ReadAt(
      item.offset, MutableByteView(reinterpret_cast<std::byte*>(bytes.data()), bytes.size())));
  if (item.driver_tag == kDcpItemPlain) return bytes;
  const std::string zstd[] = {kZstdTransformDescriptor};
  return DecodeTransformedItem(zstd, AsBytes(bytes), max_bytes, what);
}

}  // namespace

Result<ObjectEntry> DcpObjectEntry(std::string name, const DcpStorageEntry& item, uint32_t file,
                                   const DataFile& data_file, std::string_view path) {
  const std::string what =
      ItemWhat(name, item.offset, item.length, JoinPath(path, data_file.name));
  if (item.offset > data_file.size || item.length > data_file.size - item.offset) {
    return DataLossError(what + " lies past the end of the file (" +
                         std::to_string(data_file.size) + " bytes)");
  }
  uint32_t tag = kDcpItemPlain;
  if (!item.transform_descriptors.empty()) {
    if (item.transform_descriptors.size() != 1 || !IsZstdV1(item.transform_descriptors[0])) {
      std::string list;
      for (const std::string& d : item.transform_descriptors) list += (list.empty() ? "" : ", ") + d;
      return UnimplementedError(what + ": stream transforms [" + list +
                                "] are not supported (only stream.zstd/1)");
    }
    tag = kDcpItemZstd;
  }
  return ObjectEntry{std::move(name), ObjectEncoding::kTorchSave, {},
                     StoredObjectItem{file, item.offset, item.length, tag}};
}

Status ReadDcpObjectPayloads(Store& store, std::string_view path, const CheckpointMetadata& metadata,
                             std::span<ObjectEntry> objects, const ObjectReadLimits& limits) {
  // Each stored item once, with the entries that point at it.
  std::map<StoredObjectItem, std::vector<size_t>> users;
  for (size_t i = 0; i < objects.size(); ++i) {
    if (objects[i].stored) users[*objects[i].stored].push_back(i);
  }
  ItemFiles files(store, path, metadata);
  uint64_t total = 0;  // payload bytes handed out so far; <= limits.max_total_bytes
  for (const auto& [item, entries] : users) {
    const std::string& name = objects[entries.front()].name;
    SP_ASSIGN_OR_RETURN(std::string archive,
                        ReadItem(files, metadata, item, name, limits.max_object_bytes));
    ObjectEntry decoded = ObjectFromTorchSaveItem(name, std::move(archive));
    // Every entry gets its own copy: count each (bytes <= 2^30-ish, entries < 2^32: no overflow).
    const uint64_t adding = decoded.payload.size() * entries.size();
    if (adding > limits.max_total_bytes - total) {
      return ResourceExhaustedError(
          ItemWhat(name, item.offset, item.length, files.PathOf(item.file)) + ": its " +
          std::to_string(decoded.payload.size()) + " bytes for " + std::to_string(entries.size()) +
          " object(s) would bring the objects read at once to " + std::to_string(total + adding) +
          " bytes, more than the limit of " + std::to_string(limits.max_total_bytes));
    }
    total += adding;
    for (size_t k = 0; k < entries.size(); ++k) {
      ObjectEntry& o = objects[entries[k]];
      o.encoding = decoded.encoding;
      if (k + 1 == entries.size()) {
        o.payload = std::move(decoded.payload);
      } else {
        o.payload = decoded.payload;
      }
      o.stored.reset();
    }
  }
  return OkStatus();
}

}  // namespace sp::torch_dcp
