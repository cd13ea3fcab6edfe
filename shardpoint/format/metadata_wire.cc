#include "shardpoint/format/metadata_wire.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "shardpoint/base/coding.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {
namespace {

// Numbers travel as varints (base/coding.h): counts, lengths and offsets unsigned, values that
// may be negative (shapes, boxes, steps) zigzagged. A chunk's file and offset travel as their
// steps from the chunk before it in the same tensor, so that cells laid out alike take a byte or
// two each.
constexpr uint32_t kWireMagic = 0x32575053;  // "SPW2"
// A load rank's part (EncodeMetadataPartForWire): the data files travel as their count and the
// files the part holds, each behind the step of its index.
constexpr uint32_t kWirePartMagic = 0x32505053;  // "SPP2"
constexpr uint32_t kMaxRank = 64;
// The most data files a part names (it holds few of them; the others take a default entry each).
constexpr uint32_t kMaxWireFiles = uint32_t{1} << 22;
// The longest tensor name, file name, save id and attribute key.
constexpr uint32_t kMaxNameBytes = uint32_t{1} << 20;

// The bytes of `v` as a varint.
size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

size_t SignedVarintBytes(int64_t v) { return VarintBytes(ZigZag(v)); }

void PutName(ByteWriter& w, std::string_view s) {
  w.PutVarint(s.size());
  w.PutRaw(s);
}

Result<std::string_view> GetName(ByteReader& r, uint64_t max_bytes = kMaxNameBytes) {
  const size_t at = r.position();
  SP_ASSIGN_OR_RETURN(uint64_t length, r.ReadVarint());
  if (length > max_bytes) {
    return DataLossError(r.what() + ": string length " + std::to_string(length) + " at byte " +
                         std::to_string(at) + " exceeds the limit " + std::to_string(max_bytes));
  }
  return r.ReadRaw(length);
}

void PutShape(ByteWriter& w, std::span<const int64_t> v) {
  w.PutVarint(v.size());
  for (int64_t x : v) w.PutSignedVarint(x);
}

size_t ShapeBytes(std::span<const int64_t> v) {
  size_t bytes = VarintBytes(v.size());
  for (int64_t x : v) bytes += SignedVarintBytes(x);
  return bytes;
}

template <typename Values>  // Shape or Dims
Status GetShape(ByteReader& r, Values* v) {
  SP_ASSIGN_OR_RETURN(uint32_t n, r.ReadVarintCount(1));
  if (n > kMaxRank) return DataLossError(r.what() + ": rank " + std::to_string(n));
  v->resize(n);
  for (int64_t& x : *v) {
    SP_ASSIGN_OR_RETURN(x, r.ReadSignedVarint());
  }
  return OkStatus();
}

// The file and data offset of the chunk before, in the same tensor: a chunk's file and offset
// travel as their steps from these (the first chunk's from file 0, offset 0).
struct Steps {
  int64_t file = 0;
  uint64_t offset = 0;
};

int64_t FileStep(const StoredChunk& c, const Steps& s) { return int64_t{c.file} - s.file; }
int64_t OffsetStep(const StoredChunk& c, const Steps& s) {
  return static_cast<int64_t>(c.data_offset - s.offset);  // modulo 2^64, undone by the reader
}

// A chunk's file and offset, as steps.
void PutPlace(ByteWriter& w, const StoredChunk& c, Steps* s) {
  w.PutSignedVarint(FileStep(c, *s));
  w.PutSignedVarint(OffsetStep(c, *s));
  *s = {int64_t{c.file}, c.data_offset};
}

void PutChecksums(ByteWriter& w, const StoredChunk& c) {
  w.PutVarint(c.block_crc32c.size());
  for (uint32_t crc : c.block_crc32c) w.PutU32(crc);
}

// A placed chunk's kind: its encoding, with this bit when a stored length and driver tag follow.
constexpr uint8_t kKindExtras = 0x80;

// Everything of a chunk but its box and byte length (which a grid cell implies).
void PutChunkPlacement(ByteWriter& w, const StoredChunk& c, Steps* s) {
  const bool extras = c.stored_length != 0 || c.driver_tag != 0;
  w.PutU8(static_cast<uint8_t>(c.encoding) | (extras ? kKindExtras : 0));
  if (extras) {
    w.PutVarint(c.stored_length);
    w.PutVarint(c.driver_tag);
  }
  PutPlace(w, c, s);
  PutChecksums(w, c);
}

size_t PlacementBytes(const StoredChunk& c, const Steps& s, bool raw) {
  size_t bytes = SignedVarintBytes(FileStep(c, s)) + SignedVarintBytes(OffsetStep(c, s)) +
                 VarintBytes(c.block_crc32c.size()) + 4 * c.block_crc32c.size();
  if (!raw) {
    bytes += 1;
    if (c.stored_length != 0 || c.driver_tag != 0) {
      bytes += VarintBytes(c.stored_length) + VarintBytes(c.driver_tag);
    }
  }
  return bytes;
}

void PutChunk(ByteWriter& w, const StoredChunk& c, Steps* s) {
  PutShape(w, c.box.offsets);
  PutShape(w, c.box.sizes);
  w.PutVarint(c.byte_length);
  PutChunkPlacement(w, c, s);
}

// The least bytes of a placement (kind, file and offset steps, checksum count), of a raw cell's
// (no kind) and of a listed chunk (two empty shapes and a byte length before its placement).
constexpr size_t kPlacementBytes = 4;
constexpr size_t kRawPlacementBytes = 3;
constexpr size_t kChunkBytes = 3 + kPlacementBytes;

// The data files a decoding holds: all of them, or a part's (EncodeMetadataPartForWire).
struct HeldFiles {
  uint32_t count = 0;
  std::vector<bool> held;  // empty: every file

