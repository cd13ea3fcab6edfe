// Block checksums read from the data files' headers.
//
// From format 4 the metadata file holds no block checksums: each native data file's header does
// ("crc32c" in its __metadata__), and the metadata holds each header's CRC32C
// (DataFile::header_crc32c; docs/FORMAT.md §2.2). A load that verifies reads the headers of the
// files it reads, checks each against its CRC, and takes its chunks' checksums from there.
#ifndef SHARDPOINT_ENGINE_HEADER_CHECKSUMS_H_
#define SHARDPOINT_ENGINE_HEADER_CHECKSUMS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "shardpoint/base/status.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/store/store.h"

namespace sp {

class ThreadPool;

// The checksums of the headers of some data files of one checkpoint, loaded on demand.
class HeaderChecksums {
 public:
  explicit HeaderChecksums(size_t file_count) : tables_(file_count) {}

  // Reads the header of each file of `which` (indexes into metadata.files) not loaded yet from
  // `handles[f]` (bytes [0, data_start)), checks it against metadata.files[f].header_crc32c and
  // keeps its checksums. The calling thread reads them, helped by the workers of `pool` (when
  // given) that are free (ParallelForHelped): a load's reads wait for none of the pool's queued
  // tasks. kDataLoss naming the file when its CRC differs, or when its checksums do not fit its
  // entries; kInternal for a file that is not open. Calls may come from several threads.
  Status Load(const CheckpointMetadata& metadata,
              std::span<const std::unique_ptr<ReadableFile>> handles,
              std::span<const uint32_t> which, ThreadPool* pool);

  // The checksums of `chunk` (in its file), once Load has read its file's header; none for a
  // file not loaded, or no chunk there.
  std::span<const uint32_t> Of(const StoredChunk& chunk) const {
    if (chunk.file >= tables_.size() || !tables_[chunk.file]) return {};
    return tables_[chunk.file]->Of(chunk.data_offset, chunk.byte_length);
  }

 private:
  std::mutex mu_;  // one Load at a time; Of reads only the tables loaded before it
  std::vector<std::unique_ptr<DataFileChecksums>> tables_;
};

// Reads and checks the header of data file `f` of `metadata` from `handle` as Load does.
Result<DataFileChecksums> ReadHeaderChecksums(const CheckpointMetadata& metadata, uint32_t f,
                                              const ReadableFile& handle);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_HEADER_CHECKSUMS_H_
