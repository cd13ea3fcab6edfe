#include "shardpoint/format/metadata_wire.h"

#include <algorithm>
#include <optional>

#include "shardpoint/base/coding.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {
namespace {

constexpr uint32_t kWireMagic = 0x57505053;  // "SPPW"
// A load rank's part (EncodeMetadataPartForWire): the data files travel as their count and the
// files the part holds, each behind its index.
constexpr uint32_t kWirePartMagic = 0x50505053;  // "SPPP"
constexpr uint32_t kMaxRank = 64;
// The most data files a part names (it holds few of them; the others take a default entry each).
constexpr uint32_t kMaxWireFiles = uint32_t{1} << 22;

void PutShape(ByteWriter& w, std::span<const int64_t> v) {
  w.PutU32(static_cast<uint32_t>(v.size()));
  for (int64_t x : v) w.PutI64(x);
}

template <typename Values>  // Shape or Dims
Status GetShape(ByteReader& r, Values* v) {
  SP_ASSIGN_OR_RETURN(uint32_t n, r.ReadCount(8));
  if (n > kMaxRank) return DataLossError(r.what() + ": rank " + std::to_string(n));
  v->resize(n);
  for (int64_t& x : *v) {
    SP_ASSIGN_OR_RETURN(x, r.ReadI64());
  }
  return OkStatus();
}

// Everything of a chunk but its box and byte length (which a grid cell implies).
void PutChunkPlacement(ByteWriter& w, const StoredChunk& c) {
  w.PutU32(c.file);
  w.PutU64(c.data_offset);
  w.PutU8(static_cast<uint8_t>(c.encoding));
  w.PutU64(c.stored_length);
  w.PutU32(c.driver_tag);
  w.PutU32(static_cast<uint32_t>(c.block_crc32c.size()));
  for (uint32_t crc : c.block_crc32c) w.PutU32(crc);
}

void PutChunk(ByteWriter& w, const StoredChunk& c) {
  PutShape(w, c.box.offsets);
  PutShape(w, c.box.sizes);
  w.PutU64(c.byte_length);
  PutChunkPlacement(w, c);
}

// The data files a decoding holds: all of them, or a part's (EncodeMetadataPartForWire).
struct HeldFiles {
  uint32_t count = 0;
  std::vector<bool> held;  // empty: every file

  // kDataLoss unless `file` is a file this decoding holds.
  Status Check(const ByteReader& r, uint32_t file, std::string_view what) const {
    if (file >= count) return DataLossError(r.what() + ": " + std::string(what) + " out of range");
    if (!held.empty() && !held[file]) {
      return DataLossError(r.what() + ": " + std::string(what) + " " + std::to_string(file) +
                           " names a data file this part does not hold");
    }
    return OkStatus();
  }
};

Status GetChunkPlacement(ByteReader& r, const HeldFiles& files, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(c->file, r.ReadU32());
  SP_RETURN_IF_ERROR(files.Check(r, c->file, "file index"));
  SP_ASSIGN_OR_RETURN(c->data_offset, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint8_t encoding, r.ReadU8());
  if (encoding > static_cast<uint8_t>(ChunkEncoding::kDriverDecoded)) {
    return DataLossError(r.what() + ": unknown chunk encoding " + std::to_string(encoding));
  }
  c->encoding = static_cast<ChunkEncoding>(encoding);
  SP_ASSIGN_OR_RETURN(c->stored_length, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint32_t driver_tag, r.ReadU32());
  if (driver_tag > UINT16_MAX) {
    return DataLossError(r.what() + ": driver tag " + std::to_string(driver_tag) +
                         " out of range (at most " + std::to_string(UINT16_MAX) + ")");
  }
  c->driver_tag = static_cast<uint16_t>(driver_tag);
  SP_ASSIGN_OR_RETURN(uint32_t crcs, r.ReadCount(4));
  c->block_crc32c.resize(crcs);
  for (uint32_t& crc : c->block_crc32c) {
    SP_ASSIGN_OR_RETURN(crc, r.ReadU32());
  }
  return OkStatus();
}

Status GetChunk(ByteReader& r, const HeldFiles& files, StoredChunk* c) {
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.offsets));
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.sizes));
  SP_ASSIGN_OR_RETURN(c->byte_length, r.ReadU64());
  return GetChunkPlacement(r, files, c);
}

constexpr size_t kPlacementBytes = 4 + 8 + 1 + 8 + 4 + 4;

// The bytes of a cell of `item`-byte elements, computed without wrapping: nullopt past 2^62 (a
// receiver computes them from bytes it does not trust).
std::optional<uint64_t> CellBytes(const Box& box, uint64_t item) {
  uint64_t bytes = item;
  for (int64_t size : box.sizes) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(size), &bytes) ||
        bytes > (uint64_t{1} << 62)) {
      return std::nullopt;
    }
  }
  return bytes;
}