  // kDataLoss unless `file` is a file this decoding holds.
  Status Check(const ByteReader& r, uint64_t file, std::string_view what) const {
    if (file >= count) return DataLossError(r.what() + ": " + std::string(what) + " out of range");
    if (!held.empty() && !held[file]) {
      return DataLossError(r.what() + ": " + std::string(what) + " " + std::to_string(file) +
                           " names a data file this part does not hold");
    }
    return OkStatus();
  }
};

// A chunk's file and offset from their steps (PutPlace), the file checked against `files`.
Status GetPlace(ByteReader& r, const HeldFiles& files, Steps* s, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(int64_t file_step, r.ReadSignedVarint());
  int64_t file = 0;
  if (__builtin_add_overflow(s->file, file_step, &file) || file < 0) {
    return DataLossError(r.what() + ": file index out of range");
  }
  SP_RETURN_IF_ERROR(files.Check(r, static_cast<uint64_t>(file), "file index"));
  SP_ASSIGN_OR_RETURN(int64_t offset_step, r.ReadSignedVarint());
  c->file = static_cast<uint32_t>(file);
  c->data_offset = s->offset + static_cast<uint64_t>(offset_step);
  *s = {file, c->data_offset};
  return OkStatus();
}

Status GetChecksums(ByteReader& r, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(uint32_t crcs, r.ReadVarintCount(4));
  c->block_crc32c.resize(crcs);
  for (uint32_t& crc : c->block_crc32c) {
    SP_ASSIGN_OR_RETURN(crc, r.ReadU32());
  }
  return OkStatus();
}

Status GetChunkPlacement(ByteReader& r, const HeldFiles& files, Steps* s, StoredChunk* c) {
  SP_ASSIGN_OR_RETURN(uint8_t kind, r.ReadU8());
  const uint8_t encoding = kind & ~kKindExtras;
  if (encoding > static_cast<uint8_t>(ChunkEncoding::kDriverDecoded)) {
    return DataLossError(r.what() + ": unknown chunk encoding " + std::to_string(encoding));
  }
  c->encoding = static_cast<ChunkEncoding>(encoding);
  if ((kind & kKindExtras) != 0) {
    SP_ASSIGN_OR_RETURN(c->stored_length, r.ReadVarint());
    SP_ASSIGN_OR_RETURN(uint64_t driver_tag, r.ReadVarint());
    if (driver_tag > UINT16_MAX) {
      return DataLossError(r.what() + ": driver tag " + std::to_string(driver_tag) +
                           " out of range (at most " + std::to_string(UINT16_MAX) + ")");
    }
    c->driver_tag = static_cast<uint16_t>(driver_tag);
  }
  SP_RETURN_IF_ERROR(GetPlace(r, files, s, c));
  return GetChecksums(r, c);
}

Status GetChunk(ByteReader& r, const HeldFiles& files, Steps* s, StoredChunk* c) {
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.offsets));
  SP_RETURN_IF_ERROR(GetShape(r, &c->box.sizes));
  SP_ASSIGN_OR_RETURN(c->byte_length, r.ReadVarint());
  return GetChunkPlacement(r, files, s, c);
}

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
  // Packed chunks are raw, with the lengths their boxes imply (ChunkList); with a grid, which the
  // decoder or IndexChunkGrids proved, its cells.
  if (t.chunks.packed()) return t.grid && t.grid->bounds.size() == t.shape.size();
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
                      // the chunks it keeps, each behind the step of its stored number, ascending
  kWirePartGrid = 4,  // a part of a grid: whether its cells are raw, the grid, then the cells it
                      // keeps, each behind the step of its number, as kWireGrid or kWireRawGrid
                      // place them
};

// The most cut points of one dimension of a part's grid, and the most cells (chunk numbers are
// 32-bit): its cells do not travel, so the bytes left do not bound them.
constexpr uint32_t kMaxPartGridCuts = uint32_t{1} << 24;
constexpr uint64_t kMaxPartGridCells = UINT32_MAX;

// Whether every chunk is raw with no stored length or driver tag (a native checkpoint's).
bool AllRaw(const TensorMetadata& t) {
  if (t.chunks.packed()) return true;
  for (const StoredChunk& c : t.chunks) {
    if (c.encoding != ChunkEncoding::kRaw || c.stored_length != 0 || c.driver_tag != 0) {
      return false;
    }
  }
  return true;
}

// One dimension's cut points: their count, then a step (cut k at k * step but the last, at the
// dimension) when they have that form, else each point's step from the one before (the first's
// from 0).
void PutBounds(ByteWriter& w, const std::vector<int64_t>& bounds) {
  const int64_t step = GridEvenStep(bounds);
  w.PutVarint(bounds.size());
  w.PutU8(step != 0 ? 1 : 0);
  if (step != 0) {
    w.PutSignedVarint(step);
  } else {
    int64_t previous = 0;
    for (int64_t x : bounds) {
      w.PutVarint(static_cast<uint64_t>(x - previous));
      previous = x;
    }
  }
}

