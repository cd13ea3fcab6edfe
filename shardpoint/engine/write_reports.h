// The commit's collection of what the ranks of a save report once their data is written
// (WriteReport in engine/save_messages.h): the block checksums of every chunk and where each data
// file's data starts and ends (docs/DESIGN.md, save step 5).
#ifndef SHARDPOINT_ENGINE_WRITE_REPORTS_H_
#define SHARDPOINT_ENGINE_WRITE_REPORTS_H_

#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// Takes `reports` (rank r's encoded WriteReport at index r) against the plan's `tensors`:
// - every file of `metadata` must be reported once, by its writer, and takes its data start and
//   size from the report;
// - every chunk of `tensors` must be reported once, with as many block checksums as its byte
//   length has blocks of metadata->checksum_block_bytes (ChecksumBlockCount). The checksums go
//   into `checksums` when given (laid out here for `tensors`), or else into the chunks of
//   metadata->tensors, which are then `tensors` (and hold no cells, TensorMetadata::cells:
//   kInternal).
// A report that breaks any of this is kInternal naming the rank, and the tensor and chunk or the
// file (a chunk or file nobody reports: the tensor and chunk, or the file); bytes that are not a
// report are kDataLoss naming the rank. The reports are walked in place on `pool` when given,
// rank by rank (the error returned is then the lowest rank's, as one thread would find it; for a
// chunk reported by two ranks it names the one whose report was walked second).
Status CollectReports(const std::vector<std::string>& reports,
                      const std::vector<TensorMetadata>& tensors, CheckpointMetadata* metadata,
                      ChunkChecksums* checksums, ThreadPool* pool = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_WRITE_REPORTS_H_