// Whether the chunks of `t` can travel as its grid: they are its cells, with the byte lengths
// their boxes imply.
bool SendsGrid(const TensorMetadata& t) {
  if (!t.grid || t.grid->bounds.size() != t.shape.size() || !GridMatches(*t.grid, t.chunks)) {
    return false;
  }
  const uint64_t item = DTypeSize(t.dtype);
  for (const StoredChunk& chunk : t.chunks) {
    if (CellBytes(chunk.box, item) != chunk.byte_length) return false;
  }
  return true;
}

// Tensor layouts on the wire.
enum WireLayout : uint8_t {
  kWireChunks = 0,    // every chunk whole
  kWireGrid = 1,      // the grid, then every cell's placement
  kWireRawGrid = 2,   // the grid, then every cell's file, offset and checksums (all cells raw,
                      // with no stored length or driver tag)
  kWirePart = 3,      // a load rank's part (TensorMetadata::kept): the tensor's chunk count, then
                      // the chunks it keeps, each behind its stored number, ascending
  kWirePartGrid = 4,  // a part of a grid: whether its cells are raw, the grid, then the cells it
                      // keeps, each behind its number, ascending, as kWireGrid or kWireRawGrid
                      // place them
};

// The most cut points of one dimension of a part's grid, and the most cells (chunk numbers are
// 32-bit): its cells do not travel, so the bytes left do not bound them.
constexpr uint32_t kMaxPartGridCuts = uint32_t{1} << 24;
constexpr uint64_t kMaxPartGridCells = UINT32_MAX;

// Whether every chunk is raw with no stored length or driver tag (a native checkpoint's).
bool AllRaw(const TensorMetadata& t) {
  for (const StoredChunk& c : t.chunks) {
    if (c.encoding != ChunkEncoding::kRaw || c.stored_length != 0 || c.driver_tag != 0) {
      return false;
    }
  }
  return true;
}

// One dimension's cut points: their count, then a step (cut k at k * step but the last, at the
// dimension) when they have that form, else every point.
void PutBounds(ByteWriter& w, const std::vector<int64_t>& bounds) {
  const int64_t step = GridEvenStep(bounds);
  w.PutU32(static_cast<uint32_t>(bounds.size()));
  w.PutU8(step != 0 ? 1 : 0);
  if (step != 0) {
    w.PutI64(step);
  } else {
    for (int64_t x : bounds) w.PutI64(x);
  }
}

// At most `max_count` cut points (what the cells behind them can pay for).
Status GetBounds(ByteReader& r, int64_t dim, uint64_t max_count, std::vector<int64_t>* b) {
  SP_ASSIGN_OR_RETURN(uint32_t n, r.ReadU32());
  SP_ASSIGN_OR_RETURN(uint8_t even, r.ReadU8());
  if (n > max_count) return DataLossError(r.what() + ": too many grid cells");
  if (even == 1) {
    SP_ASSIGN_OR_RETURN(int64_t step, r.ReadI64());
    // n - 1 intervals of `step` but the last, the last cut before the dimension (no overflow).
    if (n < 3 || step <= 0 || step > dim || static_cast<int64_t>(n) - 2 > (dim - 1) / step) {
      return DataLossError(r.what() + ": bad grid step");
    }
    b->resize(n);
    for (uint32_t k = 0; k + 1 < n; ++k) (*b)[k] = static_cast<int64_t>(k) * step;
    (*b)[n - 1] = dim;
    return OkStatus();
  }
  if (even != 0 || n > r.remaining() / 8) return DataLossError(r.what() + ": bad grid bounds");
  b->resize(n);
  for (int64_t& x : *b) {
    SP_ASSIGN_OR_RETURN(x, r.ReadI64());
  }
  return OkStatus();
}

Status GetRawPlacement(ByteReader& r, const HeldFiles& files, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(c->file, r.ReadU32());
  SP_RETURN_IF_ERROR(files.Check(r, c->file, "file index"));
  SP_ASSIGN_OR_RETURN(c->data_offset, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint32_t crcs, r.ReadCount(4));
  c->block_crc32c.resize(crcs);
  for (uint32_t& crc : c->block_crc32c) {
    SP_ASSIGN_OR_RETURN(crc, r.ReadU32());
  }
  return OkStatus();
}

// Keeps `chunk`, numbered `number`, in `t` when `keep` is null or reaches it (ChunkFilter).
void KeepChunk(const std::vector<Box>* keep, uint32_t number, StoredChunk&& chunk,
               std::vector<uint32_t>* kept, TensorMetadata* t) {
  if (keep != nullptr && !FilterKeeps(*keep, t->shape, chunk.box)) return;
  t->chunks.push_back(std::move(chunk));
  if (keep != nullptr) kept->push_back(number);
}