// At most `max_count` cut points (what the cells behind them can pay for). Checked here only as
// far as reading them needs: the caller checks that they rise from 0 to the dimension.
Status GetBounds(ByteReader& r, int64_t dim, uint64_t max_count, std::vector<int64_t>* b) {
  SP_ASSIGN_OR_RETURN(uint64_t n, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(uint8_t even, r.ReadU8());
  if (n > max_count) return DataLossError(r.what() + ": too many grid cells");
  if (even == 1) {
    SP_ASSIGN_OR_RETURN(int64_t step, r.ReadSignedVarint());
    // n - 1 intervals of `step` but the last, the last cut before the dimension (no overflow).
    if (n < 3 || step <= 0 || step > dim || static_cast<int64_t>(n) - 2 > (dim - 1) / step) {
      return DataLossError(r.what() + ": bad grid step");
    }
    b->resize(n);
    for (uint64_t k = 0; k + 1 < n; ++k) (*b)[k] = static_cast<int64_t>(k) * step;
    (*b)[n - 1] = dim;
    return OkStatus();
  }
  if (even != 0 || n > r.remaining()) return DataLossError(r.what() + ": bad grid bounds");
  b->resize(n);
  int64_t previous = 0;
  for (int64_t& x : *b) {
    SP_ASSIGN_OR_RETURN(uint64_t step, r.ReadVarint());
    if (step > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_add_overflow(previous, static_cast<int64_t>(step), &x)) {
      return DataLossError(r.what() + ": bad grid bounds");
    }
    previous = x;
  }
  return OkStatus();
}

Status GetRawPlacement(ByteReader& r, const HeldFiles& files, Steps* s, StoredChunk* c) {
  SP_RETURN_IF_ERROR(GetPlace(r, files, s, c));
  return GetChecksums(r, c);
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
  SP_RETURN_IF_ERROR(GetGrid(r, *t, raw ? kRawPlacementBytes : kPlacementBytes, &grid));
  const uint64_t cells = grid.cell_count();
  t->chunks.reserve(keep == nullptr ? cells : 0);
  std::vector<uint32_t> kept;
  const uint64_t item = DTypeSize(t->dtype);
  Steps steps;
  for (uint64_t c = 0; c < cells; ++c) {
    StoredChunk chunk;
    chunk.box = GridCellBox(grid, c);
    const std::optional<uint64_t> bytes = CellBytes(chunk.box, item);
    if (!bytes) {
      return DataLossError(r.what() + ": a grid cell of tensor " + t->name + " is too large");
    }
    chunk.byte_length = *bytes;
    SP_RETURN_IF_ERROR(raw ? GetRawPlacement(r, files, &steps, &chunk)
                           : GetChunkPlacement(r, files, &steps, &chunk));
    KeepChunk(keep, static_cast<uint32_t>(c), std::move(chunk), &kept, t);
  }
  t->grid = std::move(grid);
  EndPart(keep, cells, std::move(kept), t);
  return OkStatus();
}

// A grid cell's placement: raw, its file, offset and checksums; else PutChunkPlacement.
void PutCell(ByteWriter& w, const StoredChunk& c, bool raw, Steps* s) {
  if (!raw) return PutChunkPlacement(w, c, s);
  PutPlace(w, c, s);
  PutChecksums(w, c);
}

// Chunk `c` of `t` as a raw cell (PutCell with `raw`), read through the chunk list's accessors:
// a list kept packed (ChunkList) is not unpacked.
void PutRawCell(ByteWriter& w, const TensorMetadata& t, size_t c, Steps* s) {
  const uint32_t file = t.chunks.file(c);
  const uint64_t offset = t.chunks.data_offset(c);
  w.PutSignedVarint(int64_t{file} - s->file);
  w.PutSignedVarint(static_cast<int64_t>(offset - s->offset));
  *s = {int64_t{file}, offset};
  const std::span<const uint32_t> crcs = t.chunks.block_crc32c(c);
  w.PutVarint(crcs.size());
  for (uint32_t crc : crcs) w.PutU32(crc);
}

// PlacementBytes of chunk `c` of `t` as a raw cell, through the accessors; `s` steps past it.
size_t RawCellBytes(const TensorMetadata& t, size_t c, Steps* s) {
  const uint32_t file = t.chunks.file(c);
  const uint64_t offset = t.chunks.data_offset(c);
  const size_t crcs = t.chunks.block_crc32c(c).size();
  const size_t bytes = SignedVarintBytes(int64_t{file} - s->file) +
                       SignedVarintBytes(static_cast<int64_t>(offset - s->offset)) +
                       VarintBytes(crcs) + 4 * crcs;
  *s = {int64_t{file}, offset};
  return bytes;
}

// Chunk `c` of `t` whole, as PutChunk writes it, read through the chunk list's accessors when it
// is packed (a packed chunk is raw, its byte length its box's): not unpacked.
void PutChunkOf(ByteWriter& w, const TensorMetadata& t, size_t c, Steps* s) {
  if (!t.chunks.packed()) return PutChunk(w, t.chunks[c], s);
  const Box box = t.chunks.box(c);
  PutShape(w, box.offsets);
  PutShape(w, box.sizes);
  w.PutVarint(static_cast<uint64_t>(box.volume()) * DTypeSize(t.dtype));
  w.PutU8(static_cast<uint8_t>(ChunkEncoding::kRaw));
  PutRawCell(w, t, c, s);
}

// The bytes PutChunkOf writes; `s` steps past the chunk.
size_t ChunkBytesOf(const TensorMetadata& t, size_t c, Steps* s) {
  if (!t.chunks.packed()) {
    const StoredChunk& chunk = t.chunks[c];
    const size_t bytes = PlacementBytes(chunk, *s, false) + ShapeBytes(chunk.box.offsets) +
                         ShapeBytes(chunk.box.sizes) + VarintBytes(chunk.byte_length);
    *s = {int64_t{chunk.file}, chunk.data_offset};
    return bytes;
  }
  const Box box = t.chunks.box(c);
  return ShapeBytes(box.offsets) + ShapeBytes(box.sizes) +
         VarintBytes(static_cast<uint64_t>(box.volume()) * DTypeSize(t.dtype)) + 1 +
         RawCellBytes(t, c, s);
}

}  // namespace

namespace wire_internal {
// How a tensor's chunks travel: a list, or the cells of its grid (raw or placed); for a grid,
// its cut points as PutBounds writes them.
struct CellsAs {
  uint8_t layout = 0;  // a WireLayout
  std::string bounds;
};

// A tensor's parts that most ranks are sent, encoded once, each behind its length: piece 0 holds
// none of its chunks and, for a tensor of at most kReadyChunks chunks, piece 1 all of them and
// piece 2 + c chunk c alone (a replicated tensor, or one split over a few tensor-parallel ranks,
// which a thousand ranks reach alike). Piece k is bytes[k == 0 ? 0 : ends[k - 1], ends[k]).
struct ReadyParts {
  static constexpr size_t kReadyChunks = 64;
  std::string bytes;
  std::vector<size_t> ends;

  std::string_view piece(size_t k) const {
    const size_t begin = k == 0 ? 0 : ends[k - 1];
    return std::string_view(bytes).substr(begin, ends[k] - begin);
  }
};
}  // namespace wire_internal

