#include "shardpoint/engine/read_executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/engine/header_checksums.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/geometry/convert.h"
#include "shardpoint/geometry/strided_copy.h"

namespace sp {
namespace {

class DepthSlot;

// One read the executor will issue: its byte range (for ordering) and the work itself.
struct Task {
  const ReadableFile* file;
  uint64_t offset;  // where its reads begin: orders the tasks
  uint64_t bytes;   // how many it reads (for the tuner's measurements)
  std::function<Status(DepthSlot&)> run;
};

// A read's place at the tuner's gate. The task gives it back (Done) as soon as its bytes have
// arrived, before verifying and copying them, so that the next read is in flight while this
// thread works on the bytes (with more threads than the depth, the device never waits for the
// CPU); or, at the latest, when the task ends however it ends.
class DepthSlot {
 public:
  DepthSlot(IoGate& gate, uint64_t bytes) : gate_(gate), bytes_(bytes) { gate_.Acquire(); }
  ~DepthSlot() { Done(); }
  DepthSlot(const DepthSlot&) = delete;
  DepthSlot& operator=(const DepthSlot&) = delete;

  void Done() {
    if (held_) gate_.Release(bytes_);
    held_ = false;
  }

 private:
  IoGate& gate_;
  uint64_t bytes_;
  bool held_ = true;
};

struct Job {
  Job(const CheckpointMetadata& metadata_in,
      const std::vector<std::unique_ptr<ReadableFile>>& files_in, ReadExecutorOptions options_in,
      BufferPool& staging_in, uint64_t span_in, std::vector<char> direct_files_in)
      : metadata(metadata_in), files(files_in), options(options_in), staging(staging_in),
        span(span_in), direct_files(std::move(direct_files_in)) {}

  const CheckpointMetadata& metadata;
  const std::vector<std::unique_ptr<ReadableFile>>& files;
  ReadExecutorOptions options;
  BufferPool& staging;  // the pool's: shared with its other callers
  uint64_t span;        // file bytes per extent at most
  std::vector<char> direct_files;  // per file: its large extents are read directly
  // Where the metadata holds no checksums and the reads verify: those of the files' headers,
  // once `headers_read` (when set) says they have been read (AwaitChecksums).
  const HeaderChecksums* header_checksums = nullptr;
  const std::shared_future<Status>* headers_read = nullptr;
  std::atomic<uint64_t> bytes_read{0};