// After a tensor's `total` chunks were decoded through KeepChunk: a part when some were left out
// (TensorMetadata::kept, without a grid), the whole tensor otherwise.
void EndPart(const std::vector<Box>* keep, uint64_t total, std::vector<uint32_t>&& kept,
             TensorMetadata* t) {
  if (keep == nullptr || kept.size() == total) return;
  t->grid.reset();
  t->kept = std::move(kept);
}

// A grid over `t`'s shape: per dimension its cut points (0 first, the dimension last,
// increasing), and its strides. With `min_cell`, its cells travel behind it, each of at least
// that many bytes, so the bytes left bound the cells; without (a part, whose cells do not all
// travel), kMaxPartGridCuts and kMaxPartGridCells do.
Status GetGrid(ByteReader& r, const TensorMetadata& t, uint64_t min_cell, ChunkGrid* grid) {
  grid->bounds.resize(t.shape.size());
  grid->strides.resize(t.shape.size());
  uint64_t so_far = 1;  // cells of the dimensions before
  for (size_t d = 0; d < t.shape.size(); ++d) {
    std::vector<int64_t>& b = grid->bounds[d];
    const uint64_t max_cuts =
        min_cell != 0 ? r.remaining() / min_cell / so_far + 1 : kMaxPartGridCuts;
    SP_RETURN_IF_ERROR(GetBounds(r, t.shape[d], max_cuts, &b));
    // At most the remaining bytes (checked above when cells travel): no overflow.
    if (min_cell != 0 && b.size() >= 2) so_far *= b.size() - 1;
    if (b.size() < 2 || b.front() != 0 || b.back() != t.shape[d]) {
      return DataLossError(r.what() + ": bad grid bounds of tensor " + t.name);
    }
    for (size_t k = 1; k < b.size(); ++k) {
      if (b[k] <= b[k - 1]) {
        return DataLossError(r.what() + ": bad grid bounds of tensor " + t.name);
      }
    }
  }
  const uint64_t max_cells = min_cell != 0 ? r.remaining() / min_cell : kMaxPartGridCells;
  uint64_t cells = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    grid->strides[d] = cells;
    if (__builtin_mul_overflow(cells, grid->bounds[d].size() - 1, &cells) || cells > max_cells) {
      return DataLossError(r.what() + ": too many grid cells for tensor " + t.name);
    }
  }
  return OkStatus();
}

// A grid: per dimension its cut points (0 first, the dimension last, increasing), then every
// cell's placement in row-major order. With `keep`, only the cells it reaches are kept, and every
// cell is checked all the same.
Status GetGridTensor(ByteReader& r, const HeldFiles& files, bool raw, const std::vector<Box>* keep,
                     TensorMetadata* t) {
  ChunkGrid grid;
  SP_RETURN_IF_ERROR(GetGrid(r, *t, raw ? 4 + 8 + 4 : kPlacementBytes, &grid));
  const uint64_t cells = grid.cell_count();
  t->chunks.reserve(keep == nullptr ? cells : 0);
  std::vector<uint32_t> kept;
  const uint64_t item = DTypeSize(t->dtype);
  for (uint64_t c = 0; c < cells; ++c) {
    StoredChunk chunk;
    chunk.box = GridCellBox(grid, c);
    const std::optional<uint64_t> bytes = CellBytes(chunk.box, item);
    if (!bytes) {
      return DataLossError(r.what() + ": a grid cell of tensor " + t->name + " is too large");
    }
    chunk.byte_length = *bytes;
    SP_RETURN_IF_ERROR(raw ? GetRawPlacement(r, files, &chunk)
                           : GetChunkPlacement(r, files, &chunk));
    KeepChunk(keep, static_cast<uint32_t>(c), std::move(chunk), &kept, t);
  }
  t->grid = std::move(grid);
  EndPart(keep, cells, std::move(kept), t);
  return OkStatus();
}

// A grid cell's placement: raw, its file, offset and checksums; else PutChunkPlacement.
void PutCell(ByteWriter& w, const StoredChunk& c, bool raw) {
  if (!raw) return PutChunkPlacement(w, c);
  w.PutU32(c.file);
  w.PutU64(c.data_offset);
  w.PutU32(static_cast<uint32_t>(c.block_crc32c.size()));
  for (uint32_t crc : c.block_crc32c) w.PutU32(crc);
}

}  // namespace

namespace wire_internal {
// How a tensor's chunks travel: a list, or the cells of its grid (raw or placed); for a grid,
// its cut points as PutBounds writes them.
struct CellsAs {
  uint8_t layout = 0;  // a WireLayout
  std::string bounds;
};
}  // namespace wire_internal