namespace {

using wire_internal::CellsAs;
using wire_internal::ReadyParts;

CellsAs HowCellsTravel(const TensorMetadata& t) {
  CellsAs how;
  if (!SendsGrid(t)) return how;
  how.layout = AllRaw(t) ? kWireRawGrid : kWireGrid;
  ByteWriter w(&how.bounds);
  for (const std::vector<int64_t>& bounds : t.grid->bounds) PutBounds(w, bounds);
  return how;
}

// `name` after `previous`: the bytes it shares with the start of `previous`, those it shares
// with its end, and the rest between them. Names in order (tensors sorted by name, data files
// by rank) share most of theirs: "d-<id>-r00017-f000.safetensors" after "d-<id>-r00003-f000..."
// takes five bytes. Of the ways to split what they share, the one that takes fewest bytes is
// written (a start of 128 bytes takes a byte more than one of 127, which may leave one more
// byte to the end), so that no input names a name in fewer bytes than its encoding again.
void PutNameAfter(ByteWriter& w, std::string_view previous, std::string_view name) {
  const size_t most = std::min(previous.size(), name.size());
  size_t front = 0;
  while (front < most && previous[front] == name[front]) ++front;
  size_t back = 0;  // the most both end with, whatever the start takes
  while (back < most && previous[previous.size() - 1 - back] == name[name.size() - 1 - back]) {
    ++back;
  }
  const auto cost = [&](size_t f) {
    const size_t b = std::min(back, most - f);
    const size_t rest = name.size() - f - b;
    return VarintBytes(f) + VarintBytes(b) + VarintBytes(rest) + rest;
  };
  size_t best = front;
  for (const size_t edge : {size_t{(1 << 21) - 1}, size_t{(1 << 14) - 1}, size_t{(1 << 7) - 1}}) {
    if (edge < front && cost(edge) < cost(best)) best = edge;
  }
  const size_t b = std::min(back, most - best);
  w.PutVarint(best);
  w.PutVarint(b);
  PutName(w, name.substr(best, name.size() - best - b));
}

// Every tensor's name, in order, each after the one before (PutNameAfter).
std::string EncodeNames(const CheckpointMetadata& m) {
  std::string out;
  ByteWriter w(&out);
  std::string_view previous;
  for (const TensorMetadata& t : m.tensors) {
    PutNameAfter(w, previous, t.name);
    previous = t.name;
  }
  return out;
}

// What the names of one input may take in all. Each shares bytes with the one before, so few
// bytes can name long names again and again: decoders stop at sixteen times the input's bytes.
struct NameBudget {
  explicit NameBudget(size_t input_bytes) : most(16 * uint64_t{input_bytes} + (1 << 16)) {}
  uint64_t most;
  uint64_t used = 0;
};

// The name PutNameAfter wrote after `previous`, into `name` (not `previous`), within `budget`.
Status GetNameAfter(ByteReader& r, std::string_view previous, NameBudget* budget,
                    std::string* name) {
  const size_t at = r.position();
  SP_ASSIGN_OR_RETURN(uint64_t front, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(uint64_t back, r.ReadVarint());
  if (front > previous.size() || back > previous.size() - front) {
    return DataLossError(r.what() + ": the name at byte " + std::to_string(at) + " shares " +
                         std::to_string(front) + " + " + std::to_string(back) +
                         " bytes with a name of " + std::to_string(previous.size()));
  }
  SP_ASSIGN_OR_RETURN(std::string_view rest, GetName(r, kMaxNameBytes - front - back));
  budget->used += front + back + rest.size();
  if (budget->used > budget->most) {
    return DataLossError(r.what() + ": the names up to byte " + std::to_string(r.position()) +
                         " take " + std::to_string(budget->used) + " bytes, more than the " +
                         std::to_string(budget->most) + " the input allows");
  }
  name->reserve(front + rest.size() + back);
  name->assign(previous.substr(0, front));
  name->append(rest);
  name->append(previous.substr(previous.size() - back));
  return OkStatus();
}

// A tensor's dtype and shape (its name travels in the table of names).
void PutTensorHead(ByteWriter& w, const TensorMetadata& t) {
  w.PutU8(DTypeCode(t.dtype));
  PutShape(w, t.shape);
}

// One tensor's bytes on the wire, its chunks as `how` says.
void PutTensor(ByteWriter& w, const TensorMetadata& t, const CellsAs& how) {
  PutTensorHead(w, t);
  w.PutU8(how.layout);
  Steps steps;
  if (how.layout != kWireChunks) {
    w.PutRaw(how.bounds);
    if (how.layout == kWireRawGrid) {
      for (size_t c = 0; c < t.chunks.size(); ++c) PutRawCell(w, t, c, &steps);
    } else {
      for (const StoredChunk& c : t.chunks) PutCell(w, c, false, &steps);
    }
  } else {
    w.PutVarint(t.chunks.size());
    for (size_t c = 0; c < t.chunks.size(); ++c) PutChunkOf(w, t, c, &steps);
  }
}

// At least the bytes of `t` on the wire, its name and length included (PutTensor): room to
// reserve, so that the broadcast of a large checkpoint is never copied by a growing buffer.
uint64_t WireTensorBound(const TensorMetadata& t) {
  const CellsAs how = HowCellsTravel(t);
  // dtype, shape, layout, and the cut points or the chunk count
  uint64_t bytes = 1 + ShapeBytes(t.shape) + 1 +
                   (how.layout != kWireChunks ? how.bounds.size() : VarintBytes(t.chunks.size()));
  Steps steps;
  if (how.layout == kWireRawGrid) {
    for (size_t c = 0; c < t.chunks.size(); ++c) bytes += RawCellBytes(t, c, &steps);
  } else if (how.layout == kWireChunks) {
    for (size_t c = 0; c < t.chunks.size(); ++c) bytes += ChunkBytesOf(t, c, &steps);
  } else {  // a grid's cells, each with its kind
    for (const StoredChunk& c : t.chunks) {
      bytes += PlacementBytes(c, steps, false);
      steps = {int64_t{c.file}, c.data_offset};
    }
  }
  // its length, and its name in the table (at most all of it, behind three numbers)
  return VarintBytes(bytes) + bytes + VarintBytes(t.name.size()) * 3 + t.name.size();
}

// The `count` chunks of a part of a tensor of `total` chunks, each behind the step of its stored
// number from the one before (ascending, below `total`), fewer than all; `read` reads the chunk
// numbered its first argument. With `keep`, only those of them it reaches are kept.
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
  uint64_t next = 0;  // the least number the next chunk may have
  for (uint32_t c = 0; c < count; ++c) {
    SP_ASSIGN_OR_RETURN(uint64_t step, r.ReadVarint());
    if (step >= total - next) {
      return DataLossError(r.what() + ": chunk number " + std::to_string(next) + " + " +
                           std::to_string(step) + " of the part of tensor " + t->name +
                           " is not below " + std::to_string(total));
    }
    const auto number = static_cast<uint32_t>(next + step);
    next = uint64_t{number} + 1;
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
  SP_ASSIGN_OR_RETURN(uint64_t total, r.ReadVarint());
  if (total > UINT32_MAX) {
    return DataLossError(r.what() + ": tensor " + t->name + " of " + std::to_string(total) +
                         " chunks (chunk numbers are 32-bit)");
  }
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadVarintCount(1 + kChunkBytes));
  Steps steps;
  return GetPartChunks(r, total, count, keep, t, [&](uint32_t, StoredChunk* chunk) {
    return GetChunk(r, files, &steps, chunk);
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
  SP_ASSIGN_OR_RETURN(uint32_t count,
                      r.ReadVarintCount(1 + (raw ? kRawPlacementBytes : kPlacementBytes)));
  const uint64_t item = DTypeSize(t->dtype);
  Steps steps;
  return GetPartChunks(r, grid.cell_count(), count, keep, t,
                       [&](uint32_t number, StoredChunk* chunk) -> Status {
    chunk->box = GridCellBox(grid, number);
    const std::optional<uint64_t> bytes = CellBytes(chunk->box, item);
    if (!bytes) {
      return DataLossError(r.what() + ": a grid cell of tensor " + t->name + " is too large");
    }
    chunk->byte_length = *bytes;
    return raw ? GetRawPlacement(r, files, &steps, chunk)
               : GetChunkPlacement(r, files, &steps, chunk);
  });
}

// A tensor whose name is set (the table of names travels before the tensors). With `filter`,
// the tensor keeps only the chunks it reaches (ChunkFilter), every chunk decoded and checked all
// the same.
Status GetTensor(ByteReader& r, const HeldFiles& files, const ChunkFilter* filter,
                 TensorMetadata* t) {
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
  SP_ASSIGN_OR_RETURN(uint32_t chunks, r.ReadVarintCount(kChunkBytes));
  t->chunks.reserve(keep == nullptr ? chunks : 0);
  std::vector<uint32_t> kept;
  Steps steps;
  for (uint32_t c = 0; c < chunks; ++c) {
    StoredChunk chunk;
    SP_RETURN_IF_ERROR(GetChunk(r, files, &steps, &chunk));
    KeepChunk(keep, c, std::move(chunk), &kept, t);
  }
  EndPart(keep, chunks, std::move(kept), t);
  return OkStatus();
}

Status GetObject(ByteReader& r, const HeldFiles& files, ObjectEntry* o) {
  SP_ASSIGN_OR_RETURN(std::string_view name, GetName(r));
  o->name = std::string(name);
  SP_ASSIGN_OR_RETURN(uint8_t encoding, r.ReadU8());
  if (!IsKnownObjectEncoding(encoding)) {
    return DataLossError(r.what() + ": unknown object encoding");
  }
  o->encoding = static_cast<ObjectEncoding>(encoding);
  SP_ASSIGN_OR_RETURN(std::string_view payload, GetName(r, UINT32_MAX));
  o->payload = std::string(payload);
  SP_ASSIGN_OR_RETURN(uint8_t stored, r.ReadU8());
  if (stored > 1) return DataLossError(r.what() + ": bad stored-object flag");
  if (stored == 1) {
    StoredObjectItem item;
    SP_ASSIGN_OR_RETURN(uint64_t file, r.ReadVarint());
    SP_RETURN_IF_ERROR(files.Check(r, file, "object file index"));
    item.file = static_cast<uint32_t>(file);
    SP_ASSIGN_OR_RETURN(item.offset, r.ReadVarint());
    SP_ASSIGN_OR_RETURN(item.length, r.ReadVarint());
    SP_ASSIGN_OR_RETURN(uint64_t driver_tag, r.ReadVarint());
    if (driver_tag > UINT32_MAX) {
      return DataLossError(r.what() + ": object driver tag " + std::to_string(driver_tag) +
                           " out of range");
    }
    item.driver_tag = static_cast<uint32_t>(driver_tag);
    o->stored = item;
  }
  return OkStatus();
}

// The least bytes of a data file on the wire: an empty name after the one before (three bytes),
// three one-byte numbers and the header CRC.
constexpr size_t kFileBytes = 10;

// A data file, its name after `previous` (the file before it in the message).
Status GetFile(ByteReader& r, std::string_view previous, NameBudget* names, DataFile* f) {
  SP_RETURN_IF_ERROR(GetNameAfter(r, previous, names, &f->name));
  SP_ASSIGN_OR_RETURN(f->data_start, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(f->size, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(int64_t writer, r.ReadSignedVarint());
  if (writer < INT32_MIN || writer > INT32_MAX) {
    return DataLossError(r.what() + ": writer rank " + std::to_string(writer) + " of data file '" +
                         f->name + "' out of range");
  }
  f->writer_rank = static_cast<int32_t>(writer);
  SP_ASSIGN_OR_RETURN(f->header_crc32c, r.ReadU32());
  return OkStatus();
}

Status GetHead(ByteReader& r, NameBudget* names, CheckpointMetadata* m, HeldFiles* files) {
  SP_ASSIGN_OR_RETURN(uint32_t magic, r.ReadU32());
  if (magic != kWireMagic && magic != kWirePartMagic) {
    return DataLossError(r.what() + ": bad magic");
  }
  SP_ASSIGN_OR_RETURN(uint64_t major, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(uint64_t minor, r.ReadVarint());
  if (major > UINT32_MAX || minor > UINT32_MAX) {
    return DataLossError(r.what() + ": format version " + std::to_string(major) + "." +
                         std::to_string(minor) + " out of range");
  }
  m->version_major = static_cast<uint32_t>(major);
  m->version_minor = static_cast<uint32_t>(minor);
  SP_ASSIGN_OR_RETURN(std::string_view save_id, GetName(r));
  m->save_id = std::string(save_id);
  SP_ASSIGN_OR_RETURN(int64_t world, r.ReadSignedVarint());
  if (world < INT32_MIN || world > INT32_MAX) {
    return DataLossError(r.what() + ": world size " + std::to_string(world) + " out of range");
  }
  m->world_size = static_cast<int32_t>(world);
  SP_ASSIGN_OR_RETURN(uint8_t format, r.ReadU8());
  if (format > static_cast<uint8_t>(CheckpointFormat::kSafetensors)) {
    return DataLossError(r.what() + ": unknown format " + std::to_string(format));
  }
  m->format = static_cast<CheckpointFormat>(format);
  SP_ASSIGN_OR_RETURN(m->checksum_block_bytes, r.ReadVarint());
  SP_ASSIGN_OR_RETURN(uint8_t file_checksums, r.ReadU8());
  // Bit 0: the data files' headers hold their checksums; bit 1: the chunks hold none (format 4).
  if (file_checksums > 3 || file_checksums == 2) {
    return DataLossError(r.what() + ": data file checksums flag " +
                         std::to_string(file_checksums));
  }
  m->data_file_checksums = (file_checksums & 1) != 0;
  m->checksums_in_headers = (file_checksums & 2) != 0;
  if (magic == kWireMagic) {
    SP_ASSIGN_OR_RETURN(files->count, r.ReadVarintCount(kFileBytes));
    m->files.resize(files->count);
    std::string_view previous;
    for (DataFile& f : m->files) {
      SP_RETURN_IF_ERROR(GetFile(r, previous, names, &f));
      previous = f.name;
    }
  } else {
    // Files not held stay without a name (CheckpointMetadata::files); the count is bounded by
    // what a receiver may allocate for them, not by the bytes left.
    SP_ASSIGN_OR_RETURN(uint64_t count, r.ReadVarint());
    if (count > kMaxWireFiles) {
      return DataLossError(r.what() + ": " + std::to_string(count) + " data files (at most " +
                           std::to_string(kMaxWireFiles) + ")");
    }
    files->count = static_cast<uint32_t>(count);
    SP_ASSIGN_OR_RETURN(uint32_t held, r.ReadVarintCount(1 + kFileBytes));
    m->files.resize(files->count);
    files->held.assign(files->count, false);
    uint64_t next = 0;  // the least index the next file may have
    std::string_view previous;
    for (uint32_t i = 0; i < held; ++i) {
      SP_ASSIGN_OR_RETURN(uint64_t step, r.ReadVarint());
      if (next >= files->count || step >= files->count - next) {
        return DataLossError(r.what() + ": data file index " + std::to_string(next) + " + " +
                             std::to_string(step) + " is not below " +
                             std::to_string(files->count));
      }
      const uint64_t index = next + step;
      next = index + 1;
      files->held[index] = true;
      SP_RETURN_IF_ERROR(GetFile(r, previous, names, &m->files[index]));
      previous = m->files[index].name;
    }
  }
  SP_ASSIGN_OR_RETURN(uint32_t attributes, r.ReadVarintCount(2));
  for (uint32_t i = 0; i < attributes; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view key, GetName(r));
    SP_ASSIGN_OR_RETURN(std::string_view value, GetName(r, UINT32_MAX));
    m->attributes.emplace(std::string(key), std::string(value));
  }
  return OkStatus();
}

void PutFile(ByteWriter& w, std::string_view previous, const DataFile& f) {
  PutNameAfter(w, previous, f.name);
  w.PutVarint(f.data_start);
  w.PutVarint(f.size);
  w.PutSignedVarint(f.writer_rank);
  w.PutU32(f.header_crc32c);
}

// Everything before the tensors. With `held`, only the files it marks travel, behind the step of
// their index.
void PutHead(ByteWriter& w, const CheckpointMetadata& m, const std::vector<bool>* held) {
  w.PutU32(held == nullptr ? kWireMagic : kWirePartMagic);
  w.PutVarint(m.version_major);
  w.PutVarint(m.version_minor);
  PutName(w, m.save_id);
  w.PutSignedVarint(m.world_size);
  w.PutU8(static_cast<uint8_t>(m.format));
  w.PutVarint(m.checksum_block_bytes);
  w.PutU8((m.data_file_checksums ? 1 : 0) | (m.checksums_in_headers ? 2 : 0));
  w.PutVarint(m.files.size());
  std::string_view previous;
  if (held == nullptr) {
    for (const DataFile& f : m.files) {
      PutFile(w, previous, f);
      previous = f.name;
    }
  } else {
    w.PutVarint(static_cast<uint64_t>(std::count(held->begin(), held->end(), true)));
    uint64_t next = 0;
    for (uint32_t i = 0; i < m.files.size(); ++i) {
      if (!(*held)[i]) continue;
      w.PutVarint(i - next);
      next = uint64_t{i} + 1;
      PutFile(w, previous, m.files[i]);
      previous = m.files[i].name;
    }
  }
  w.PutVarint(m.attributes.size());
  for (const auto& [key, value] : m.attributes) {
    PutName(w, key);
    PutName(w, value);
  }
}

void PutObjects(ByteWriter& w, const CheckpointMetadata& m) {
  w.PutVarint(m.objects.size());
  for (const ObjectEntry& o : m.objects) {
    PutName(w, o.name);
    w.PutU8(static_cast<uint8_t>(o.encoding));
    PutName(w, o.payload);
    w.PutU8(o.stored ? 1 : 0);
    if (o.stored) {
      w.PutVarint(o.stored->file);
      w.PutVarint(o.stored->offset);
      w.PutVarint(o.stored->length);
      w.PutVarint(o.stored->driver_tag);
    }
  }
}

// What `put` writes to `out`, behind its length as a varint, so that a receiver decodes the
// tensors in parallel. Most tensors of a part take less than 128 bytes, and their length one
// byte; a longer one is moved up by the bytes its length takes past that one.
template <typename Put>
void PutBehindLength(std::string& out, Put put) {
  const size_t at = out.size();
  out.push_back('\0');
  put();
  const size_t length = out.size() - at - 1;
  if (length < 0x80) {
    out[at] = static_cast<char>(length);
    return;
  }
  std::string prefix;
  ByteWriter(&prefix).PutVarint(length);
  out.insert(at + 1, prefix.size() - 1, '\0');
  std::memcpy(out.data() + at, prefix.data(), prefix.size());
}

// The chunks `kept` of `t` (fewer than all), as a part of its grid when it travels as one (`how`)
// and that takes fewer bytes than their boxes, else as a list of chunks.
void PutPartTensor(ByteWriter& w, const TensorMetadata& t, std::span<const uint32_t> kept,
                   const CellsAs& how) {
  PutTensorHead(w, t);
  if (how.layout != kWireChunks) {
    const bool raw = how.layout == kWireRawGrid;
    // The bytes of the kept chunks as cells and as a list, their numbers' steps aside (alike).
    uint64_t as_cells = 1 + how.bounds.size(), as_list = VarintBytes(t.chunks.size());
    Steps steps;
    if (t.chunks.packed()) {  // raw cells of the grid, read without unpacking them
      const uint64_t item = DTypeSize(t.dtype);
      const ChunkGrid& grid = *t.grid;
      const size_t rank = grid.bounds.size();
      for (uint32_t c : kept) {
        const size_t placement = RawCellBytes(t, c, &steps);
        // The cell's box as ShapeBytes counts it, found interval by interval (GridCellBox).
        size_t box_bytes = 2 * VarintBytes(rank);
        uint64_t volume = 1, index = c;
        for (size_t d = 0; d < rank; ++d) {
          const uint64_t k = index / grid.strides[d];
          index %= grid.strides[d];
          const int64_t begin = grid.bounds[d][k], size = grid.bounds[d][k + 1] - begin;
          box_bytes += SignedVarintBytes(begin) + SignedVarintBytes(size);
          volume *= static_cast<uint64_t>(size);
        }
        as_cells += placement;
        as_list += placement + 1 + box_bytes + VarintBytes(volume * item);
      }
    } else {
      for (uint32_t c : kept) {
        const StoredChunk& chunk = t.chunks[c];
        as_cells += PlacementBytes(chunk, steps, raw);
        as_list += PlacementBytes(chunk, steps, false) + ShapeBytes(chunk.box.offsets) +
                   ShapeBytes(chunk.box.sizes) + VarintBytes(chunk.byte_length);
        steps = {int64_t{chunk.file}, chunk.data_offset};
      }
    }
    if (as_cells < as_list) {
      w.PutU8(kWirePartGrid);
      w.PutU8(raw ? 1 : 0);
      w.PutRaw(how.bounds);
      w.PutVarint(kept.size());
      uint64_t next = 0;
      Steps places;
      for (uint32_t c : kept) {
        w.PutVarint(c - next);
        next = uint64_t{c} + 1;
        if (raw) {
          PutRawCell(w, t, c, &places);
        } else {
          PutCell(w, t.chunks[c], false, &places);
        }
      }
      return;
    }
  }
  w.PutU8(kWirePart);
  w.PutVarint(t.chunks.size());
  w.PutVarint(kept.size());
  uint64_t next = 0;
  Steps places;
  for (uint32_t c : kept) {
    w.PutVarint(c - next);
    next = uint64_t{c} + 1;
    PutChunkOf(w, t, c, &places);
  }
}

}  // namespace

uint64_t WireMetadataBound(const CheckpointMetadata& m) {
  uint64_t bound = 4 + VarintBytes(m.version_major) + VarintBytes(m.version_minor) +
                   VarintBytes(m.save_id.size()) + m.save_id.size() +
                   SignedVarintBytes(m.world_size) + 2 + VarintBytes(m.checksum_block_bytes) +
                   VarintBytes(m.files.size()) + VarintBytes(m.attributes.size()) +
                   VarintBytes(m.tensors.size()) + VarintBytes(m.objects.size());
  for (const DataFile& f : m.files) {
    bound += 3 * VarintBytes(f.name.size()) + f.name.size() + VarintBytes(f.data_start) +
             VarintBytes(f.size) + SignedVarintBytes(f.writer_rank) + 4;
  }
  for (const auto& [key, value] : m.attributes) {
    bound += VarintBytes(key.size()) + key.size() + VarintBytes(value.size()) + value.size();
  }
  for (const TensorMetadata& t : m.tensors) bound += WireTensorBound(t);
  for (const ObjectEntry& o : m.objects) {
    bound += VarintBytes(o.name.size()) + o.name.size() + 1 + VarintBytes(o.payload.size()) +
             o.payload.size() + 1 + (o.stored ? 4 * 10 : 0);
  }
  return bound;
}

std::string EncodeMetadataForWire(const CheckpointMetadata& m) {
  std::string out;
  out.reserve(WireMetadataBound(m));
  ByteWriter w(&out);
  PutHead(w, m, nullptr);
  w.PutVarint(m.tensors.size());
  w.PutRaw(EncodeNames(m));
  for (const TensorMetadata& t : m.tensors) {
    PutBehindLength(out, [&] { PutTensor(w, t, HowCellsTravel(t)); });
  }
  PutObjects(w, m);
  return out;
}

MetadataPartEncoder::MetadataPartEncoder(const CheckpointMetadata& metadata, ThreadPool* pool)
    : metadata_(metadata),
      how_(metadata.tensors.size()),
      ready_(metadata.tensors.size()),
      names_(EncodeNames(metadata)),
      names_sorted_(std::adjacent_find(metadata.tensors.begin(), metadata.tensors.end(),
                                       [](const TensorMetadata& a, const TensorMetadata& b) {
                                         return !(a.name < b.name);
                                       }) == metadata.tensors.end()) {
  (void)ParallelFor(pool, static_cast<int64_t>(how_.size()), [&](int64_t t) {
    const TensorMetadata& tensor = metadata_.tensors[t];
    how_[t] = HowCellsTravel(tensor);
    ReadyParts& ready = ready_[t];
    ByteWriter w(&ready.bytes);
    PutBehindLength(ready.bytes, [&] { PutPartTensor(w, tensor, {}, how_[t]); });
    ready.ends.push_back(ready.bytes.size());
    if (tensor.chunks.size() > ReadyParts::kReadyChunks) return OkStatus();
    PutBehindLength(ready.bytes, [&] { PutTensor(w, tensor, how_[t]); });
    ready.ends.push_back(ready.bytes.size());
    for (uint32_t c = 0; c < tensor.chunks.size(); ++c) {
      PutBehindLength(ready.bytes, [&] {
        if (tensor.chunks.size() == 1) return PutTensor(w, tensor, how_[t]);
        PutPartTensor(w, tensor, std::span<const uint32_t>(&c, 1), how_[t]);
      });
      ready.ends.push_back(ready.bytes.size());
    }
    return OkStatus();
  });
}

MetadataPartEncoder::~MetadataPartEncoder() = default;

std::string MetadataPartEncoder::Encode(const ChunkFilter& filter) const {
  std::vector<std::span<const Box>> boxes(metadata_.tensors.size());
  auto it = filter.begin();
  for (size_t t = 0; t < boxes.size(); ++t) {
    const std::string& name = metadata_.tensors[t].name;
    if (!names_sorted_) {
      it = filter.find(name);
    } else {  // the filter's names and the tensors' are in the same order: one walk pairs them
      while (it != filter.end() && it->first < name) ++it;
    }
    if (it != filter.end() && it->first == name) boxes[t] = it->second;
  }
  std::string out;
  EncodeBoxes(boxes, &out);
  return out;
}

void MetadataPartEncoder::EncodeTo(const ChunkFilterList& filter, std::string* out) const {
  std::vector<std::span<const Box>> boxes(metadata_.tensors.size());
  size_t f = 0;
  for (size_t t = 0; t < boxes.size(); ++t) {
    const std::string_view name = metadata_.tensors[t].name;
    if (!names_sorted_) {  // a binary search of the filter's names, which are sorted
      size_t lo = 0, hi = filter.size();
      while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (filter.name(mid) < name) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      f = lo;
    } else {
      while (f < filter.size() && filter.name(f) < name) ++f;
    }
    if (f < filter.size() && filter.name(f) == name) boxes[t] = filter.boxes(f);
  }
  EncodeBoxes(boxes, out);
}

void MetadataPartEncoder::EncodeBoxes(std::span<const std::span<const Box>> boxes,
                                      std::string* out) const {
  const CheckpointMetadata& m = metadata_;
  // The chunks each tensor's boxes reach, one tensor after the other in `reached`; a tensor whose
  // chunks are all reached travels whole.
  std::vector<uint32_t> reached;
  std::vector<size_t> reached_end(m.tensors.size());
  std::vector<bool> held(m.files.size(), false);
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    AppendChunksReached(m.tensors[t], boxes[t], &reached);
    reached_end[t] = reached.size();
  }
  // In a pass of its own: each chunk reached is most likely a cache miss (a rank reaches one
  // chunk of most tensors, 128 bytes among hundreds of MiB of them), and here the misses do not
  // wait for one another or for the searches above.
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& tensor = m.tensors[t];
    const size_t first = t == 0 ? 0 : reached_end[t - 1];
    if (reached_end[t] - first == tensor.chunks.size()) {
      for (size_t c = 0; c < tensor.chunks.size(); ++c) held[tensor.chunks.file(c)] = true;
    } else {
      for (size_t i = first; i < reached_end[t]; ++i) held[tensor.chunks.file(reached[i])] = true;
    }
  }
  for (const ObjectEntry& o : m.objects) {
    if (o.stored) held[o.stored->file] = true;
  }
  // About a hundred bytes a tensor besides the names (a chunk's box, place and checksum, the
  // tensor's shape), so that the part is seldom moved as it grows.
  out->reserve(out->size() + names_.size() + 128 * m.tensors.size());
  ByteWriter w(out);
  PutHead(w, m, &held);
  w.PutVarint(m.tensors.size());
  w.PutRaw(names_);
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& tensor = m.tensors[t];
    const size_t first = t == 0 ? 0 : reached_end[t - 1];
    const std::span<const uint32_t> kept(reached.data() + first, reached_end[t] - first);
    const bool whole = kept.size() == tensor.chunks.size();
    const ReadyParts& ready = ready_[t];
    if (kept.empty() && !whole) {
      out->append(ready.piece(0));
    } else if (ready.ends.size() > 1 && (whole || kept.size() == 1)) {
      out->append(ready.piece(whole ? 1 : 2 + kept[0]));
    } else {
      PutBehindLength(*out, [&] {
        if (whole) return PutTensor(w, tensor, how_[t]);
        PutPartTensor(w, tensor, kept, how_[t]);
      });
    }
  }
  PutObjects(w, m);
}

std::string EncodeMetadataPartForWire(const CheckpointMetadata& m, const ChunkFilter& filter) {
  return MetadataPartEncoder(m).Encode(filter);
}

// Names sorted, each after the one before (PutNameAfter), and their boxes.
std::string EncodeChunkFilter(const ChunkFilter& filter) {
  std::string out;
  ByteWriter w(&out);
  w.PutVarint(filter.size());
  std::string_view previous;
  for (const auto& [name, boxes] : filter) {
    PutNameAfter(w, previous, name);
    previous = name;
    w.PutVarint(boxes.size());
    for (const Box& box : boxes) {
      PutShape(w, box.offsets);
      PutShape(w, box.sizes);
    }
  }
  return out;
}

Result<ChunkFilterList> DecodeChunkFilterList(std::string_view bytes, std::string_view what) {
  ByteReader r(bytes, std::string(what));
  ChunkFilterList filter;
  SP_ASSIGN_OR_RETURN(uint32_t names, r.ReadVarintCount(4));
  filter.name_ends_.reserve(names);
  filter.box_ends_.reserve(names);
  std::string previous, name;
  NameBudget budget(bytes.size());
  for (uint32_t i = 0; i < names; ++i) {
    SP_RETURN_IF_ERROR(GetNameAfter(r, previous, &budget, &name));
    if (i > 0 && name <= previous) {
      return DataLossError(r.what() + ": tensor names out of order at '" + name + "'");
    }
    filter.names_ += name;
    filter.name_ends_.push_back(filter.names_.size());
    SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadVarintCount(2));
    const size_t first = filter.boxes_.size();
    filter.boxes_.resize(first + count);
    for (size_t b = first; b < filter.boxes_.size(); ++b) {
      Box& box = filter.boxes_[b];
      SP_RETURN_IF_ERROR(GetShape(r, &box.offsets));
      SP_RETURN_IF_ERROR(GetShape(r, &box.sizes));
      if (box.offsets.size() != box.sizes.size()) {
        return DataLossError(r.what() + ": a box of tensor '" + name + "' has " +
                             std::to_string(box.offsets.size()) + " offsets and " +
                             std::to_string(box.sizes.size()) + " sizes");
      }
    }
    filter.box_ends_.push_back(filter.boxes_.size());
    std::swap(previous, name);
  }
  if (!r.done()) {
    return DataLossError(r.what() + ": " + std::to_string(r.remaining()) + " trailing bytes");
  }
  return filter;
}