  // Waits until the headers' checksums can be used, before a task verifies: their reading's
  // status (an error names the file whose header failed).
  Status AwaitChecksums() const {
    return headers_read == nullptr ? OkStatus() : headers_read->get();
  }
};

StoredChunkRef RefFor(const Job& job, const ReadRequest& r) {
  const DataFile& file = job.metadata.files[r.chunk->file];
  return StoredChunkRef{job.files[r.chunk->file].get(), r.stored, r.chunk,
                        file.data_start + r.chunk->data_offset, job.metadata.checksum_block_bytes,
                        job.header_checksums != nullptr
                            ? job.header_checksums->Of(*r.chunk)
                            : OwnChecksums(*r.chunk)};
}

}  // namespace

ReadRequest MakeReadRequest(const TensorMetadata& stored, size_t chunk, ReadDestination dest,
                            Box region) {
  return ReadRequest{&stored, &stored.chunks[chunk], std::move(dest), std::move(region)};
}

Status CopyToDestination(const ConstChunkView& src, const Box& region, const ReadRequest& r) {
  const DType stored = r.stored->dtype;
  const DType wanted = r.dest.dtype;
  ChunkView dst{r.dest.data, r.dest.box, DTypeSize(wanted)};
  if (stored == wanted) return CopyRegion(src, dst, region);
  const int64_t count = region.volume();
  AlignedBuffer packed(static_cast<size_t>(count) * DTypeSize(stored));
  AlignedBuffer converted(static_cast<size_t>(count) * DTypeSize(wanted));
  SP_RETURN_IF_ERROR(CopyRegion(src, ChunkView{packed.data(), region, DTypeSize(stored)}, region));
  SP_RETURN_IF_ERROR(ConvertElements(stored, packed.data(), wanted, converted.data(), count)
                         .WithContext("tensor '" + r.stored->name + "'"));
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

// A slab of one chunk and the sliced reads it serves: read once, whatever their count (ranks
// that split a large chunk's columns each take the same rows).
struct SharedSlab {
  Slab slab;
  std::vector<const ReadRequest*> users;
};

Status ReadSlab(Job& job, const SharedSlab& shared) {
  const Slab& slab = shared.slab;
  AlignedBuffer buffer = job.staging.Acquire(slab.end - slab.begin);
  Status status = [&]() -> Status {
    if (job.options.verify) SP_RETURN_IF_ERROR(job.AwaitChecksums());
    SP_RETURN_IF_ERROR(ReadChunkBytes(RefFor(job, *shared.users.front()), slab.begin, slab.end,
                                      buffer.data(), job.options.verify, &job.bytes_read));
    for (const ReadRequest* r : shared.users) {
      std::optional<Box> part = Intersect(r->region, slab.box);
      if (!part) continue;
      SP_RETURN_IF_ERROR(CopyToDestination(
          ConstChunkView{buffer.data(), slab.box, DTypeSize(r->stored->dtype)}, *part, *r));
    }
    return OkStatus();
  }();
  job.staging.Release(std::move(buffer));
  return status;
}

// A read into staging: whole rows of the request's chunk, widened to whole checksum blocks.
struct Staged {
  const ReadRequest* request;
  Slab rows;                // chunk-relative
  uint64_t file_begin;      // absolute, block-rounded
  uint64_t file_end;
  uint64_t staging = 0;     // where file_begin lands in its extent's staging buffer
};

// A read straight into the destination: chunk bytes [lo, hi) to `out`. With verification the
// partial checksum blocks at either end are completed from staging: [file_begin, file_end) is
// the block-rounded range.
struct Direct {
  const ReadRequest* request;
  uint64_t lo;
  uint64_t hi;
  std::byte* out;
  uint64_t file_begin;
  uint64_t file_end;
};

// One piece of a scattered read: file bytes [begin, end) land at `dest`.
struct Piece {
  uint64_t begin;
  uint64_t end;
  std::byte* dest;
};

// A scattered read: file bytes [file_begin, file_end) of one chunk (chunk bytes [lo, hi),
// whole checksum blocks when verifying), its pieces in file order, the rest into staging.
// `request` is one of the chunk's requests (for its chunk).
struct Scattered {
  const ReadRequest* request;
  uint64_t lo;
  uint64_t hi;
  uint64_t file_begin;
  uint64_t file_end;
  std::vector<Piece> pieces;
};

// A part of an extent: file bytes [begin, end) land at `dest`, or in staging at `staging`.
struct Segment {
  uint64_t begin;
  uint64_t end;
  std::byte* dest;
  uint64_t staging;
};

// Consecutive bytes of one file read with one scatter read: the direct reads land in their
// destinations, everything else (staged rows, block edges, gaps read through) in one staging
// buffer, in file order.
struct Extent {
  uint32_t file;
  uint64_t begin;
  uint64_t end;
  uint64_t staging_bytes = 0;
  std::vector<Segment> segments;  // in file order, covering [begin, end)
  std::vector<Staged*> staged;
  std::vector<const Direct*> direct;
  std::vector<const Scattered*> scattered;

  void AddStaging(uint64_t from, uint64_t to) {
    if (from >= to) return;
    if (!segments.empty() && segments.back().dest == nullptr && segments.back().end == from) {
      segments.back().end = to;
    } else {
      segments.push_back(Segment{from, to, nullptr, staging_bytes});
    }
    staging_bytes += to - from;
    end = to;
  }
  void AddDest(uint64_t from, uint64_t to, std::byte* dest) {
    if (from >= to) return;
    segments.push_back(Segment{from, to, dest, 0});
    end = to;
  }
};

// What one extent may hold.
struct ExtentLimits {
  uint64_t bytes;          // file bytes per extent
  uint64_t staging_bytes;  // staging bytes per extent
  uint64_t max_gap;        // unneeded bytes read through between two reads
};

// Groups reads of one file, sorted by file offset, into extents. A read may join the open extent
// when it starts where the extent ends and the extent stays within the limits; a staged read may
// also read through a gap of up to max_gap bytes after staged bytes (rows of one chunk a few
// rows apart), a scattered read after any bytes, and a staged read overlapping the extent's
// staged tail (checksum blocks shared with the previous rows) reuses those bytes. A direct read
// never reads through a gap: the bytes between two destinations are usually another rank's.
class ExtentBuilder {
 public:
  explicit ExtentBuilder(ExtentLimits limits) : limits_(limits) {}

  void Add(uint32_t file, Staged& s) {
    Extent* e = Joinable(file, s.file_begin, s.file_end, StagingAdded(file, s.file_begin, s.file_end),
                         StagedTail(file) ? limits_.max_gap : 0);
    if (e != nullptr && s.file_begin < e->end) {
      // Only the staged tail of the same chunk can overlap; anything else opens a new extent.
      const Segment& last = e->segments.back();
      if (last.dest != nullptr || last.begin > s.file_begin) e = nullptr;
    }
    if (e == nullptr) e = Open(file, s.file_begin);
    if (s.file_begin < e->end) {  // inside the staged tail: those bytes are read already
      const Segment& last = e->segments.back();
      s.staging = last.staging + (s.file_begin - last.begin);
    } else {
      e->AddStaging(e->end, s.file_begin);  // a gap, read through
      s.staging = e->staging_bytes;
    }
    if (s.file_end > e->end) e->AddStaging(e->end, s.file_end);
    e->staged.push_back(&s);
  }

  void Add(uint32_t file, const Direct& d, uint64_t dest_begin, uint64_t dest_end) {
    const uint64_t edges = (dest_begin - d.file_begin) + (d.file_end - dest_end);
    Extent* e = Joinable(file, d.file_begin, d.file_end,
                         StagingAdded(file, d.file_begin, d.file_begin) + edges, 0);
    if (e != nullptr && d.file_begin < e->end) e = nullptr;
    if (e == nullptr) e = Open(file, d.file_begin);
    e->AddStaging(e->end, d.file_begin);      // a gap, read through
    e->AddStaging(d.file_begin, dest_begin);  // the head of a partial first block
    e->AddDest(dest_begin, dest_end, d.out);
    e->AddStaging(dest_end, d.file_end);      // the tail of a partial last block
    e->direct.push_back(&d);
  }

  void Add(uint32_t file, const Scattered& s) {
    uint64_t in_place = 0;
    for (const Piece& p : s.pieces) in_place += p.end - p.begin;
    const uint64_t staged = (s.file_end - s.file_begin) - in_place;
    // Like a staged read (which it is, with its runs landing in place), it reads through a gap
    // of up to max_gap bytes after the open extent.
    Extent* e = Joinable(file, s.file_begin, s.file_end,
                         StagingAdded(file, s.file_begin, s.file_begin) + staged, limits_.max_gap);
    if (e != nullptr && s.file_begin < e->end) e = nullptr;
    if (e == nullptr) e = Open(file, s.file_begin);
    e->AddStaging(e->end, s.file_begin);  // a gap, read through
    for (const Piece& p : s.pieces) {
      e->AddStaging(e->end, p.begin);  // between runs: other columns, block edges
      e->AddDest(p.begin, p.end, p.dest);
    }
    e->AddStaging(e->end, s.file_end);
    e->scattered.push_back(&s);
  }

  std::vector<Extent> Take() { return std::move(extents_); }

 private:
  // The staging bytes that reading file bytes [begin, end) into staging would add to the open
  // extent (a gap before it included), when it is of `file`.
  uint64_t StagingAdded(uint32_t file, uint64_t begin, uint64_t end) const {
    if (extents_.empty() || extents_.back().file != file) return end - begin;
    return std::max(end, extents_.back().end) - extents_.back().end;
  }

  // Whether the open extent is of `file` and ends with staged bytes.
  bool StagedTail(uint32_t file) const {
    return !extents_.empty() && extents_.back().file == file &&
           !extents_.back().segments.empty() && extents_.back().segments.back().dest == nullptr;
  }

  // The open extent when a read of [begin, end) adding `staging` bytes may join it, reading
  // through a gap of at most `max_gap` bytes.
  Extent* Joinable(uint32_t file, uint64_t begin, uint64_t end, uint64_t staging,
                   uint64_t max_gap) {
    if (extents_.empty()) return nullptr;
    Extent& e = extents_.back();
    if (e.file != file || begin > e.end + max_gap) return nullptr;
    if (std::max(e.end, end) - e.begin > limits_.bytes) return nullptr;
    if (e.staging_bytes + staging > limits_.staging_bytes) return nullptr;
    return &e;
  }

  Extent* Open(uint32_t file, uint64_t begin) {
    Extent& e = extents_.emplace_back();
    e.file = file;
    e.begin = begin;
    e.end = begin;
    return &e;
  }

  ExtentLimits limits_;
  std::vector<Extent> extents_;
};

// The first byte of file bytes [x, ...) of `segments` (in file order, covering x), which lie in
// their destinations or in staging at `staging`; the bytes up to the end of x's segment follow it.
const std::byte* BytesAt(std::span<const Segment> segments, const std::byte* staging, uint64_t x) {
  auto it = std::upper_bound(segments.begin(), segments.end(), x,
                             [](uint64_t v, const Segment& s) { return v < s.begin; });
  --it;
  const std::byte* base = it->dest != nullptr ? it->dest : staging + it->staging;
  return base + (x - it->begin);
}

// CRC32C of file bytes [from, to) of `segments` (as above).
uint32_t SegmentsCrc(std::span<const Segment> segments, const std::byte* staging, uint64_t from,
                     uint64_t to) {
  uint32_t crc = 0;
  auto it = std::upper_bound(segments.begin(), segments.end(), from,
                             [](uint64_t x, const Segment& s) { return x < s.begin; });
  if (it != segments.begin()) --it;
  for (; it != segments.end() && it->begin < to; ++it) {
    const uint64_t lo = std::max(from, it->begin);
    const uint64_t hi = std::min(to, it->end);
    if (lo >= hi) continue;
    const std::byte* base = it->dest != nullptr ? it->dest : staging + it->staging;
    crc = Crc32cExtend(crc, base + (lo - it->begin), hi - lo);
  }
  return crc;
}

// The alignment to read extent `e` with direct I/O, or 0 to read it through the page cache.
uint64_t DirectAlignment(const Job& job, const Extent& e) {
  if (!job.direct_files[e.file] || e.end - e.begin < job.options.direct_io_min_bytes) return 0;
  const uint64_t a = job.files[e.file]->direct_io_alignment();
  if (a == 0) return 0;
  const uint64_t widened = (e.end + a - 1) / a * a - e.begin / a * a;
  return widened <= job.options.window ? a : 0;
}

// Where the bytes of extent `e`, widened to the alignment `a`, land when it is read with direct
// I/O: a destination whose address and file offset agree modulo `a` gets the whole aligned blocks
// of its bytes in place; everything else (its partial blocks, other destinations, staged reads,
// gaps, the widening) lands in staging, and destinations get those bytes by copy.
struct DirectLayout {
  uint64_t begin = 0;  // e.begin rounded down to `a`
  uint64_t end = 0;    // e.end rounded up to `a`
  std::vector<Segment> segments;  // in file order, covering [begin, end); staging ones aligned
  uint64_t staging_bytes = 0;
};

DirectLayout LayOutDirect(const Job& job, const Extent& e, uint64_t a) {
  // Destinations in the staged range, where the device takes shorter requests into them.
  const bool small_pages = job.options.staged_from != job.options.staged_to &&
                           job.files[e.file]->small_pages_shorten_requests();
  auto staged = [&](const std::byte* dest) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(dest);
    return small_pages && at >= reinterpret_cast<uintptr_t>(job.options.staged_from) &&
           at < reinterpret_cast<uintptr_t>(job.options.staged_to);
  };
  DirectLayout out;
  out.begin = e.begin / a * a;
  out.end = (e.end + a - 1) / a * a;
  uint64_t cursor = out.begin;
  auto stage_to = [&](uint64_t to) {
    if (cursor >= to) return;
    out.segments.push_back(Segment{cursor, to, nullptr, out.staging_bytes});
    out.staging_bytes += to - cursor;
    cursor = to;
  };
  for (const Segment& s : e.segments) {
    if (s.dest == nullptr) continue;
    if (staged(s.dest)) continue;
    const uint64_t address = reinterpret_cast<uintptr_t>(s.dest) % a;
    if (address != s.begin % a) continue;
    const uint64_t lo = (s.begin + a - 1) / a * a;
    const uint64_t hi = s.end / a * a;
    if (lo >= hi) continue;
    stage_to(lo);
    out.segments.push_back(Segment{lo, hi, s.dest + (lo - s.begin), 0});
    cursor = hi;
  }
  stage_to(out.end);
  return out;
}

// Copies the bytes of destination segment `s` that `layout` put in staging into place.
void CopyStagedParts(const Segment& s, std::span<const Segment> layout, const std::byte* staging) {
  auto it = std::upper_bound(layout.begin(), layout.end(), s.begin,
                             [](uint64_t x, const Segment& l) { return x < l.begin; });
  if (it != layout.begin()) --it;
  for (; it != layout.end() && it->begin < s.end; ++it) {
    if (it->dest != nullptr) continue;  // read in place
    const uint64_t lo = std::max(s.begin, it->begin);
    const uint64_t hi = std::min(s.end, it->end);
    if (lo < hi) std::memcpy(s.dest + (lo - s.begin), staging + it->staging + (lo - it->begin), hi - lo);
  }
}

// How an extent is read: with direct I/O at alignment `a`, laid out as `direct`, or through the
// page cache (a = 0).
struct PlannedExtent {
  uint64_t a = 0;
  DirectLayout direct;