namespace {

using wire_internal::CellsAs;

CellsAs HowCellsTravel(const TensorMetadata& t) {
  CellsAs how;
  if (!SendsGrid(t)) return how;
  how.layout = AllRaw(t) ? kWireRawGrid : kWireGrid;
  ByteWriter w(&how.bounds);
  for (const std::vector<int64_t>& bounds : t.grid->bounds) PutBounds(w, bounds);
  return how;
}

// A tensor's name, dtype and shape.
void PutTensorHead(ByteWriter& w, const TensorMetadata& t) {
  w.PutString(t.name);
  w.PutU8(DTypeCode(t.dtype));
  PutShape(w, t.shape);
}

// One tensor's bytes on the wire (behind its length), its chunks as `how` says.
void PutTensor(ByteWriter& w, const TensorMetadata& t, const CellsAs& how) {
  PutTensorHead(w, t);
  w.PutU8(how.layout);
  if (how.layout != kWireChunks) {
    w.PutRaw(how.bounds);
    for (const StoredChunk& c : t.chunks) PutCell(w, c, how.layout == kWireRawGrid);
  } else {
    w.PutU32(static_cast<uint32_t>(t.chunks.size()));
    for (const StoredChunk& c : t.chunks) PutChunk(w, c);
  }
}

// At least the bytes of `t` on the wire, its length included (PutTensor): room to reserve, so
// that the broadcast of a large checkpoint (142 MiB at 8,192 ranks x 1,000 tensors) is never
// copied by a growing buffer.
uint64_t WireTensorBound(const TensorMetadata& t) {
  // length, name, dtype, shape, layout byte and chunk count
  uint64_t bytes = 8 + 4 + t.name.size() + 1 + 4 + 8 * t.shape.size() + 1 + 4;
  const bool grid = SendsGrid(t);
  const bool raw = grid && AllRaw(t);
  if (grid) {
    for (const std::vector<int64_t>& bounds : t.grid->bounds) bytes += 5 + 8 * bounds.size();
  }
  for (const StoredChunk& c : t.chunks) {
    // a raw cell: file, offset, checksums; a placed cell: PutChunkPlacement; a chunk: PutChunk
    bytes += (raw ? 16 : grid ? 29 : 45 + 16 * c.box.rank()) +
             4 * static_cast<uint64_t>(c.block_crc32c.size());
  }
  return bytes;
}

// The `count` chunks of a part of a tensor of `total` chunks, each behind its stored number
// (ascending, below `total`), fewer than all; `read` reads the chunk numbered its first argument.
// With `keep`, only those of them it reaches are kept.
template <typename Read>
Status GetPartChunks(ByteReader& r, uint64_t total, uint32_t count, const std::vector<Box>* keep,
                     TensorMetadata* t, Read read) {
  if (count >= total) {
    return DataLossError(r.what() + ": the part of tensor " + t->name + " keeps " +
                         std::to_string(count) + " of its " + std::to_string(total) +
                         " chunks (a part keeps fewer; all of them travel whole)");
  }
  std::vector<uint32_t> kept;
  kept.reserve(count);
  t->chunks.reserve(count);
  int64_t previous = -1;
  for (uint32_t c = 0; c < count; ++c) {
    SP_ASSIGN_OR_RETURN(uint32_t number, r.ReadU32());
    if (static_cast<int64_t>(number) <= previous || number >= total) {
      return DataLossError(r.what() + ": chunk number " + std::to_string(number) +
                           " of the part of tensor " + t->name + " is not above " +
                           std::to_string(previous) + " and below " + std::to_string(total));
    }
    previous = number;
    StoredChunk chunk;
    SP_RETURN_IF_ERROR(read(number, &chunk));
    if (keep != nullptr && !FilterKeeps(*keep, t->shape, chunk.box)) continue;
    t->chunks.push_back(std::move(chunk));
    kept.push_back(number);
  }
  t->kept = std::move(kept);
  return OkStatus();
}

// A part (kWirePart): the tensor's chunk count, then the chunks kept, as GetPartChunks reads them.
Status GetPartTensor(ByteReader& r, const HeldFiles& files, const std::vector<Box>* keep,
                     TensorMetadata* t) {
  SP_ASSIGN_OR_RETURN(uint32_t total, r.ReadU32());
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(4 + 4 + 4 + 8 + kPlacementBytes));
  return GetPartChunks(r, total, count, keep, t, [&](uint32_t, StoredChunk* chunk) {
    return GetChunk(r, files, chunk);
  });
}

