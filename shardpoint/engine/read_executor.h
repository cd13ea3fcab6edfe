// ReadExecutor: performs the reads of one rank's load plan.
//
// Each read takes one of three paths:
//  - direct: a region contiguous in both the stored chunk and the destination, of the same dtype,
//    and the only request on its chunk, lands straight in the destination; with verification
//    the partial checksum blocks at its ends are read into staging to complete their checksums;
//  - staged: every other read is widened to whole rows of its stored chunk and (when verified)
//    whole checksum blocks and lands in a staging buffer, from which its region is copied (and cast if asked)
//    once its blocks are verified; reads of one chunk share the blocks they overlap;
//  - scattered: the reads of a chunk whose regions are runs of at least scatter_min_run_bytes in
//    both the chunk and their destinations, none overlapping another, all of the stored dtype
//    (columns of rows: a resharded load's own region and what it reads for other ranks), land
//    run by run in their destinations, each run one piece of a scatter read; what lies between
//    the runs (other columns, the edges of checksum blocks) lands in staging, so every block is
//    still verified in the same pass, and nothing is copied afterwards. Cut at the same file
//    offsets as direct reads;
//  - sliced: a staged read whose rows alone exceed `window` is cut into slabs read one at a time;
//    the slabs start at the region's first row, so reads of one chunk that span the same rows
//    (other columns of it: what a rank reads for the ranks it shares the chunk with) share each
//    slab, read once.
// Direct and staged reads of one file are grouped, in file order, into extents of consecutive
// bytes of at most kMaxSpanBytes, each read with one scatter read (ReadableFile::ReadVAt) into
// the destinations and one staging buffer, so that the device sees large sequential reads even
// when the chunks are small. Staged reads may read through gaps of up to `max_gap_bytes`; direct
// reads never do; a direct read is cut at the file offsets that are multiples of the extent size,
// so extents line up whatever the chunk sizes (with direct I/O the extent size is at most the
// window). Extents run on the pool in the order of their relative position in their file, so
// that several files are read at once, each front to back, and as many at once as the pool's
// IoTuner allows (or `io_depth`); a read leaves the tuner's gate once its bytes have arrived, so
// verifying and copying overlap the next reads. Direct extents that are mostly staged (the end of
// a native data file, where the chunks that are not a whole number of pages lie) are spread over
// the load instead (SpreadPosition). Staging comes from the pool's BufferPool and
// never exceeds min(`window`, kMaxSpanBytes) bytes per running extent (with direct I/O, at most
// `window` bytes: the extent widened to the alignment, less what lands in place). Thread-safe for
// one call at a time.
#ifndef SHARDPOINT_ENGINE_READ_EXECUTOR_H_
#define SHARDPOINT_ENGINE_READ_EXECUTOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/header_checksums.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/strided_copy.h"
#include "shardpoint/store/store.h"

namespace sp {

inline constexpr uint64_t kMaxGapBytes = uint64_t{256} << 10;
inline constexpr uint64_t kMaxSpanBytes = uint64_t{16} << 20;

// Where a read lands: `data` holds the elements of `box` (global coordinates of the tensor),
// row-major, each of `dtype`. A null `data` is no destination: a request that names only what is
// read (which chunk, which region), e.g. to find the files a set of reads needs; ExecuteReads
// refuses it.
struct ReadDestination {
  std::byte* data = nullptr;
  Box box;
  DType dtype = DType::kUInt8;