Result<ChunkFilter> DecodeChunkFilter(std::string_view bytes, std::string_view what) {
  SP_ASSIGN_OR_RETURN(const ChunkFilterList list, DecodeChunkFilterList(bytes, what));
  ChunkFilter filter;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::span<const Box> boxes = list.boxes(i);
    filter.emplace_hint(filter.end(), list.name(i), std::vector<Box>(boxes.begin(), boxes.end()));
  }
  return filter;
}

Result<CheckpointMetadata> DecodeMetadataFromWire(std::string_view bytes, ThreadPool* pool,
                                                  const ChunkFilter* filter) {
  ByteReader r(bytes, "checkpoint metadata received from the coordinator");
  CheckpointMetadata m;
  HeldFiles files;
  NameBudget names(bytes.size());
  SP_RETURN_IF_ERROR(GetHead(r, &names, &m, &files));
  // Per tensor, at least a name (three bytes), a length (one) and dtype, rank and layout.
  SP_ASSIGN_OR_RETURN(uint32_t tensors, r.ReadVarintCount(3 + 1 + 3));
  m.tensors.resize(tensors);
  for (uint32_t i = 0; i < tensors; ++i) {
    const std::string_view previous = i == 0 ? std::string_view() : m.tensors[i - 1].name;
    SP_RETURN_IF_ERROR(GetNameAfter(r, previous, &names, &m.tensors[i].name));
  }
  // Where each tensor's bytes are, then the tensors, on `pool`; the first error by position.
  std::vector<std::pair<size_t, std::string_view>> records(tensors);
  for (auto& [at, record] : records) {
    SP_ASSIGN_OR_RETURN(uint64_t length, r.ReadVarint());
    at = r.position();
    if (length > r.remaining()) {
      return DataLossError(r.what() + ": tensor of " + std::to_string(length) + " bytes at byte " +
                           std::to_string(at) + ", " + std::to_string(r.remaining()) + " left");
    }
    SP_ASSIGN_OR_RETURN(record, r.ReadRaw(length));
  }
  SP_RETURN_IF_ERROR(ParallelForInOrder(pool, tensors, [&](int64_t i) -> Status {
    const auto& [at, record] = records[i];
    ByteReader tr(record, r.what() + ", tensor at byte " + std::to_string(at));
    SP_RETURN_IF_ERROR(GetTensor(tr, files, filter, &m.tensors[i]));
    if (tr.done()) return OkStatus();
    return DataLossError(tr.what() + ": " + std::to_string(tr.remaining()) + " trailing bytes");
  }));
  IndexChunkGrids(&m, pool);  // grids travel; the other tensors are indexed here
  SP_ASSIGN_OR_RETURN(uint32_t objects, r.ReadVarintCount(1 + 1 + 1 + 1));
  m.objects.resize(objects);
  for (ObjectEntry& o : m.objects) SP_RETURN_IF_ERROR(GetObject(r, files, &o));
  if (!r.done()) {
    return DataLossError(r.what() + ": " + std::to_string(r.remaining()) + " trailing bytes");
  }
  return m;
}

}  // namespace sp