// A part of a grid (kWirePartGrid): the cells kept, as GetPartChunks reads them, their boxes and
// byte lengths those of the grid's cells.
Status GetPartGridTensor(ByteReader& r, const HeldFiles& files, const std::vector<Box>* keep,
                         TensorMetadata* t) {
  SP_ASSIGN_OR_RETURN(uint8_t raw, r.ReadU8());
  if (raw > 1) return DataLossError(r.what() + ": bad raw-cells flag of tensor " + t->name);
  ChunkGrid grid;
  SP_RETURN_IF_ERROR(GetGrid(r, *t, 0, &grid));
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(4 + (raw ? 4 + 8 + 4 : kPlacementBytes)));
  const uint64_t item = DTypeSize(t->dtype);
  return GetPartChunks(r, grid.cell_count(), count, keep, t,
                       [&](uint32_t number, StoredChunk* chunk) -> Status {
    chunk->box = GridCellBox(grid, number);
    const std::optional<uint64_t> bytes = CellBytes(chunk->box, item);
    if (!bytes) {
      return DataLossError(r.what() + ": a grid cell of tensor " + t->name + " is too large");
    }
    chunk->byte_length = *bytes;
    return raw ? GetRawPlacement(r, files, chunk) : GetChunkPlacement(r, files, chunk);
  });
}

// With `filter`, the tensor keeps only the chunks it reaches (ChunkFilter), every chunk decoded
// and checked all the same.
Status GetTensor(ByteReader& r, const HeldFiles& files, const ChunkFilter* filter,
                 TensorMetadata* t) {
  SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString());
  t->name = std::string(name);
  SP_ASSIGN_OR_RETURN(uint8_t code, r.ReadU8());
  SP_ASSIGN_OR_RETURN(t->dtype, DTypeFromCode(code));
  SP_RETURN_IF_ERROR(GetShape(r, &t->shape));
  static const std::vector<Box> kNone;
  const std::vector<Box>* keep = nullptr;
  if (filter != nullptr) {
    auto it = filter->find(t->name);
    keep = it != filter->end() ? &it->second : &kNone;
  }
  SP_ASSIGN_OR_RETURN(uint8_t layout, r.ReadU8());
  if (layout == kWireGrid || layout == kWireRawGrid) {
    return GetGridTensor(r, files, layout == kWireRawGrid, keep, t);
  }
  if (layout == kWirePart) return GetPartTensor(r, files, keep, t);
  if (layout == kWirePartGrid) return GetPartGridTensor(r, files, keep, t);
  if (layout != kWireChunks) return DataLossError(r.what() + ": unknown tensor layout");
  SP_ASSIGN_OR_RETURN(uint32_t chunks, r.ReadCount(4 + 4 + 8 + kPlacementBytes));
  t->chunks.reserve(keep == nullptr ? chunks : 0);
  std::vector<uint32_t> kept;
  for (uint32_t c = 0; c < chunks; ++c) {
    StoredChunk chunk;
    SP_RETURN_IF_ERROR(GetChunk(r, files, &chunk));
    KeepChunk(keep, c, std::move(chunk), &kept, t);
  }
  EndPart(keep, chunks, std::move(kept), t);
  return OkStatus();
}

Status GetObject(ByteReader& r, const HeldFiles& files, ObjectEntry* o) {
  SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString());
  o->name = std::string(name);
  SP_ASSIGN_OR_RETURN(uint8_t encoding, r.ReadU8());
  if (!IsKnownObjectEncoding(encoding)) return DataLossError(r.what() + ": unknown object encoding");
  o->encoding = static_cast<ObjectEncoding>(encoding);
  SP_ASSIGN_OR_RETURN(std::string_view payload, r.ReadString(UINT32_MAX));
  o->payload = std::string(payload);
  SP_ASSIGN_OR_RETURN(uint8_t stored, r.ReadU8());
  if (stored > 1) return DataLossError(r.what() + ": bad stored-object flag");
  if (stored == 1) {
    StoredObjectItem item;
    SP_ASSIGN_OR_RETURN(item.file, r.ReadU32());
    SP_RETURN_IF_ERROR(files.Check(r, item.file, "object file index"));
    SP_ASSIGN_OR_RETURN(item.offset, r.ReadU64());
    SP_ASSIGN_OR_RETURN(item.length, r.ReadU64());
    SP_ASSIGN_OR_RETURN(item.driver_tag, r.ReadU32());
    o->stored = item;
  }
  return OkStatus();
}

Status GetFile(ByteReader& r, DataFile* f) {
  SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString());
  f->name = std::string(name);
  SP_ASSIGN_OR_RETURN(f->data_start, r.ReadU64());
  SP_ASSIGN_OR_RETURN(f->size, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint32_t writer, r.ReadU32());
  f->writer_rank = static_cast<int32_t>(writer);
  return OkStatus();
}

