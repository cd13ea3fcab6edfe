// Strided copies between chunks: moving a box of elements from one row-major chunk to another.
//
// A chunk is a box of a tensor stored contiguously in row-major order. CopyRegion copies the
// elements of a region (global coordinates) that both chunks contain. Trailing dimensions that are
// contiguous in both chunks are merged into long runs, so a region that is contiguous in both
// chunks is one memcpy, and a 2-D row copy is one memcpy per row driven by an odometer with no
// allocation per row. ForEachByteRun and SummarizeByteRuns describe the byte runs a region occupies
// inside one chunk (what a reader must fetch from a stored chunk).
//
// Functions are thread-safe for disjoint destinations; the views do not own memory.
#ifndef SHARDPOINT_GEOMETRY_STRIDED_COPY_H_
#define SHARDPOINT_GEOMETRY_STRIDED_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "shardpoint/base/status.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/geometry/box.h"

namespace sp {

// A read-only chunk: `box` (global coordinates) stored row-major and contiguous at `data`.
struct ConstChunkView {
  const std::byte* data;
  Box box;
  size_t element_size;
};

// A writable chunk: `box` (global coordinates) stored row-major and contiguous at `data`.
struct ChunkView {
  std::byte* data;
  Box box;
  size_t element_size;
};

// Copies the elements of `region` (global coordinates) from src to dst. The region must lie inside
// both boxes, all three of equal rank; otherwise kInvalidArgument naming the three boxes. Element
// sizes must match (kInvalidArgument otherwise). An empty region copies nothing. Copies of at
// least `parallel_min_bytes` are split across `pool` (may be null: copy on the calling thread)
// along the outermost iterated dimension. The source and destination must not overlap.
Status CopyRegion(const ConstChunkView& src, const ChunkView& dst, const Box& region,
                  ThreadPool* pool = nullptr, size_t parallel_min_bytes = 8u << 20);

// The contiguous byte runs that `region` occupies inside a row-major chunk `chunk`, in increasing
// offset order, adjacent runs merged: calls fn(byte_offset_in_chunk, byte_length) for each.
// Produces nothing when the region is empty, or does not lie inside the chunk (callers intersect
// first: Intersect(chunk, wanted)).
void ForEachByteRun(const Box& chunk, const Box& region, size_t element_size,
                    const std::function<void(uint64_t, uint64_t)>& fn);

// What ForEachByteRun would produce, computed without iterating: the number of runs, the offset
// of the first byte, the end of the last byte, and the total bytes. All zero when it produces
// nothing.
struct RunSummary {
  uint64_t runs;
  uint64_t first_byte;
  uint64_t end_byte;
  uint64_t bytes;
};
RunSummary SummarizeByteRuns(const Box& chunk, const Box& region, size_t element_size);

// The runs CopyRegion(src, dst, region) would copy, without copying: each run's byte length (the
// same for all of them) and their number. Both zero when the region is empty or does not lie
// inside both boxes.
struct CopyRuns {
  uint64_t run_bytes;
  uint64_t count;
};
CopyRuns SummarizeCopyRuns(const Box& src, const Box& dst, const Box& region, size_t element_size);

// Calls fn(src_offset, dst_offset) for each of those runs, in row-major order of the region:
// the byte offsets of the run in a row-major chunk `src` and in one `dst`.
void ForEachCopyRun(const Box& src, const Box& dst, const Box& region, size_t element_size,
                    const std::function<void(uint64_t, uint64_t)>& fn);

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_STRIDED_COPY_H_
