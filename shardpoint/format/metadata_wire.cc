#include "shardpoint/format/metadata_wire.h"

#include <optional>

#include "shardpoint/base/coding.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {
namespace {

constexpr uint32_t kWireMagic = 0x57505053;  // "SPPW"
constexpr uint32_t kMaxRank = 64;

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

Status GetChunkPlacement(ByteReader& r, uint32_t file_count, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(c->file, r.ReadU32());
  if (c->file >= file_count) return DataLossError(r.what() + ": file index out of range");
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

Status GetChunk(ByteReader& r, uint32_t file_count, StoredChunk* c) {
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.offsets));
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.sizes));
  SP_ASSIGN_OR_RETURN(c->byte_length, r.ReadU64());
  return GetChunkPlacement(r, file_count, c);
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
};

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

Status GetRawPlacement(ByteReader& r, uint32_t file_count, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(c->file, r.ReadU32());
  if (c->file >= file_count) return DataLossError(r.what() + ": file index out of range");
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

// A grid: per dimension its cut points (0 first, the dimension last, increasing), then every
// cell's placement in row-major order. With `keep`, only the cells it reaches are kept, and every
// cell is checked all the same.
Status GetGridTensor(ByteReader& r, uint32_t file_count, bool raw, const std::vector<Box>* keep,
                     TensorMetadata* t) {
  ChunkGrid grid;
  grid.bounds.resize(t->shape.size());
  grid.strides.resize(t->shape.size());
  const uint64_t min_cell = raw ? 4 + 8 + 4 : kPlacementBytes;
  uint64_t so_far = 1;  // cells of the dimensions before
  for (size_t d = 0; d < t->shape.size(); ++d) {
    std::vector<int64_t>& b = grid.bounds[d];
    SP_RETURN_IF_ERROR(GetBounds(r, t->shape[d], r.remaining() / min_cell / so_far + 1, &b));
    if (b.size() >= 2) so_far *= b.size() - 1;  // at most the remaining bytes: no overflow
    if (b.size() < 2 || b.front() != 0 || b.back() != t->shape[d]) {
      return DataLossError(r.what() + ": bad grid bounds of tensor " + t->name);
    }
    for (size_t k = 1; k < b.size(); ++k) {
      if (b[k] <= b[k - 1]) return DataLossError(r.what() + ": bad grid bounds of tensor " + t->name);
    }
  }
  uint64_t cells = 1;
  for (size_t d = t->shape.size(); d-- > 0;) {
    grid.strides[d] = cells;
    if (__builtin_mul_overflow(cells, grid.bounds[d].size() - 1, &cells) ||
        cells > r.remaining() / min_cell) {
      return DataLossError(r.what() + ": too many grid cells for tensor " + t->name);
    }
  }
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
    SP_RETURN_IF_ERROR(raw ? GetRawPlacement(r, file_count, &chunk)
                           : GetChunkPlacement(r, file_count, &chunk));
    KeepChunk(keep, static_cast<uint32_t>(c), std::move(chunk), &kept, t);
  }
  t->grid = std::move(grid);
  EndPart(keep, cells, std::move(kept), t);
  return OkStatus();
}

// One tensor's bytes on the wire (behind its length).
void PutTensor(ByteWriter& w, const TensorMetadata& t) {
  w.PutString(t.name);
  w.PutU8(DTypeCode(t.dtype));
  PutShape(w, t.shape);
  if (SendsGrid(t)) {
    const bool raw = AllRaw(t);
    w.PutU8(raw ? kWireRawGrid : kWireGrid);
    for (const std::vector<int64_t>& bounds : t.grid->bounds) PutBounds(w, bounds);
    for (const StoredChunk& c : t.chunks) {
      if (raw) {
        w.PutU32(c.file);
        w.PutU64(c.data_offset);
        w.PutU32(static_cast<uint32_t>(c.block_crc32c.size()));
        for (uint32_t crc : c.block_crc32c) w.PutU32(crc);
      } else {
        PutChunkPlacement(w, c);
      }
    }
  } else {
    w.PutU8(kWireChunks);
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

// With `filter`, the tensor keeps only the chunks it reaches (ChunkFilter), every chunk decoded
// and checked all the same.
Status GetTensor(ByteReader& r, uint32_t file_count, const ChunkFilter* filter,
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
    return GetGridTensor(r, file_count, layout == kWireRawGrid, keep, t);
  }
  if (layout != kWireChunks) return DataLossError(r.what() + ": unknown tensor layout");
  SP_ASSIGN_OR_RETURN(uint32_t chunks, r.ReadCount(4 + 4 + 8 + kPlacementBytes));
  t->chunks.reserve(keep == nullptr ? chunks : 0);
  std::vector<uint32_t> kept;
  for (uint32_t c = 0; c < chunks; ++c) {
    StoredChunk chunk;
    SP_RETURN_IF_ERROR(GetChunk(r, file_count, &chunk));
    KeepChunk(keep, c, std::move(chunk), &kept, t);
  }
  EndPart(keep, chunks, std::move(kept), t);
  return OkStatus();
}

Status GetObject(ByteReader& r, uint32_t file_count, ObjectEntry* o) {
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
    if (item.file >= file_count) return DataLossError(r.what() + ": object file index out of range");
    SP_ASSIGN_OR_RETURN(item.offset, r.ReadU64());
    SP_ASSIGN_OR_RETURN(item.length, r.ReadU64());
    SP_ASSIGN_OR_RETURN(item.driver_tag, r.ReadU32());
    o->stored = item;
  }
  return OkStatus();
}