Status GetHead(ByteReader& r, CheckpointMetadata* m, HeldFiles* files) {
  SP_ASSIGN_OR_RETURN(uint32_t magic, r.ReadU32());
  if (magic != kWireMagic && magic != kWirePartMagic) {
    return DataLossError(r.what() + ": bad magic");
  }
  SP_ASSIGN_OR_RETURN(m->version_major, r.ReadU32());
  SP_ASSIGN_OR_RETURN(m->version_minor, r.ReadU32());
  SP_ASSIGN_OR_RETURN(std::string_view save_id, r.ReadString());
  m->save_id = std::string(save_id);
  SP_ASSIGN_OR_RETURN(uint32_t world, r.ReadU32());
  m->world_size = static_cast<int32_t>(world);
  SP_ASSIGN_OR_RETURN(uint8_t format, r.ReadU8());
  if (format > static_cast<uint8_t>(CheckpointFormat::kSafetensors)) {
    return DataLossError(r.what() + ": unknown format " + std::to_string(format));
  }
  m->format = static_cast<CheckpointFormat>(format);
  SP_ASSIGN_OR_RETURN(m->checksum_block_bytes, r.ReadU64());
  if (magic == kWireMagic) {
    SP_ASSIGN_OR_RETURN(files->count, r.ReadCount(4 + 8 + 8 + 4));
    m->files.resize(files->count);
    for (DataFile& f : m->files) SP_RETURN_IF_ERROR(GetFile(r, &f));
  } else {
    // Files not held stay without a name (CheckpointMetadata::files); the count is bounded by
    // what a receiver may allocate for them, not by the bytes left.
    SP_ASSIGN_OR_RETURN(files->count, r.ReadU32());
    if (files->count > kMaxWireFiles) {
      return DataLossError(r.what() + ": " + std::to_string(files->count) +
                           " data files (at most " + std::to_string(kMaxWireFiles) + ")");
    }
    SP_ASSIGN_OR_RETURN(uint32_t held, r.ReadCount(4 + 4 + 8 + 8 + 4));
    m->files.resize(files->count);
    files->held.assign(files->count, false);
    int64_t previous = -1;
    for (uint32_t i = 0; i < held; ++i) {
      SP_ASSIGN_OR_RETURN(uint32_t index, r.ReadU32());
      if (static_cast<int64_t>(index) <= previous || index >= files->count) {
        return DataLossError(r.what() + ": data file index " + std::to_string(index) +
                             " is not above " + std::to_string(previous) + " and below " +
                             std::to_string(files->count));
      }
      previous = index;
      files->held[index] = true;
      SP_RETURN_IF_ERROR(GetFile(r, &m->files[index]));
    }
  }
  SP_ASSIGN_OR_RETURN(uint32_t attributes, r.ReadCount(8));
  for (uint32_t i = 0; i < attributes; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view key, r.ReadString());
    SP_ASSIGN_OR_RETURN(std::string_view value, r.ReadString(UINT32_MAX));
    m->attributes.emplace(std::string(key), std::string(value));
  }
  return OkStatus();
}

void PutFile(ByteWriter& w, const DataFile& f) {
  w.PutString(f.name);
  w.PutU64(f.data_start);
  w.PutU64(f.size);
  w.PutU32(static_cast<uint32_t>(f.writer_rank));
}

// Everything before the tensors. With `held`, only the files it marks travel, behind their index.
void PutHead(ByteWriter& w, const CheckpointMetadata& m, const std::vector<bool>* held) {
  w.PutU32(held == nullptr ? kWireMagic : kWirePartMagic);
  w.PutU32(m.version_major);
  w.PutU32(m.version_minor);
  w.PutString(m.save_id);
  w.PutU32(static_cast<uint32_t>(m.world_size));
  w.PutU8(static_cast<uint8_t>(m.format));
  w.PutU64(m.checksum_block_bytes);
  w.PutU32(static_cast<uint32_t>(m.files.size()));
  if (held == nullptr) {
    for (const DataFile& f : m.files) PutFile(w, f);
  } else {
    w.PutU32(static_cast<uint32_t>(std::count(held->begin(), held->end(), true)));
    for (uint32_t i = 0; i < m.files.size(); ++i) {
      if (!(*held)[i]) continue;
      w.PutU32(i);
      PutFile(w, m.files[i]);
    }
  }
  w.PutU32(static_cast<uint32_t>(m.attributes.size()));
  for (const auto& [key, value] : m.attributes) {
    w.PutString(key);
    w.PutString(value);
  }
}

