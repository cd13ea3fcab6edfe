#include "shardpoint/engine/header_checksums.h"

#include <algorithm>
#include <string>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/safetensors/safetensors.h"

namespace sp {

Result<DataFileChecksums> ReadHeaderChecksums(const CheckpointMetadata& metadata, uint32_t f,
                                              const ReadableFile& handle) {
  const DataFile& file = metadata.files[f];
  // Read whole by the length the metadata gives, which no valid header passes.
  if (file.data_start > 8 + kMaxSafetensorsHeaderBytes) {
    return DataLossError("data file " + file.name + ": its header of " +
                         std::to_string(file.data_start - 8) + " bytes exceeds the limit of " +
                         std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  std::string bytes(file.data_start, '\0');
  if (Status read = handle.ReadAt(
          0, MutableByteView(reinterpret_cast<std::byte*>(bytes.data()), bytes.size()));
      !read.ok()) {
    return Status(read.code(),
                  "data file " + file.name + ": its header cannot be read: " + read.message());
  }
  const uint32_t crc = Crc32c(bytes);
  if (crc != file.header_crc32c) {
    return DataLossError("data file " + file.name + ": its header's CRC32C is " + Hex32(crc) +
                         ", the metadata records " + Hex32(file.header_crc32c) +
                         ": the header, which holds its chunks' checksums, is damaged");
  }
  SP_ASSIGN_OR_RETURN(SafetensorsHeader header,
                      ParseSafetensorsHeader(bytes, handle.size(), handle.path()));
  return ReadDataFileChecksums(header, metadata.checksum_block_bytes, file.name);
}

Status HeaderChecksums::Load(const CheckpointMetadata& metadata,
                             std::span<const std::unique_ptr<ReadableFile>> handles,
                             std::span<const uint32_t> which, ThreadPool* pool) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint32_t> missing;
  for (uint32_t f : which) {
    if (f >= tables_.size() || f >= handles.size() || !handles[f]) {
      return InternalError("the header of data file " + std::to_string(f) +
                           " is needed, and the file is not open");
    }
    if (!tables_[f]) missing.push_back(f);
  }
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  std::vector<std::unique_ptr<DataFileChecksums>> read(missing.size());
  SP_RETURN_IF_ERROR(
      ParallelForHelped(pool, static_cast<int64_t>(missing.size()), [&](int64_t i) -> Status {
        const uint32_t f = missing[i];
        SP_ASSIGN_OR_RETURN(DataFileChecksums table,
                            ReadHeaderChecksums(metadata, f, *handles[f]));
        read[i] = std::make_unique<DataFileChecksums>(std::move(table));
        return OkStatus();
      }));
  for (size_t i = 0; i < missing.size(); ++i) tables_[missing[i]] = std::move(read[i]);
  return OkStatus();
}

}  // namespace sp