  uint64_t staging_bytes(const Extent& e) const {
    return a > 0 ? direct.staging_bytes : e.staging_bytes;
  }
};

PlannedExtent PlanExtent(const Job& job, const Extent& e) {
  PlannedExtent out;
  out.a = DirectAlignment(job, e);
  if (out.a > 0) out.direct = LayOutDirect(job, e, out.a);
  return out;
}

Status ReadExtent(Job& job, const Extent& e, const PlannedExtent& plan, DepthSlot& slot) {
  const uint64_t a = plan.a;
  const DirectLayout& direct = plan.direct;
  const std::span<const Segment> layout = a > 0 ? direct.segments : e.segments;
  const uint64_t staging_bytes = plan.staging_bytes(e);
  AlignedBuffer buffer;
  if (staging_bytes > 0) buffer = job.staging.Acquire(staging_bytes, a > 0 ? a : 4096);
  Status status = [&]() -> Status {
    std::vector<MutableByteView> pieces;
    pieces.reserve(layout.size());
    for (const Segment& s : layout) {
      std::byte* at = s.dest != nullptr ? s.dest : buffer.data() + s.staging;
      pieces.push_back(MutableByteView(at, s.end - s.begin));
    }
    const ReadableFile& file = *job.files[e.file];
    if (a > 0) {
      SP_ASSIGN_OR_RETURN(uint64_t n, file.ReadDirectVAt(direct.begin, pieces));
      if (n < e.end - direct.begin) {
        return DataLossError(OpAt("read", file.path(), e.begin) + ": wanted " +
                             std::to_string(e.end - e.begin) + " bytes but the file ends at " +
                             std::to_string(direct.begin + n));
      }
    } else {
      SP_RETURN_IF_ERROR(file.ReadVAt(e.begin, pieces));
    }
    slot.Done();
    job.bytes_read.fetch_add(e.end - e.begin, std::memory_order_relaxed);
    if (job.options.verify) {
      SP_RETURN_IF_ERROR(job.AwaitChecksums());
      // Each checksum block once, though several reads of one chunk may touch it.
      std::set<std::pair<const StoredChunk*, uint64_t>> verified;
      auto verify = [&](const ReadRequest& r, uint64_t lo, uint64_t hi) -> Status {
        const StoredChunkRef ref = RefFor(job, r);
        const uint64_t bs = ref.block_bytes;
        for (uint64_t b = lo / bs; b * bs < hi; ++b) {
          if (!verified.insert({r.chunk, b}).second) continue;
          const uint64_t block_end = std::min(r.chunk->byte_length, (b + 1) * bs);
          const uint64_t from = ref.file_offset + b * bs, to = ref.file_offset + block_end;
          SP_RETURN_IF_ERROR(CheckBlockCrc(ref, b, SegmentsCrc(layout, buffer.data(), from, to)));
        }
        return OkStatus();
      };
      for (const Staged* s : e.staged) {
        SP_RETURN_IF_ERROR(verify(*s->request, s->rows.begin, s->rows.end));
      }
      for (const Direct* d : e.direct) SP_RETURN_IF_ERROR(verify(*d->request, d->lo, d->hi));
      for (const Scattered* s : e.scattered) {
        SP_RETURN_IF_ERROR(verify(*s->request, s->lo, s->hi));
      }
    }
    if (a > 0) {
      for (const Segment& s : e.segments) {
        if (s.dest != nullptr) CopyStagedParts(s, layout, buffer.data());
      }
    }
    for (const Staged* s : e.staged) {
      const ReadRequest& r = *s->request;
      const std::byte* rows =
          BytesAt(layout, buffer.data(), RefFor(job, r).file_offset + s->rows.begin);
      SP_RETURN_IF_ERROR(
          CopyToDestination(ConstChunkView{rows, s->rows.box, DTypeSize(r.stored->dtype)},
                            r.region, r));
    }
    return OkStatus();
  }();
  if (buffer.size() > 0) job.staging.Release(std::move(buffer));
  return status;
}

// The bytes a verified read of chunk bytes [lo, hi) touches: whole checksum blocks, since the
// edges of partial blocks are read to complete their checksums.
std::pair<uint64_t, uint64_t> TouchedRange(const Job& job, const StoredChunkRef& ref, uint64_t lo,
                                           uint64_t hi) {
  if (!job.options.verify || lo == hi) return {ref.file_offset + lo, hi - lo};
  const uint64_t bs = ref.block_bytes;
  const uint64_t begin = lo / bs * bs;
  const uint64_t end = std::min(ref.chunk->byte_length, (hi + bs - 1) / bs * bs);
  return {ref.file_offset + begin, end - begin};
}

// Cuts a direct read at the file offsets that are multiples of job.span (at whole checksum
// blocks of its chunk): a large chunk spreads over the pool, and the reads of consecutive chunks
// group into extents of span bytes that begin at the same offsets, whatever the chunk sizes.
void AddDirect(Job& job, const ReadRequest& r, const RunSummary& src, const RunSummary& dst,
               std::deque<Direct>& out) {
  const StoredChunkRef ref = RefFor(job, r);
  const uint64_t bs = std::max<uint64_t>(1, job.metadata.checksum_block_bytes);
  for (uint64_t lo = src.first_byte; lo < src.end_byte;) {
    // The next multiple of span in the file, as a chunk offset, down to a block boundary.
    uint64_t cut = ((ref.file_offset + lo) / job.span + 1) * job.span - ref.file_offset;
    cut = cut / bs * bs;
    if (cut <= lo) cut = (lo / bs + 1) * bs;
    const uint64_t hi = std::min(src.end_byte, cut);
    std::byte* dest = r.dest.data + dst.first_byte + (lo - src.first_byte);
    const auto [offset, length] = TouchedRange(job, ref, lo, hi);
    out.push_back(Direct{&r, lo, hi, dest, offset, offset + length});
    lo = hi;
  }
}

// The scattered reads of the requests of one chunk (see read_executor.h), cut like direct reads
// at the file offsets that are multiples of job.span, or of the window when it is smaller (at
// whole checksum blocks); false when the chunk's requests do not qualify (a cast, a run shorter
// than scatter_min_run_bytes, overlapping regions), and nothing is added.
bool AddScattered(Job& job, const std::vector<const ReadRequest*>& requests,
                  std::deque<Scattered>& out) {
  const ReadRequest& first = *requests.front();
  const StoredChunk& chunk = *first.chunk;
  const size_t es = DTypeSize(first.stored->dtype);
  if (chunk.encoding == ChunkEncoding::kDriverDecoded || chunk.box.rank() == 0) return false;
  std::vector<uint64_t> run_bytes;  // per request
  uint64_t count = 0;
  for (const ReadRequest* r : requests) {
    if (r->dest.dtype != r->stored->dtype) return false;
    const CopyRuns runs = SummarizeCopyRuns(chunk.box, r->dest.box, r->region, es);
    if (runs.count == 0 || runs.run_bytes < job.options.scatter_min_run_bytes) return false;
    run_bytes.push_back(runs.run_bytes);
    count += runs.count;
  }
  // Chunk-relative pieces, in chunk order.
  std::vector<Piece> pieces;
  pieces.reserve(count);
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest* r = requests[i];
    const uint64_t run = run_bytes[i];
    std::byte* base = r->dest.data;
    ForEachCopyRun(chunk.box, r->dest.box, r->region, es, [&](uint64_t src, uint64_t dst) {
      pieces.push_back(Piece{src, src + run, base + dst});
    });
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < pieces.size(); ++i) {
    if (pieces[i].begin < pieces[i - 1].end) return false;  // two requests want the same bytes
  }
  const StoredChunkRef ref = RefFor(job, first);
  const uint64_t bs = std::max<uint64_t>(1, job.metadata.checksum_block_bytes);
  uint64_t lo = pieces.front().begin, hi = pieces.back().end;
  if (job.options.verify) {
    lo = lo / bs * bs;
    hi = std::min(chunk.byte_length, (hi + bs - 1) / bs * bs);
  }
  // Bands of at most the window too: what lies between the runs is staged, and a task stages at
  // most one window (at least one checksum block), as a staged read's slabs do.
  const uint64_t step = std::max(bs, std::min(job.span, job.options.window));
  size_t next = 0;  // the first piece not wholly placed yet
  uint64_t split = 0;  // how much of pieces[next] an earlier band took
  for (uint64_t at = lo; at < hi;) {
    uint64_t cut = ((ref.file_offset + at) / step + 1) * step - ref.file_offset;
    cut = cut / bs * bs;
    if (cut <= at) cut = (at / bs + 1) * bs;
    const uint64_t end = std::min(hi, cut);
    Scattered& band = out.emplace_back(
        Scattered{&first, at, end, ref.file_offset + at, ref.file_offset + end, {}});
    while (next < pieces.size() && pieces[next].begin + split < end) {
      const Piece& p = pieces[next];
      const uint64_t from = p.begin + split, to = std::min(p.end, end);
      band.pieces.push_back(Piece{ref.file_offset + from, ref.file_offset + to, p.dest + split});
      if (to < p.end) {
        split = to - p.begin;
        break;
      }
      split = 0;
      ++next;
    }
    at = end;
  }
  return true;
}

