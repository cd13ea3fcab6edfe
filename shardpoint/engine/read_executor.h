// ReadExecutor: performs the reads of one rank's load plan.
//
// Three paths, chosen per read:
//  - direct: a region contiguous in both the stored chunk and the destination, of the same dtype,
//    at least kDirectMinBytes, and the only request on its chunk (several requests on one chunk
//    are coalesced so that shared checksum blocks are read once), is read straight into the
//    destination (in 16 MiB pieces
//    spread over the pool) and its checksum blocks verified in place;
//  - coalesced: every other read is widened to whole rows of its stored chunk and whole checksum
//    blocks; these byte ranges are merged per file into spans of at most min(`window`,
//    kMaxSpanBytes) bytes (gaps up
//    to `max_gap_bytes` are read through), each span read with one pread into a staging buffer,
//    its blocks verified once, and each region copied (and cast if asked) into its destination;
//  - sliced: a read whose rows alone exceed the window is cut into slabs read one at a time.
// Staging never exceeds `window` bytes per pool thread. The store is asked to prefetch about
// 64 MiB ahead of the reads in progress. Thread-safe for one call at a time.
#ifndef SHARDPOINT_ENGINE_READ_EXECUTOR_H_
#define SHARDPOINT_ENGINE_READ_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/strided_copy.h"
#include "shardpoint/store/store.h"

namespace sp {

inline constexpr uint64_t kDirectMinBytes = uint64_t{64} << 10;
inline constexpr uint64_t kMaxGapBytes = uint64_t{256} << 10;
inline constexpr uint64_t kMaxSpanBytes = uint64_t{16} << 20;

struct ReadRequest {
  const TensorMetadata* stored = nullptr;
  const StoredChunk* chunk = nullptr;
  const LoadTensor* dest = nullptr;
  const PieceView* piece = nullptr;
  Box region;  // global coordinates, inside both the chunk and the piece
};

struct ReadExecutorOptions {
  bool verify = true;
  uint64_t window = uint64_t{64} << 20;  // staging bytes per task
  // Gaps up to this many bytes between two reads of one file are read through to make one span.
  // Shared loads pass 0: their gaps are chunks that other ranks read.
  uint64_t max_gap_bytes = kMaxGapBytes;
};

// Copies `region` from `src` (laid out in the stored dtype) into the request's destination,
// converting the dtype if the destination's differs.
Status CopyToDestination(const ConstChunkView& src, const Box& region, const ReadRequest& r);

// Runs every request. `files` is indexed like metadata.files (null where no request needs it).
// Returns the bytes read from storage, or the first error (checksum mismatch, short read, ...).
Result<uint64_t> ExecuteReads(std::span<const ReadRequest> requests,
                              const CheckpointMetadata& metadata,
                              const std::vector<std::unique_ptr<ReadableFile>>& files,
                              ThreadPool& pool, const ReadExecutorOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_READ_EXECUTOR_H_