void PutObjects(ByteWriter& w, const CheckpointMetadata& m) {
  w.PutU32(static_cast<uint32_t>(m.objects.size()));
  for (const ObjectEntry& o : m.objects) {
    w.PutString(o.name);
    w.PutU8(static_cast<uint8_t>(o.encoding));
    w.PutString(o.payload);
    w.PutU8(o.stored ? 1 : 0);
    if (o.stored) {
      w.PutU32(o.stored->file);
      w.PutU64(o.stored->offset);
      w.PutU64(o.stored->length);
      w.PutU32(o.stored->driver_tag);
    }
  }
}

// One tensor behind its length, so that a receiver decodes the tensors in parallel.
template <typename Put>
void PutBehindLength(std::string& out, Put put) {
  const size_t at = out.size();
  ByteWriter(&out).PutU64(0);
  put();
  EncodeFixed64(out.data() + at, out.size() - at - 8);
}

// The chunks `kept` of `t` (fewer than all), as a part of its grid when it travels as one (`how`)
// and that takes fewer bytes than their boxes, else as a list of chunks.
void PutPartTensor(ByteWriter& w, const TensorMetadata& t, const std::vector<uint32_t>& kept,
                   const CellsAs& how) {
  PutTensorHead(w, t);
  if (how.layout != kWireChunks) {
    const bool raw = how.layout == kWireRawGrid;
    // Per kept chunk beside its checksums: a cell's placement, or a box, length and placement.
    const uint64_t cell = raw ? 4 + 8 + 4 : kPlacementBytes;
    const uint64_t chunk = 4 + 4 + 16 * t.shape.size() + 8 + kPlacementBytes;
    if (how.bounds.size() + kept.size() * cell < kept.size() * chunk) {
      w.PutU8(kWirePartGrid);
      w.PutU8(raw ? 1 : 0);
      w.PutRaw(how.bounds);
      w.PutU32(static_cast<uint32_t>(kept.size()));
      for (uint32_t c : kept) {
        w.PutU32(c);
        PutCell(w, t.chunks[c], raw);
      }
      return;
    }
  }
  w.PutU8(kWirePart);
  w.PutU32(static_cast<uint32_t>(t.chunks.size()));
  w.PutU32(static_cast<uint32_t>(kept.size()));
  for (uint32_t c : kept) {
    w.PutU32(c);
    PutChunk(w, t.chunks[c]);
  }
}

}  // namespace

uint64_t WireMetadataBound(const CheckpointMetadata& m) {
  uint64_t bound = 12 + 4 + m.save_id.size() + 4 + 1 + 8 + 4 + 4 + 4 + 4;
  for (const DataFile& f : m.files) bound += 4 + f.name.size() + 20;
  for (const auto& [key, value] : m.attributes) bound += 8 + key.size() + value.size();
  for (const TensorMetadata& t : m.tensors) bound += WireTensorBound(t);
  for (const ObjectEntry& o : m.objects) bound += 4 + o.name.size() + 5 + o.payload.size() + 25;
  return bound;
}

std::string EncodeMetadataForWire(const CheckpointMetadata& m) {
  std::string out;
  out.reserve(WireMetadataBound(m));
  ByteWriter w(&out);
  PutHead(w, m, nullptr);
  w.PutU32(static_cast<uint32_t>(m.tensors.size()));
  for (const TensorMetadata& t : m.tensors) {
    PutBehindLength(out, [&] { PutTensor(w, t, HowCellsTravel(t)); });
  }
  PutObjects(w, m);
  return out;
}

MetadataPartEncoder::MetadataPartEncoder(const CheckpointMetadata& metadata, ThreadPool* pool)
    : metadata_(metadata), how_(metadata.tensors.size()) {
  (void)ParallelFor(pool, static_cast<int64_t>(how_.size()), [&](int64_t t) {
    how_[t] = HowCellsTravel(metadata_.tensors[t]);
    return OkStatus();
  });
}

MetadataPartEncoder::~MetadataPartEncoder() = default;

std::string MetadataPartEncoder::Encode(const ChunkFilter& filter) const {
  const CheckpointMetadata& m = metadata_;
  // Per tensor, the chunks the filter keeps; all of them: the tensor travels whole.
  static const std::vector<Box> kNone;
  std::vector<std::vector<uint32_t>> reached(m.tensors.size());
  std::vector<bool> held(m.files.size(), false);
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& tensor = m.tensors[t];
    auto it = filter.find(tensor.name);
    reached[t] = ChunksReached(tensor, it != filter.end() ? it->second : kNone);
    if (reached[t].size() == tensor.chunks.size()) {
      for (const StoredChunk& c : tensor.chunks) held[c.file] = true;
    } else {
      for (uint32_t c : reached[t]) held[tensor.chunks[c].file] = true;
    }
  }
  for (const ObjectEntry& o : m.objects) {
    if (o.stored) held[o.stored->file] = true;
  }
  std::string out;
  ByteWriter w(&out);
  PutHead(w, m, &held);
  w.PutU32(static_cast<uint32_t>(m.tensors.size()));
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& tensor = m.tensors[t];
    PutBehindLength(out, [&] {
      if (reached[t].size() == tensor.chunks.size()) return PutTensor(w, tensor, how_[t]);
      PutPartTensor(w, tensor, reached[t], how_[t]);
    });
  }
  PutObjects(w, m);
  return out;
}