Status GetHead(ByteReader& r, CheckpointMetadata* m) {
  SP_ASSIGN_OR_RETURN(uint32_t magic, r.ReadU32());
  if (magic != kWireMagic) return DataLossError(r.what() + ": bad magic");
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
  SP_ASSIGN_OR_RETURN(uint32_t files, r.ReadCount(4 + 8 + 8 + 4));
  m->files.resize(files);
  for (DataFile& f : m->files) {
    SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString());
    f.name = std::string(name);
    SP_ASSIGN_OR_RETURN(f.data_start, r.ReadU64());
    SP_ASSIGN_OR_RETURN(f.size, r.ReadU64());
    SP_ASSIGN_OR_RETURN(uint32_t writer, r.ReadU32());
    f.writer_rank = static_cast<int32_t>(writer);
  }
  SP_ASSIGN_OR_RETURN(uint32_t attributes, r.ReadCount(8));
  for (uint32_t i = 0; i < attributes; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view key, r.ReadString());
    SP_ASSIGN_OR_RETURN(std::string_view value, r.ReadString(UINT32_MAX));
    m->attributes.emplace(std::string(key), std::string(value));
  }
  return OkStatus();
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
  w.PutU32(kWireMagic);
  w.PutU32(m.version_major);
  w.PutU32(m.version_minor);
  w.PutString(m.save_id);
  w.PutU32(static_cast<uint32_t>(m.world_size));
  w.PutU8(static_cast<uint8_t>(m.format));
  w.PutU64(m.checksum_block_bytes);
  w.PutU32(static_cast<uint32_t>(m.files.size()));
  for (const DataFile& f : m.files) {
    w.PutString(f.name);
    w.PutU64(f.data_start);
    w.PutU64(f.size);
    w.PutU32(static_cast<uint32_t>(f.writer_rank));
  }
  w.PutU32(static_cast<uint32_t>(m.attributes.size()));
  for (const auto& [key, value] : m.attributes) {
    w.PutString(key);
    w.PutString(value);
  }
  w.PutU32(static_cast<uint32_t>(m.tensors.size()));
  // Each tensor behind its length, so that a receiver decodes them in parallel.
  for (const TensorMetadata& t : m.tensors) {
    const size_t at = out.size();
    w.PutU64(0);
    PutTensor(w, t);
    EncodeFixed64(out.data() + at, out.size() - at - 8);
  }
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
  return out;
}

Result<CheckpointMetadata> DecodeMetadataFromWire(std::string_view bytes, ThreadPool* pool,
                                                  const ChunkFilter* filter) {
  ByteReader r(bytes, "checkpoint metadata received from the coordinator");
  CheckpointMetadata m;
  SP_RETURN_IF_ERROR(GetHead(r, &m));
  const uint32_t file_count = static_cast<uint32_t>(m.files.size());
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
    SP_RETURN_IF_ERROR(GetTensor(tr, file_count, filter, &m.tensors[i]));
    if (tr.done()) return OkStatus();
    return DataLossError(tr.what() + ": " + std::to_string(tr.remaining()) + " trailing bytes");
  }));
  IndexChunkGrids(&m, pool);  // grids travel; the other tensors are indexed here
  SP_ASSIGN_OR_RETURN(uint32_t objects, r.ReadCount(4 + 1 + 4 + 1));
  m.objects.resize(objects);
  for (ObjectEntry& o : m.objects) SP_RETURN_IF_ERROR(GetObject(r, file_count, &o));
  if (!r.done()) {
    return DataLossError(r.what() + ": " + std::to_string(r.remaining()) + " trailing bytes");
  }
  return m;
}

}  // namespace sp