// Reads a driver-decoded chunk whole, decodes it, and serves every request that needs it.
Status ReadDecodedChunk(Job& job, const std::vector<const ReadRequest*>& requests,
                        DepthSlot& slot) {
  const ReadRequest& first = *requests.front();
  const StoredChunk& chunk = *first.chunk;
  const DataFile& file = job.metadata.files[chunk.file];
  AlignedBuffer stored = job.staging.Acquire(chunk.stored_length);
  AlignedBuffer decoded(chunk.byte_length);
  Status status = [&]() -> Status {
    SP_RETURN_IF_ERROR(job.files[chunk.file]->ReadAt(
        file.data_start + chunk.data_offset, MutableByteView(stored.data(), chunk.stored_length)));
    slot.Done();
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

// Per file, whether its large extents are read directly: every file the requests read with
// direct_io true, none with false. Unset: the files whose bytes from the first read to the end of
// the last one are mostly not in the page cache (a store that cannot tell reads through the
// cache), unless most of the bytes read from the file are not kept: rows read whole for a few of
// their columns, whose other columns other ranks read too (the cache serves their repeats).
std::vector<char> DirectFiles(std::span<const ReadRequest> requests,
                              const CheckpointMetadata& metadata,
                              const std::vector<std::unique_ptr<ReadableFile>>& files,
                              std::optional<bool> direct_io) {
  std::vector<char> direct(files.size(), 0);
  if (direct_io == false) return direct;
  struct Reads {
    uint64_t kept = 0;  // bytes of the regions
    std::vector<std::pair<uint64_t, uint64_t>> rows;  // file bytes of the rows that hold them
  };
  std::vector<Reads> reads(files.size());
  for (const ReadRequest& r : requests) {
    const uint32_t f = r.chunk->file;
    if (f >= files.size() || files[f] == nullptr || f >= metadata.files.size()) continue;
    const uint64_t at = metadata.files[f].data_start + r.chunk->data_offset;
    Reads& file = reads[f];
    const uint64_t es = DTypeSize(r.stored->dtype);
    file.kept += static_cast<uint64_t>(r.region.volume()) * es;
    if (r.chunk->encoding == ChunkEncoding::kDriverDecoded || r.region.rank() == 0) {
      file.rows.emplace_back(at, at + (r.chunk->encoding == ChunkEncoding::kDriverDecoded
                                           ? r.chunk->stored_length
                                           : r.chunk->byte_length));
      continue;
    }
    uint64_t row = es;  // bytes per index of dim 0 of the chunk
    for (size_t d = 1; d < r.chunk->box.rank(); ++d) {
      row *= static_cast<uint64_t>(r.chunk->box.sizes[d]);
    }
    const uint64_t first = static_cast<uint64_t>(r.region.offsets[0] - r.chunk->box.offsets[0]);
    file.rows.emplace_back(at + first * row,
                           at + (first + static_cast<uint64_t>(r.region.sizes[0])) * row);
  }
  for (size_t f = 0; f < files.size(); ++f) {
    Reads& file = reads[f];
    if (file.rows.empty()) continue;
    // The rows read, each once: requests of one chunk share the rows they overlap.
    std::sort(file.rows.begin(), file.rows.end());
    uint64_t read = 0, end = 0;
    for (const auto& [lo, hi] : file.rows) {
      if (hi > std::max(lo, end)) read += hi - std::max(lo, end);
      end = std::max(end, hi);
    }
    const uint64_t begin = file.rows.front().first;
    if (end <= begin) continue;
    if (direct_io.has_value()) {
      direct[f] = 1;
      continue;
    }
    if (file.kept * kKeptForDirectDen < read * kKeptForDirectNum) continue;
    const std::optional<double> cached = files[f]->CachedFraction(begin, end - begin);
    direct[f] = cached.has_value() && *cached < kColdFraction ? 1 : 0;
  }
  return direct;
}

}  // namespace

double SpreadPosition(uint32_t file, size_t k, size_t n) {
  constexpr double kGolden = 0.6180339887498949;  // (sqrt(5) - 1) / 2
  const double at = (static_cast<double>(k) + 0.5) / static_cast<double>(std::max<size_t>(1, n)) +
                    kGolden * static_cast<double>(file);
  return at - std::floor(at);
}

Result<uint64_t> ExecuteReads(std::span<const ReadRequest> requests,
                              const CheckpointMetadata& metadata,
                              const std::vector<std::unique_ptr<ReadableFile>>& files,
                              ThreadPool& pool, const ReadExecutorOptions& options) {
  // A format without checksums (block size 0) is read unverified; unverified reads are not
  // rounded to checksum blocks.
  ReadExecutorOptions effective = options;
  effective.verify = options.verify && metadata.checksum_block_bytes > 0;
  const uint64_t bs =
      effective.verify ? std::max<uint64_t>(1, metadata.checksum_block_bytes) : uint64_t{1};
  // Format 4: the checksums are in the headers of the files read; each header is read once per
  // HeaderChecksums (the caller's, shared by its calls, or one for this call). They are read on
  // a thread of their own (helped by the pool's free workers) while the data reads are planned
  // and begin, and each task waits for them only before it verifies: read first, a header
  // waited behind the data reads of the other callers of the pool (in-process ranks) on the
  // device, and this call's reads began that much later (docs/PERFORMANCE.md, "Headers read
  // beside the data").
  std::optional<HeaderChecksums> own_headers;
  HeaderChecksums* headers = nullptr;
  std::vector<uint32_t> read_files;
  if (effective.verify && metadata.checksums_in_headers) {
    headers = options.header_checksums;
    if (headers == nullptr) headers = &own_headers.emplace(metadata.files.size());
    read_files.reserve(requests.size());
    for (const ReadRequest& r : requests) {
      if (r.chunk->encoding != ChunkEncoding::kDriverDecoded) read_files.push_back(r.chunk->file);
    }
  }
  // Declared after what the reading uses: on any return, its destructor waits for it.
  std::shared_future<Status> headers_read;
  if (headers != nullptr) {
    auto read_headers = [&metadata, &files, &read_files, headers, &pool] {
      return headers->Load(metadata, files, read_files, &pool);
    };
    try {
      headers_read = std::async(std::launch::async, read_headers).share();
    } catch (const std::system_error&) {
      // No thread to be had (a process at its limit): read them first, here.
      std::promise<Status> read_here;
      read_here.set_value(read_headers());
      headers_read = read_here.get_future().share();
    }
  }
  // File bytes per extent. With direct I/O, no more than a task's staging window (less the
  // alignment it is widened by), so that every large extent can be read directly.
  std::vector<char> direct_files = DirectFiles(requests, metadata, files, options.direct_io);
  uint64_t span = kMaxSpanBytes;
  if (std::find(direct_files.begin(), direct_files.end(), 1) != direct_files.end()) {
    constexpr uint64_t kMiB = uint64_t{1} << 20;
    const uint64_t fits = options.window > 2 * kMiB ? options.window / kMiB * kMiB - kMiB
                                                    : options.window / 2;
    span = std::max(bs, std::min(span, fits));
  }
  BufferPool::Stay stay(pool.staging());
  Job job(metadata, files, effective, pool.staging(), span, std::move(direct_files));
  std::deque<Staged> staged;  // stable addresses for the extents
  std::deque<Direct> direct;
  std::vector<Task> tasks;
  std::map<const StoredChunk*, std::vector<const ReadRequest*>> decoded;
  // A chunk that several requests need is read once, scattered or through staging, so that the
  // checksum blocks they share are read once.
  std::map<const StoredChunk*, std::vector<const ReadRequest*>> users;
  for (const ReadRequest& r : requests) {
    if (r.dest.empty()) {
      return InvalidArgumentError("read of tensor '" + r.stored->name + "' chunk " +
                                  r.chunk->box.ToString() + " has no destination");
    }
    users[r.chunk].push_back(&r);
  }
  std::deque<Scattered> scattered;
  std::set<const StoredChunk*> in_place;  // chunks read scattered
  // Sliced reads, one per distinct slab of a chunk (a map: stable addresses for the tasks).
  std::map<std::tuple<const StoredChunk*, uint64_t, uint64_t>, SharedSlab> slabs;
  for (const ReadRequest& r : requests) {
    if (r.chunk->encoding == ChunkEncoding::kDriverDecoded) {
      decoded[r.chunk].push_back(&r);
      continue;
    }
    if (in_place.count(r.chunk) != 0) continue;
    const size_t es = DTypeSize(r.stored->dtype);
    const std::vector<const ReadRequest*>& of_chunk = users[r.chunk];
    if (r.stored->dtype == r.dest.dtype && of_chunk.size() == 1) {
      RunSummary src = SummarizeByteRuns(r.chunk->box, r.region, es);
      RunSummary dst = SummarizeByteRuns(r.dest.box, r.region, es);
      if (src.runs == 1 && dst.runs == 1 && src.bytes > 0) {
        AddDirect(job, r, src, dst, direct);
        continue;
      }
    }
    if (AddScattered(job, of_chunk, scattered)) {
      in_place.insert(r.chunk);
      continue;
    }
    Slab rows = RowCover(r.chunk->box, r.region, es);
    if (rows.end - rows.begin > options.window) {
      // Slabs are cut at the same rows for every request of the chunk that spans them (the
      // window's rows from the region's first), so requests that split the same rows share each.
      for (Slab& slab : CutSlabs(r.chunk->box, r.region, es, options.window)) {
        auto [at, fresh] = slabs.try_emplace(std::make_tuple(r.chunk, slab.begin, slab.end));
        if (fresh) at->second.slab = std::move(slab);
        at->second.users.push_back(&r);
      }
      continue;
    }
    const uint64_t file_offset = RefFor(job, r).file_offset;
    const uint64_t lo = rows.begin / bs * bs;
    const uint64_t hi = std::min(r.chunk->byte_length, (rows.end + bs - 1) / bs * bs);
    staged.push_back(Staged{&r, std::move(rows), file_offset + lo, file_offset + hi});
  }

  for (const auto& [key, shared] : slabs) {
    const StoredChunkRef ref = RefFor(job, *shared.users.front());
    const auto [offset, length] = TouchedRange(job, ref, shared.slab.begin, shared.slab.end);
    tasks.push_back(Task{ref.file, offset, length, [&job, &one = shared](DepthSlot&) {
                           return ReadSlab(job, one);
                         }});
  }

  // Every staged and direct read in file order, grouped into extents.
  struct Item {
    uint32_t file;
    uint64_t begin;
    uint64_t end;
    Staged* staged;
    const Direct* direct;
    const Scattered* scattered;
  };
  std::vector<Item> items;
  items.reserve(staged.size() + direct.size() + scattered.size());
  for (Staged& s : staged) {
    items.push_back(Item{s.request->chunk->file, s.file_begin, s.file_end, &s, nullptr, nullptr});
  }
  for (const Direct& d : direct) {
    items.push_back(Item{d.request->chunk->file, d.file_begin, d.file_end, nullptr, &d, nullptr});
  }
  for (const Scattered& s : scattered) {
    items.push_back(Item{s.request->chunk->file, s.file_begin, s.file_end, nullptr, nullptr, &s});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return std::tie(a.file, a.begin, a.end) < std::tie(b.file, b.begin, b.end);
  });
  ExtentBuilder builder(ExtentLimits{span, std::max(std::min(options.window, kMaxSpanBytes), bs),
                                     options.max_gap_bytes});
  for (const Item& item : items) {
    if (item.staged != nullptr) {
      builder.Add(item.file, *item.staged);
    } else if (item.scattered != nullptr) {
      builder.Add(item.file, *item.scattered);
    } else {
      const Direct& d = *item.direct;
      const uint64_t chunk_at = RefFor(job, *d.request).file_offset;
      builder.Add(item.file, d, chunk_at + d.lo, chunk_at + d.hi);
    }
  }
  const std::vector<Extent> extents = builder.Take();
  std::vector<PlannedExtent> planned(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) {
    planned[i] = PlanExtent(job, extents[i]);
    tasks.push_back(Task{files[extents[i].file].get(), extents[i].begin,
                         extents[i].end - extents[i].begin,
                         [&job, &e = extents[i], &p = planned[i]](DepthSlot& slot) {
                           return ReadExtent(job, e, p, slot);
                         }});
  }
  for (const auto& [chunk, users] : decoded) {
    const uint64_t offset = metadata.files[chunk->file].data_start + chunk->data_offset;
    // An init-capture: clang before 16 cannot capture a structured binding by name.
    tasks.push_back(Task{files[chunk->file].get(), offset, chunk->stored_length,
                         [&job, &chunk_users = users](DepthSlot& slot) {
                           return ReadDecodedChunk(job, chunk_users, slot);
                         }});
  }
  // Files are read side by side, each front to back: the tasks run in the order of their
  // relative position in their file, so that the threads work on different files at once and
  // each file's reads stay sequential (the kernel's read-ahead follows them). The pool keeps that
  // order across callers: ranks sharing it (in-process ranks) sweep the files together instead
  // of one rank's reads after another's. (Sorted here too for a caller on a worker of the pool,
  // where the tasks run inline.)
  std::vector<double> position(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const uint64_t size = std::max<uint64_t>(1, tasks[i].file->size());
    position[i] = static_cast<double>(tasks[i].offset) / static_cast<double>(size);
  }
  // Mostly staged direct extents (at least kSpreadFromBytes, more than half staged) of the files
  // that also have others are spread over the load (SpreadPosition).
  constexpr uint64_t kSpreadFromBytes = uint64_t{1} << 20;
  const size_t first_extent = slabs.size();
  std::map<uint32_t, std::vector<size_t>> staged_most;  // per file, in file order
  std::set<uint32_t> files_with_others;
  for (size_t i = 0; i < extents.size(); ++i) {
    const uint64_t bytes = extents[i].end - extents[i].begin;
    if (planned[i].a > 0 && bytes >= kSpreadFromBytes &&
        2 * planned[i].staging_bytes(extents[i]) > bytes) {
      staged_most[extents[i].file].push_back(i);
    } else {
      files_with_others.insert(extents[i].file);
    }
  }
  for (const auto& [file, list] : staged_most) {
    if (files_with_others.count(file) == 0) continue;
    for (size_t k = 0; k < list.size(); ++k) {
      position[first_extent + list[k]] = SpreadPosition(file, k, list.size());
    }
  }
  std::vector<size_t> order(tasks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return position[a] < position[b]; });
  // How many run at once: the machine's shared gate or the pool's tuner, or a fixed gate of
  // options.io_depth.
  std::unique_ptr<IoTuner> fixed;
  IoGate* tuner = options.gate != nullptr ? options.gate : &pool.io_tuner();
  if (options.io_depth > 0) {
    IoTuner::Config config;
    config.max_depth = options.io_depth;
    config.fixed = true;
    fixed = std::make_unique<IoTuner>(std::move(config));
    tuner = fixed.get();
  }
  // The tasks take their chunks' checksums from the headers once they have been read
  // (Job::AwaitChecksums). Not before: planning asks only where the chunks lie, and the table is
  // still being filled.
  if (headers != nullptr) {
    job.header_checksums = headers;
    job.headers_read = &headers_read;
  }
  if (options.reads_begin_ns != nullptr && !tasks.empty()) {
    int64_t unset = 0;
    options.reads_begin_ns->compare_exchange_strong(
        unset, std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
                   .count());
  }
  TaskGroup group(&pool);
  for (size_t i : order) {
    group.RunOrdered(
        [&tasks, tuner, i] {
          DepthSlot slot(*tuner, tasks[i].bytes);
          return tasks[i].run(slot);
        },
        position[i]);
  }
  const Status done = group.Wait();
  // A header that failed fails the call with its own error, as when headers were read first,
  // whatever the tasks that waited for it returned.
  if (headers != nullptr) SP_RETURN_IF_ERROR(headers_read.get());
  SP_RETURN_IF_ERROR(done);
  return job.bytes_read.load();
}

}  // namespace sp
