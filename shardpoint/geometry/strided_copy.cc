#include "shardpoint/geometry/strided_copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "shardpoint/exec/task_group.h"

namespace sp {
namespace {

// How a region is walked: an odometer over the outer dimensions (those with extent > 1 that are
// not merged into the run), one run of `run_bytes` per step. Offsets are in bytes from the start
// of each chunk; `b` describes the second chunk of a copy (equal to `a` when there is one chunk).
struct RunPlan {
  std::vector<uint64_t> extents;
  std::vector<uint64_t> a_strides;
  std::vector<uint64_t> b_strides;
  uint64_t a_base = 0;
  uint64_t b_base = 0;
  uint64_t run_bytes = 0;
  uint64_t run_count = 0;
};

std::vector<uint64_t> ByteStrides(const Box& chunk, size_t element_size) {
  std::vector<uint64_t> strides(chunk.rank());
  uint64_t stride = element_size;
  for (size_t d = chunk.rank(); d-- > 0;) {
    strides[d] = stride;
    stride *= static_cast<uint64_t>(chunk.sizes[d]);
  }
  return strides;
}

// Requires: equal ranks, region non-empty and inside both chunks.
RunPlan MakeRunPlan(const Box& a, const Box& b, const Box& region, size_t element_size) {
  const size_t rank = region.rank();
  // The run starts at the last dimension where the region is not the full extent of both chunks.
  size_t run_dim = 0;
  for (size_t d = rank; d-- > 0;) {
    if (region.sizes[d] != a.sizes[d] || region.sizes[d] != b.sizes[d]) {
      run_dim = d;
      break;
    }
  }
  const std::vector<uint64_t> a_strides = ByteStrides(a, element_size);
  const std::vector<uint64_t> b_strides = ByteStrides(b, element_size);
  RunPlan plan;
  plan.run_bytes = element_size;
  for (size_t d = run_dim; d < rank; ++d) plan.run_bytes *= static_cast<uint64_t>(region.sizes[d]);
  plan.run_count = 1;
  for (size_t d = 0; d < rank; ++d) {
    plan.a_base += static_cast<uint64_t>(region.offsets[d] - a.offsets[d]) * a_strides[d];
    plan.b_base += static_cast<uint64_t>(region.offsets[d] - b.offsets[d]) * b_strides[d];
    if (d < run_dim && region.sizes[d] > 1) {
      plan.extents.push_back(static_cast<uint64_t>(region.sizes[d]));
      plan.a_strides.push_back(a_strides[d]);
      plan.b_strides.push_back(b_strides[d]);
      plan.run_count *= static_cast<uint64_t>(region.sizes[d]);
    }
  }
  return plan;
}

// Calls fn(a_offset, b_offset) for runs [first, first + count) in row-major order.
template <typename Fn>
void WalkRuns(const RunPlan& plan, uint64_t first, uint64_t count, Fn&& fn) {
  const size_t n = plan.extents.size();
  std::vector<uint64_t> index(n);
  uint64_t a = plan.a_base;
  uint64_t b = plan.b_base;
  for (size_t d = n; d-- > 0;) {
    index[d] = first % plan.extents[d];
    first /= plan.extents[d];
    a += index[d] * plan.a_strides[d];
    b += index[d] * plan.b_strides[d];
  }
  for (uint64_t i = 0; i < count; ++i) {
    fn(a, b);
    for (size_t d = n; d-- > 0;) {
      a += plan.a_strides[d];
      b += plan.b_strides[d];
      if (++index[d] < plan.extents[d]) break;
      a -= plan.a_strides[d] * plan.extents[d];
      b -= plan.b_strides[d] * plan.extents[d];
      index[d] = 0;
    }
  }
}

Status ValidateCopy(const ConstChunkView& src, const ChunkView& dst, const Box& region) {
  const bool ranks_match = src.box.rank() == region.rank() && dst.box.rank() == region.rank() &&
                           region.offsets.size() == region.rank();
  const bool sizes_valid =
      std::all_of(region.sizes.begin(), region.sizes.end(), [](int64_t s) { return s >= 0; });
  if (!ranks_match || !sizes_valid || !Contains(src.box, region) || !Contains(dst.box, region)) {
    return InvalidArgumentError("copy region " + region.ToString() +
                                " must lie inside the source chunk " + src.box.ToString() +
                                " and the destination chunk " + dst.box.ToString());
  }
  if (src.element_size != dst.element_size || src.element_size == 0) {
    return InvalidArgumentError("copy region " + region.ToString() + ": element size " +
                                std::to_string(src.element_size) + " of the source differs from " +
                                std::to_string(dst.element_size) + " of the destination");
  }
  return OkStatus();
}

// Splits one long contiguous run into `parts` byte ranges copied in parallel.
Status CopySingleRunParallel(const std::byte* src, std::byte* dst, uint64_t bytes, int parts,
                             ThreadPool* pool) {
  return ParallelFor(pool, parts, [&](int64_t i) {
    const uint64_t begin = bytes * static_cast<uint64_t>(i) / static_cast<uint64_t>(parts);
    const uint64_t end = bytes * static_cast<uint64_t>(i + 1) / static_cast<uint64_t>(parts);
    std::memcpy(dst + begin, src + begin, end - begin);
    return OkStatus();
  });
}

}  // namespace

Status CopyRegion(const ConstChunkView& src, const ChunkView& dst, const Box& region,
                  ThreadPool* pool, size_t parallel_min_bytes) {
  SP_RETURN_IF_ERROR(ValidateCopy(src, dst, region));
  if (region.empty()) return OkStatus();
  const RunPlan plan = MakeRunPlan(src.box, dst.box, region, src.element_size);
  const std::byte* src_data = src.data;
  std::byte* dst_data = dst.data;
  const uint64_t run_bytes = plan.run_bytes;
  auto copy_run = [src_data, dst_data, run_bytes](uint64_t s, uint64_t d) {
    std::memcpy(dst_data + d, src_data + s, run_bytes);
  };
  const uint64_t total = plan.run_bytes * plan.run_count;
  const bool parallel = pool != nullptr && pool->size() > 1 && total >= parallel_min_bytes;
  if (!parallel) {
    WalkRuns(plan, 0, plan.run_count, copy_run);
    return OkStatus();
  }
  if (plan.run_count == 1) {
    return CopySingleRunParallel(src_data + plan.a_base, dst_data + plan.b_base, run_bytes,
                                 pool->size(), pool);
  }
  const uint64_t parts = std::min<uint64_t>(pool->size(), plan.run_count);
  return ParallelFor(pool, static_cast<int64_t>(parts), [&](int64_t i) {
    const uint64_t begin = plan.run_count * static_cast<uint64_t>(i) / parts;
    const uint64_t end = plan.run_count * static_cast<uint64_t>(i + 1) / parts;
    WalkRuns(plan, begin, end - begin, copy_run);
    return OkStatus();
  });
}

void ForEachByteRun(const Box& chunk, const Box& region, size_t element_size,
                    const std::function<void(uint64_t, uint64_t)>& fn) {
  if (chunk.rank() != region.rank() || region.empty() || !Contains(chunk, region)) return;
  const RunPlan plan = MakeRunPlan(chunk, chunk, region, element_size);
  uint64_t pending_offset = 0;
  uint64_t pending_length = 0;
  WalkRuns(plan, 0, plan.run_count, [&](uint64_t offset, uint64_t) {
    if (pending_length != 0 && pending_offset + pending_length == offset) {
      pending_length += plan.run_bytes;
      return;
    }
    if (pending_length != 0) fn(pending_offset, pending_length);
    pending_offset = offset;
    pending_length = plan.run_bytes;
  });
  if (pending_length != 0) fn(pending_offset, pending_length);
}

RunSummary SummarizeByteRuns(const Box& chunk, const Box& region, size_t element_size) {
  RunSummary summary{0, 0, 0, 0};
  if (chunk.rank() != region.rank() || region.empty() || !Contains(chunk, region)) return summary;
  const RunPlan plan = MakeRunPlan(chunk, chunk, region, element_size);
  uint64_t last = plan.a_base;
  for (size_t d = 0; d < plan.extents.size(); ++d) last += (plan.extents[d] - 1) * plan.a_strides[d];
  summary.runs = plan.run_count;
  summary.first_byte = plan.a_base;
  summary.end_byte = last + plan.run_bytes;
  summary.bytes = plan.run_bytes * plan.run_count;
  return summary;
}

namespace {

// Whether `region` is non-empty and lies inside both boxes, all three of one rank.
bool CopyFits(const Box& src, const Box& dst, const Box& region) {
  return src.rank() == region.rank() && dst.rank() == region.rank() && !region.empty() &&
         Contains(src, region) && Contains(dst, region);
}

}  // namespace

CopyRuns SummarizeCopyRuns(const Box& src, const Box& dst, const Box& region,
                           size_t element_size) {
  if (!CopyFits(src, dst, region)) return CopyRuns{0, 0};
  const RunPlan plan = MakeRunPlan(src, dst, region, element_size);
  return CopyRuns{plan.run_bytes, plan.run_count};
}

void ForEachCopyRun(const Box& src, const Box& dst, const Box& region, size_t element_size,
                    const std::function<void(uint64_t, uint64_t)>& fn) {
  if (!CopyFits(src, dst, region)) return;
  const RunPlan plan = MakeRunPlan(src, dst, region, element_size);
  WalkRuns(plan, 0, plan.run_count, fn);
}

}  // namespace sp