  bool empty() const { return data == nullptr; }
};

// One piece of a caller's tensor as a destination of `dtype`.
inline ReadDestination IntoPiece(const PieceView& piece, DType dtype) {
  return ReadDestination{piece.data, piece.box, dtype};
}

struct ReadRequest {
  const TensorMetadata* stored = nullptr;
  const StoredChunk* chunk = nullptr;
  ReadDestination dest;
  Box region;  // global coordinates, inside both the chunk and dest.box
};

// The request that reads `region` of stored chunk `chunk` of `stored` into `dest`. `stored` must
// outlive the request; `chunk` indexes stored.chunks and `region` lies inside that chunk's box
// and, unless `dest` is empty, inside dest.box.
ReadRequest MakeReadRequest(const TensorMetadata& stored, size_t chunk, ReadDestination dest,
                            Box region);

// With ReadExecutorOptions::direct_io unset, a file of which less than this fraction of the bytes
// to read is cached is read directly.
inline constexpr double kColdFraction = 0.5;
// ... and of which the rank keeps at least this fraction (kKeptForDirectNum / kKeptForDirectDen)
// of the bytes it reads. The rest are rows read whole for columns that other ranks need, and
// those ranks read the same rows: directly, each of them reads those bytes from the device again;
// through the cache, the first read brings them in and the others copy them, which costs far
// less. So direct I/O is chosen only where nearly every byte read is the rank's own.
inline constexpr uint64_t kKeptForDirectNum = 7;
inline constexpr uint64_t kKeptForDirectDen = 8;

struct ReadExecutorOptions {
  bool verify = true;
  uint64_t window = uint64_t{64} << 20;  // staging bytes per task
  // Gaps up to this many bytes between two reads of one file are read through to make one span.
  // Shared loads pass 0: their gaps are chunks that other ranks read.
  uint64_t max_gap_bytes = kMaxGapBytes;
  // Extents of at least direct_io_min_bytes whose file can be read directly
  // (ReadableFile::direct_io_alignment) bypass the page cache: the extent, widened to the
  // alignment, is read with one scatter read; the whole aligned blocks of a destination whose
  // address agrees with its file offset modulo the alignment land in place, everything else in
  // staging, from which it is copied once the checksums are verified. Others, and files that
  // cannot be read directly, use the page cache.
  // Unset: only the files whose bytes to read are mostly not in the page cache
  // (ReadableFile::CachedFraction below kColdFraction) and of which at least 7/8 of the bytes
  // read are kept (kKeptForDirectNum: not rows read whole for columns that others need) are read
  // directly.
  std::optional<bool> direct_io = false;
  uint64_t direct_io_min_bytes = uint64_t{1} << 20;
  // A chunk whose requests' runs are all at least this long is read scattered (see above; the
  // default is in engine/budget.h).
  uint64_t scatter_min_run_bytes = kMinScatterRunBytes;
  // Reads running at once. 0: as many as the pool's IoTuner allows, which it learns from the
  // throughput of the reads as they run (ThreadPool::io_tuner); N > 0: at most N, fixed (never
  // more than the pool's threads).
  int io_depth = 0;
  // With io_depth 0, the gate the reads go through instead of the pool's tuner: a SharedIoTuner
  // (exec/shared_io_tuner.h) shared with the other processes of the machine. Not owned.
  IoGate* gate = nullptr;
  // Destinations in [staged_from, staged_to) take the bytes of direct reads through staging even
  // where they could land in place, on files whose device takes shorter requests into scattered
  // 4 KiB pages (ReadableFile::small_pages_shorten_requests): shared memory, which gets no
  // transparent huge pages unless the administrator allows it. Read in place there, the test
  // machine's disk delivered about half its speed; the staging buffers are huge pages
  // (docs/PERFORMANCE.md, "Shared memory's pages").
  const std::byte* staged_from = nullptr;
  const std::byte* staged_to = nullptr;
  // Where the metadata holds no block checksums (CheckpointMetadata::checksums_in_headers) and
  // the reads verify, the headers of the files read give them: loaded into this table, which a
  // caller of several ExecuteReads on one checkpoint shares so that each header is read once;
  // null: a table for the call. Not owned.
  HeaderChecksums* header_checksums = nullptr;
  // When set and still 0, set to the steady clock's nanoseconds (since its epoch) as the call
  // hands its first read to the pool: a load's time before its first read (LoadResult). Not owned.
  std::atomic<int64_t>* reads_begin_ns = nullptr;
};

// Where the k-th of the n mostly staged direct extents of file `file` runs, as a relative
// position in [0, 1) among the extents of every file, which otherwise run at their relative
// position in their file: spread evenly over the load, and shifted per file by the golden ratio
// so that those of different files do not come at once. Such an extent stages most of its bytes
// (its destinations do not agree with the file offsets modulo the alignment, or are small) and
// copies them out after its read, and a fresh staging buffer is faulted in at its first use. At
// their place in the files they all came last, together, with little else in flight (measured in
// docs/PERFORMANCE.md, "Mostly staged extents"). Direct reads do not depend on the order of
// reads within a file; page-cache reads (read-ahead) do, and keep it.
double SpreadPosition(uint32_t file, size_t k, size_t n);

// Copies `region` from `src` (laid out in the stored dtype) into the request's destination,
// converting the dtype if the destination's differs.
Status CopyToDestination(const ConstChunkView& src, const Box& region, const ReadRequest& r);

// Runs every request. `files` is indexed like metadata.files (null where no request needs it).
// Returns the bytes read from storage, or the first error (checksum mismatch, short read, ...);
// a request without a destination is kInvalidArgument naming its tensor, before any read.
Result<uint64_t> ExecuteReads(std::span<const ReadRequest> requests,
                              const CheckpointMetadata& metadata,
                              const std::vector<std::unique_ptr<ReadableFile>>& files,
                              ThreadPool& pool, const ReadExecutorOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_READ_EXECUTOR_H_
