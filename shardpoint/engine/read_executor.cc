#include "shardpoint/engine/read_executor.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/geometry/convert.h"
#include "shardpoint/geometry/strided_copy.h"

namespace sp {
namespace {

constexpr uint64_t kReadTaskBytes = uint64_t{16} << 20;

// Reusable staging buffers for one call; at most one per running task.
class StagingPool {
 public:
  AlignedBuffer Acquire(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].size() >= size) {
        AlignedBuffer out = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return out;
      }
    }
    return AlignedBuffer(size);
  }
  void Release(AlignedBuffer buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(buffer));
  }

 private:
  std::mutex mu_;
  std::vector<AlignedBuffer> free_;
};

// One read the executor will issue: its byte range (for read-ahead) and the work itself.
struct Task {
  const ReadableFile* file;
  uint64_t offset;
  uint64_t length;
  std::function<Status()> run;
};

// Keeps the store fetching about kReadAheadBytes beyond the reads that have started, in the
// order the tasks were queued, so that the device always has work queued.
class ReadAhead {
 public:
  explicit ReadAhead(const std::vector<Task>& tasks) : tasks_(tasks) {
    uint64_t pos = 0;
    for (const Task& t : tasks_) {
      starts_.push_back(pos);
      pos += t.length;
    }
  }
  // Called when task i starts. Ranges of consecutive tasks that are adjacent (or nearly) in one
  // file are merged into one hint, so that the device sees large requests.
  void Advance(size_t i) {
    struct Hint {
      const ReadableFile* file;
      uint64_t begin;
      uint64_t end;
    };
    std::vector<Hint> hints;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t horizon = starts_[i] + tasks_[i].length + kReadAheadBytes;
      while (next_ < tasks_.size() && starts_[next_] < horizon) {
        const Task& t = tasks_[next_++];
        if (!hints.empty() && hints.back().file == t.file &&
            t.offset <= hints.back().end + kMergeGapBytes &&
            t.offset + kMergeGapBytes >= hints.back().begin) {
          hints.back().begin = std::min(hints.back().begin, t.offset);
          hints.back().end = std::max(hints.back().end, t.offset + t.length);
        } else {
          hints.push_back(Hint{t.file, t.offset, t.offset + t.length});
        }
      }
    }
    // Outside the lock: a hint may block while the store queues its reads.
    for (const Hint& h : hints) h.file->Prefetch(h.begin, h.end - h.begin);
  }

 private:
  static constexpr uint64_t kReadAheadBytes = uint64_t{64} << 20;
  static constexpr uint64_t kMergeGapBytes = uint64_t{1} << 20;
  const std::vector<Task>& tasks_;
  std::vector<uint64_t> starts_;
  std::mutex mu_;
  size_t next_ = 0;
};

struct Job {
  Job(const CheckpointMetadata& metadata_in,
      const std::vector<std::unique_ptr<ReadableFile>>& files_in, ReadExecutorOptions options_in)
      : metadata(metadata_in), files(files_in), options(options_in) {}

  const CheckpointMetadata& metadata;
  const std::vector<std::unique_ptr<ReadableFile>>& files;
  ReadExecutorOptions options;
  StagingPool staging;
  std::atomic<uint64_t> bytes_read{0};
};

StoredChunkRef RefFor(const Job& job, const ReadRequest& r) {
  const DataFile& file = job.metadata.files[r.chunk->file];
  return StoredChunkRef{job.files[r.chunk->file].get(), r.stored, r.chunk,
                        file.data_start + r.chunk->data_offset, job.metadata.checksum_block_bytes};
}

}  // namespace

Status CopyToDestination(const ConstChunkView& src, const Box& region, const ReadRequest& r) {
  const DType stored = r.stored->dtype;
  const DType wanted = r.dest->dtype;
  ChunkView dst{r.piece->data, r.piece->box, DTypeSize(wanted)};
  if (stored == wanted) return CopyRegion(src, dst, region);
  const int64_t count = region.volume();
  AlignedBuffer packed(static_cast<size_t>(count) * DTypeSize(stored));
  AlignedBuffer converted(static_cast<size_t>(count) * DTypeSize(wanted));
  SP_RETURN_IF_ERROR(CopyRegion(src, ChunkView{packed.data(), region, DTypeSize(stored)}, region));
  SP_RETURN_IF_ERROR(ConvertElements(stored, packed.data(), wanted, converted.data(), count)
                         .WithContext("tensor '" + r.dest->name + "'"));
  return CopyRegion(ConstChunkView{converted.data(), region, DTypeSize(wanted)}, dst, region);
}