std::string EncodeMetadataPartForWire(const CheckpointMetadata& m, const ChunkFilter& filter) {
  return MetadataPartEncoder(m).Encode(filter);
}

std::string EncodeChunkFilter(const ChunkFilter& filter) {
  std::string out;
  ByteWriter w(&out);
  w.PutU32(static_cast<uint32_t>(filter.size()));
  for (const auto& [name, boxes] : filter) {
    w.PutString(name);
    w.PutU32(static_cast<uint32_t>(boxes.size()));
    for (const Box& box : boxes) {
      PutShape(w, box.offsets);
      PutShape(w, box.sizes);
    }
  }
  return out;
}

Result<ChunkFilter> DecodeChunkFilter(std::string_view bytes, std::string_view what) {
  ByteReader r(bytes, std::string(what));
  ChunkFilter filter;
  SP_ASSIGN_OR_RETURN(uint32_t names, r.ReadCount(4 + 4));
  std::string_view previous;
  for (uint32_t i = 0; i < names; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString());
    if (i > 0 && name <= previous) {
      return DataLossError(r.what() + ": tensor names out of order at '" + std::string(name) + "'");
    }
    previous = name;
    SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(4 + 4));
    std::vector<Box>& boxes = filter.emplace_hint(filter.end(), name, std::vector<Box>())->second;
    boxes.resize(count);
    for (Box& box : boxes) {
      SP_RETURN_IF_ERROR(GetShape(r, &box.offsets));
      SP_RETURN_IF_ERROR(GetShape(r, &box.sizes));
      if (box.offsets.size() != box.sizes.size()) {
        return DataLossError(r.what() + ": a box of tensor '" + std::string(name) + "' has " +
                             std::to_string(box.offsets.size()) + " offsets and " +
                             std::to_string(box.sizes.size()) + " sizes");
      }
    }
  }
  if (!r.done()) {
    return DataLossError(r.what() + ": " + std::to_string(r.remaining()) + " trailing bytes");
  }
  return filter;
}

Result<CheckpointMetadata> DecodeMetadataFromWire(std::string_view bytes, ThreadPool* pool,
                                                  const ChunkFilter* filter) {
  ByteReader r(bytes, "checkpoint metadata received from the coordinator");
  CheckpointMetadata m;
  HeldFiles files;
  SP_RETURN_IF_ERROR(GetHead(r, &m, &files));
  SP_ASSIGN_OR_RETURN(uint32_t tensors, r.ReadCount(8 + 4 + 1 + 4 + 1));
  // Where each tensor's bytes are, then the tensors, on `pool`; the first error by position.
  std::vector<std::pair<size_t, std::string_view>> records(tensors);
  for (auto& [at, record] : records) {
    SP_ASSIGN_OR_RETURN(uint64_t length, r.ReadU64());
    at = r.position();
    if (length > r.remaining()) {
      return DataLossError(r.what() + ": tensor of " + std::to_string(length) + " bytes at byte " +
                           std::to_string(at) + ", " + std::to_string(r.remaining()) + " left");
    }
    SP_ASSIGN_OR_RETURN(record, r.ReadRaw(length));
  }
  m.tensors.resize(tensors);
  SP_RETURN_IF_ERROR(ParallelForInOrder(pool, tensors, [&](int64_t i) -> Status {
    const auto& [at, record] = records[i];
    ByteReader tr(record, r.what() + ", tensor at byte " + std::to_string(at));
    SP_RETURN_IF_ERROR(GetTensor(tr, files, filter, &m.tensors[i]));
    if (tr.done()) return OkStatus();
    return DataLossError(tr.what() + ": " + std::to_string(tr.remaining()) + " trailing bytes");
  }));
  IndexChunkGrids(&m, pool);  // grids travel; the other tensors are indexed here
  SP_ASSIGN_OR_RETURN(uint32_t objects, r.ReadCount(4 + 1 + 4 + 1));
  m.objects.resize(objects);
  for (ObjectEntry& o : m.objects) SP_RETURN_IF_ERROR(GetObject(r, files, &o));
  if (!r.done()) {
    return DataLossError(r.what() + ": " + std::to_string(r.remaining()) + " trailing bytes");
  }
  return m;
}

}  // namespace sp