namespace {

// Bytes per index step along each dim of a row-major chunk box.
std::vector<uint64_t> Strides(const Box& chunk, size_t element_size) {
  std::vector<uint64_t> step(chunk.rank());
  if (chunk.rank() == 0) return step;
  step.back() = element_size;
  for (size_t d = chunk.rank() - 1; d > 0; --d) step[d - 1] = step[d] * chunk.sizes[d];
  return step;
}

// A sub-box of a stored chunk, contiguous in the chunk's bytes [begin, end).
struct Slab {
  Box box;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The rows of `chunk` (along dim 0) that `region` spans: the smallest contiguous sub-box
// containing the region when rows are the unit.
Slab RowCover(const Box& chunk, const Box& region, size_t element_size) {
  if (chunk.rank() == 0) return Slab{chunk, 0, element_size};
  const uint64_t row = Strides(chunk, element_size)[0];
  Slab s{chunk, 0, 0};
  s.box.offsets[0] = region.offsets[0];
  s.box.sizes[0] = region.sizes[0];
  s.begin = static_cast<uint64_t>(region.offsets[0] - chunk.offsets[0]) * row;
  s.end = s.begin + static_cast<uint64_t>(region.sizes[0]) * row;
  return s;
}

// Cuts `region` of `chunk` into contiguous slabs of at most `window` bytes (at least one index
// step of the first dim whose step fits).
std::vector<Slab> CutSlabs(const Box& chunk, const Box& region, size_t element_size,
                           uint64_t window) {
  const size_t n = chunk.rank();
  if (n == 0) return {Slab{chunk, 0, element_size}};
  const std::vector<uint64_t> step = Strides(chunk, element_size);
  size_t k = 0;
  while (k + 1 < n && step[k] > window) ++k;
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(window / step[k]));
  std::vector<Slab> slabs;
  std::vector<int64_t> prefix(region.offsets.begin(), region.offsets.begin() + k);
  for (;;) {
    for (int64_t lo = region.offsets[k]; lo < region.exclusive_max(k); lo += rows) {
      Slab s{chunk, 0, 0};
      for (size_t d = 0; d < k; ++d) {
        s.box.offsets[d] = prefix[d];
        s.box.sizes[d] = 1;
      }
      s.box.offsets[k] = lo;
      s.box.sizes[k] = std::min<int64_t>(rows, region.exclusive_max(k) - lo);
      for (size_t d = 0; d <= k; ++d) {
        s.begin += static_cast<uint64_t>(s.box.offsets[d] - chunk.offsets[d]) * step[d];
      }
      s.end = s.begin + static_cast<uint64_t>(s.box.sizes[k]) * step[k];
      slabs.push_back(std::move(s));
    }
    size_t d = k;  // odometer over the prefix dims
    for (;;) {
      if (d == 0) return slabs;
      --d;
      if (++prefix[d] < region.exclusive_max(d)) break;
      prefix[d] = region.offsets[d];
    }
  }
}

Status ReadSlab(Job& job, const ReadRequest& r, const Slab& slab) {
  AlignedBuffer buffer = job.staging.Acquire(slab.end - slab.begin);
  Status status = [&]() -> Status {
    SP_RETURN_IF_ERROR(ReadChunkBytes(RefFor(job, r), slab.begin, slab.end, buffer.data(),
                                      job.options.verify, &job.bytes_read));
    std::optional<Box> part = Intersect(r.region, slab.box);
    if (!part) return OkStatus();
    return CopyToDestination(ConstChunkView{buffer.data(), slab.box, DTypeSize(r.stored->dtype)},
                             *part, r);
  }();
  job.staging.Release(std::move(buffer));
  return status;
}

// One read widened to whole rows and whole checksum blocks, for coalescing.
struct Staged {
  const ReadRequest* request;
  Slab rows;             // chunk-relative
  uint64_t file_begin;   // absolute, block-rounded
  uint64_t file_end;
};

struct Span {
  uint32_t file;
  uint64_t begin;
  uint64_t end;
  std::vector<const Staged*> reads;
};

Status ReadSpan(Job& job, const Span& span) {
  AlignedBuffer buffer = job.staging.Acquire(span.end - span.begin);
  Status status = [&]() -> Status {
    SP_RETURN_IF_ERROR(job.files[span.file]->ReadAt(
        span.begin, MutableByteView(buffer.data(), span.end - span.begin)));
    job.bytes_read.fetch_add(span.end - span.begin, std::memory_order_relaxed);
    std::set<std::pair<const StoredChunk*, uint64_t>> verified;
    for (const Staged* s : span.reads) {
      const ReadRequest& r = *s->request;
      const StoredChunkRef ref = RefFor(job, r);
      const uint64_t bs = ref.block_bytes;
      if (job.options.verify) {
        for (uint64_t b = s->rows.begin / bs; b * bs < s->rows.end; ++b) {
          if (!verified.insert({r.chunk, b}).second) continue;
          const std::byte* at = buffer.data() + (ref.file_offset + b * bs - span.begin);
          SP_RETURN_IF_ERROR(VerifyBlocks(ref, b, b + 1, at));
        }
      }
      const std::byte* rows = buffer.data() + (ref.file_offset + s->rows.begin - span.begin);
      SP_RETURN_IF_ERROR(
          CopyToDestination(ConstChunkView{rows, s->rows.box, DTypeSize(r.stored->dtype)},
                            r.region, r));
    }
    return OkStatus();
  }();
  job.staging.Release(std::move(buffer));
  return status;
}

// The bytes a verified read of chunk bytes [lo, hi) touches: whole checksum blocks, since the
// edges of partial blocks are read to complete their checksums. For read-ahead.
std::pair<uint64_t, uint64_t> TouchedRange(const Job& job, const StoredChunkRef& ref, uint64_t lo,
                                           uint64_t hi) {
  if (!job.options.verify || lo == hi) return {ref.file_offset + lo, hi - lo};
  const uint64_t bs = ref.block_bytes;
  const uint64_t begin = lo / bs * bs;
  const uint64_t end = std::min(ref.chunk->byte_length, (hi + bs - 1) / bs * bs);
  return {ref.file_offset + begin, end - begin};
}

void AddDirect(Job& job, const ReadRequest& r, const RunSummary& src, const RunSummary& dst,
               std::vector<Task>& tasks) {
  const StoredChunkRef ref = RefFor(job, r);
  const uint64_t bs = std::max<uint64_t>(1, job.metadata.checksum_block_bytes);
  const uint64_t step = std::max<uint64_t>(bs, kReadTaskBytes / bs * bs);
  for (uint64_t lo = src.first_byte; lo < src.end_byte;) {
    const uint64_t hi = std::min(src.end_byte, (lo / step + 1) * step);
    std::byte* out = r.piece->data + dst.first_byte + (lo - src.first_byte);
    const auto [offset, length] = TouchedRange(job, ref, lo, hi);
    tasks.push_back(Task{ref.file, offset, length, [&job, ref, lo, hi, out] {
      return ReadChunkBytes(ref, lo, hi, out, job.options.verify, &job.bytes_read);
    }});
    lo = hi;
  }
}

// Reads a driver-decoded chunk whole, decodes it, and serves every request that needs it.
Status ReadDecodedChunk(Job& job, const std::vector<const ReadRequest*>& requests) {
  const ReadRequest& first = *requests.front();
  const StoredChunk& chunk = *first.chunk;
  const DataFile& file = job.metadata.files[chunk.file];
  AlignedBuffer stored = job.staging.Acquire(chunk.stored_length);
  AlignedBuffer decoded(chunk.byte_length);
  Status status = [&]() -> Status {
    SP_RETURN_IF_ERROR(job.files[chunk.file]->ReadAt(
        file.data_start + chunk.data_offset, MutableByteView(stored.data(), chunk.stored_length)));
    job.bytes_read.fetch_add(chunk.stored_length, std::memory_order_relaxed);
    SP_RETURN_IF_ERROR(DecodeStoredChunk(job.metadata, *first.stored, chunk,
                                         ByteView(stored.data(), chunk.stored_length),
                                         decoded.data()));
    for (const ReadRequest* r : requests) {
      SP_RETURN_IF_ERROR(CopyToDestination(ConstChunkView{decoded.data(), chunk.box,
                                                DTypeSize(r->stored->dtype)},
                                 r->region, *r));
    }
    return OkStatus();
  }();
  job.staging.Release(std::move(stored));
  return status;
}

// Merges the staged reads of each file into spans of at most `window` bytes.
std::vector<Span> Coalesce(std::vector<Staged>& staged, uint64_t window, uint64_t max_gap) {
  std::sort(staged.begin(), staged.end(), [](const Staged& a, const Staged& b) {
    if (a.request->chunk->file != b.request->chunk->file) {
      return a.request->chunk->file < b.request->chunk->file;
    }
    return a.file_begin < b.file_begin;
  });
  std::vector<Span> spans;
  for (const Staged& s : staged) {
    const uint32_t file = s.request->chunk->file;
    if (!spans.empty()) {
      Span& last = spans.back();
      const uint64_t end = std::max(last.end, s.file_end);
      if (last.file == file && s.file_begin <= last.end + max_gap &&
          end - last.begin <= window) {
        last.end = end;
        last.reads.push_back(&s);
        continue;
      }
    }
    spans.push_back(Span{file, s.file_begin, s.file_end, {&s}});
  }
  return spans;
}

}  // namespace

Result<uint64_t> ExecuteReads(std::span<const ReadRequest> requests,
                              const CheckpointMetadata& metadata,
                              const std::vector<std::unique_ptr<ReadableFile>>& files,
                              ThreadPool& pool, const ReadExecutorOptions& options) {
  // A format without checksums (block size 0) is read unverified, with no block rounding.
  ReadExecutorOptions effective = options;
  effective.verify = options.verify && metadata.checksum_block_bytes > 0;
  Job job(metadata, files, effective);
  const uint64_t bs = std::max<uint64_t>(1, metadata.checksum_block_bytes);
  std::vector<Staged> staged;
  std::vector<Task> tasks;
  std::map<const StoredChunk*, std::vector<const ReadRequest*>> decoded;
  // A chunk that several requests need is read through coalesced spans, so that the checksum
  // blocks they share are read once.
  std::map<const StoredChunk*, int> users;
  for (const ReadRequest& r : requests) ++users[r.chunk];
  for (const ReadRequest& r : requests) {
    if (r.chunk->encoding == ChunkEncoding::kDriverDecoded) {
      decoded[r.chunk].push_back(&r);
      continue;
    }
    const size_t es = DTypeSize(r.stored->dtype);
    if (r.stored->dtype == r.dest->dtype) {
      RunSummary src = SummarizeByteRuns(r.chunk->box, r.region, es);
      RunSummary dst = SummarizeByteRuns(r.piece->box, r.region, es);
      if (src.runs == 1 && dst.runs == 1 && src.bytes >= kDirectMinBytes &&
          users[r.chunk] == 1) {
        AddDirect(job, r, src, dst, tasks);
        continue;
      }
    }
    Slab rows = RowCover(r.chunk->box, r.region, es);
    if (rows.end - rows.begin > options.window) {
      const StoredChunkRef ref = RefFor(job, r);
      for (Slab& slab : CutSlabs(r.chunk->box, r.region, es, options.window)) {
        const auto [offset, length] = TouchedRange(job, ref, slab.begin, slab.end);
        tasks.push_back(Task{ref.file, offset, length,
                             [&job, &r, slab] { return ReadSlab(job, r, slab); }});
      }
      continue;
    }
    const uint64_t file_offset = RefFor(job, r).file_offset;
    const uint64_t lo = rows.begin / bs * bs;
    const uint64_t hi = std::min(r.chunk->byte_length, (rows.end + bs - 1) / bs * bs);
    staged.push_back(Staged{&r, std::move(rows), file_offset + lo, file_offset + hi});
  }
  const std::vector<Span> spans =
      Coalesce(staged, std::max(std::min(options.window, kMaxSpanBytes), bs),
               options.max_gap_bytes);
  for (const Span& span : spans) {
    tasks.push_back(Task{files[span.file].get(), span.begin, span.end - span.begin,
                         [&job, &span] { return ReadSpan(job, span); }});
  }
  for (const auto& [chunk, users] : decoded) {
    const uint64_t offset = metadata.files[chunk->file].data_start + chunk->data_offset;
    tasks.push_back(Task{files[chunk->file].get(), offset, chunk->stored_length,
                         [&job, &users] { return ReadDecodedChunk(job, users); }});
  }
  ReadAhead read_ahead(tasks);
  TaskGroup group(&pool);
  for (size_t i = 0; i < tasks.size(); ++i) {
    group.Run([&read_ahead, &tasks, i] {
      read_ahead.Advance(i);
      return tasks[i].run();
    });
  }
  SP_RETURN_IF_ERROR(group.Wait());
  return job.bytes_read.load();
}

}  // namespace sp
