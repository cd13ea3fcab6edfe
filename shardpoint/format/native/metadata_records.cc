// Tensor and object records of the native metadata file (docs/FORMAT.md §3.5-3.6).
#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/native/metadata_sections.h"

namespace sp::native_metadata {
namespace {

// Reads the shape and returns the tensor's byte size (at most kMaxTensorBytes).
Result<uint64_t> DecodeShape(ByteReader& r, DType dtype, size_t rank, std::string_view where,
                             std::string_view path, Shape* shape) {
  uint64_t bytes = DTypeSize(dtype);
  shape->resize(rank);
  for (int64_t& dim : *shape) {
    SP_ASSIGN_OR_RETURN(dim, r.ReadI64());
    if (dim < 0 || dim > kMaxDimension) {
      return Corrupt(path, std::string(where) + ": dimension " + std::to_string(dim) +
                               " is out of range [0, 2^62]");
    }
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes) ||
        bytes > kMaxTensorBytes) {
      return Corrupt(path, std::string(where) + ": size exceeds 2^62 bytes");
    }
  }
  return bytes;
}

// Where a chunk is, for messages: "<tensor's where> chunk <index>". Built only for a message: a
// record holds millions of chunks, and a string per chunk cost a heap allocation each.
struct ChunkWhere {
  std::string_view tensor;
  uint64_t index;
  std::string str() const { return std::string(tensor) + " chunk " + std::to_string(index); }
};

// Reads one chunk's box (i64 values, or varints in a packed record), checks it lies in `shape`,
// and returns its volume.
Result<uint64_t> DecodeBox(ByteReader& r, const Shape& shape, const ChunkWhere& where,
                           std::string_view path, bool packed, Box* box) {
  box->offsets.resize(shape.size());
  box->sizes.resize(shape.size());
  const auto read = [&](int64_t* v) -> Status {
    if (packed) {
      SP_ASSIGN_OR_RETURN(uint64_t u, r.ReadVarint());
      *v = static_cast<int64_t>(u);  // past 2^63: negative, refused below
    } else {
      SP_ASSIGN_OR_RETURN(*v, r.ReadI64());
    }
    return OkStatus();
  };
  for (int64_t& v : box->offsets) SP_RETURN_IF_ERROR(read(&v));
  for (int64_t& v : box->sizes) SP_RETURN_IF_ERROR(read(&v));
  uint64_t volume = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t offset = box->offsets[d];
    int64_t size = box->sizes[d];
    if (size < 0 || size > shape[d] || offset < 0 || offset > shape[d] - size) {
      return Corrupt(path, where.str() + ": dimension " + std::to_string(d) + " [" +
                               std::to_string(offset) + ", +" + std::to_string(size) +
                               ") lies outside the shape " + ShapeToString(shape));
    }
    volume *= static_cast<uint64_t>(size);  // each size <= its dimension: no overflow
  }
  return volume;
}

// Whether [data_offset, +byte_length) lies within the data bytes of `file` (compared without
// wrapping).
bool InDataBytes(const DataFile& file, uint64_t data_offset, uint64_t byte_length) {
  // The summary's checks hold data_start <= size.
  const uint64_t data_bytes = file.size - file.data_start;
  return data_offset <= data_bytes && byte_length <= data_bytes - data_offset;
}

// The fewest bytes a grid cell takes in a record of version `major`: its file and offset at fixed
// width (12 bytes), or, packed, its checksum (a cell holds at least one element; runs of cells
// share their file and offset steps). Its count is checked against them before anything is
// allocated for it. From version 4 a cell takes no bytes of its own (its checksums are in its
// data file's header): the cells of a whole metadata file are bounded instead (GridCellBudget).
constexpr uint64_t GridCellBytes(uint32_t major) { return major >= 4 ? 0 : major >= 3 ? 4 : 12; }

// Whether records of version `major` hold their chunks' block checksums (before version 4).
constexpr bool RecordsHoldChecksums(uint32_t major) { return major < 4; }

Status CheckChunkBytes(const StoredChunk& chunk, uint64_t expected_bytes,
                       const CheckpointMetadata& summary, const ChunkWhere& where,
                       std::string_view path) {
  if (chunk.byte_length != expected_bytes) {
    return Corrupt(path, where.str() + ": byte length " +
                             std::to_string(chunk.byte_length) + ", expected " +
                             std::to_string(expected_bytes) + " for box " + chunk.box.ToString());
  }
  if (chunk.file >= summary.files.size()) {
    return Corrupt(path, where.str() + ": file index " + std::to_string(chunk.file) +
                             " is out of range (" + std::to_string(summary.files.size()) +
                             " files)");
  }
  const DataFile& file = summary.files[chunk.file];
  if (!InDataBytes(file, chunk.data_offset, chunk.byte_length)) {
    return Corrupt(path, where.str() + ": bytes [" + std::to_string(chunk.data_offset) +
                             ", +" + std::to_string(chunk.byte_length) + ") lie outside the " +
                             std::to_string(file.size - file.data_start) + " data bytes of " +
                             file.name);
  }
  return OkStatus();
}

// The file a packed record gives as `delta` past `previous`, or kDataLoss when it cannot be one
// (a file index is a u32; CheckChunkBytes checks it against the summary's files).
Result<uint32_t> PackedFile(int64_t previous, int64_t delta, const CheckpointMetadata& summary,
                            const ChunkWhere& where, std::string_view path) {
  int64_t file = 0;
  if (__builtin_add_overflow(previous, delta, &file) || file < 0 || file > UINT32_MAX) {
    return Corrupt(path, where.str() + ": file index " +
                             (file < 0 || file > UINT32_MAX ? std::to_string(previous) + " + " +
                                                                  std::to_string(delta)
                                                            : std::to_string(file)) +
                             " is out of range (" + std::to_string(summary.files.size()) +
                             " files)");
  }
  return static_cast<uint32_t>(file);
}

// One chunk of a chunk list. A packed record (version 3) gives the file and the data offset as
// signed varints past the previous chunk's (`previous`, updated), the box as varints, no byte
// length (the box's) and the block count as a varint; version 1 and 2 records give them all at
// fixed width.
Status DecodeChunk(ByteReader& r, const TensorMetadata& tensor, const CheckpointMetadata& summary,
                   const ChunkWhere& where, std::string_view path, bool packed,
                   StoredChunk* previous, StoredChunk* chunk, uint64_t* volume) {
  uint64_t block_count = 0;
  if (packed) {
    SP_ASSIGN_OR_RETURN(int64_t file_delta, r.ReadSignedVarint());
    SP_ASSIGN_OR_RETURN(chunk->file, PackedFile(previous->file, file_delta, summary, where, path));
    SP_ASSIGN_OR_RETURN(int64_t offset_delta, r.ReadSignedVarint());
    chunk->data_offset = previous->data_offset + static_cast<uint64_t>(offset_delta);  // wraps
    SP_ASSIGN_OR_RETURN(*volume, DecodeBox(r, tensor.shape, where, path, true, &chunk->box));
    chunk->byte_length = *volume * DTypeSize(tensor.dtype);  // within the tensor's 2^62 bytes
    if (!RecordsHoldChecksums(summary.version_major)) {
      previous->file = chunk->file;
      previous->data_offset = chunk->data_offset;
      return CheckChunkBytes(*chunk, chunk->byte_length, summary, where, path);
    }
    SP_ASSIGN_OR_RETURN(block_count, r.ReadVarint());
    previous->file = chunk->file;
    previous->data_offset = chunk->data_offset;
  } else {
    SP_ASSIGN_OR_RETURN(chunk->file, r.ReadU32());
    SP_ASSIGN_OR_RETURN(chunk->data_offset, r.ReadU64());
    SP_ASSIGN_OR_RETURN(chunk->byte_length, r.ReadU64());
    SP_ASSIGN_OR_RETURN(*volume, DecodeBox(r, tensor.shape, where, path, false, &chunk->box));
  }
  SP_RETURN_IF_ERROR(
      CheckChunkBytes(*chunk, *volume * DTypeSize(tensor.dtype), summary, where, path));
  if (!packed) {
    SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(4));
    block_count = count;
  }
  const uint64_t expected = ChecksumBlockCount(chunk->byte_length, summary.checksum_block_bytes);
  if (block_count != expected) {
    return Corrupt(path, where.str() + ": " + std::to_string(block_count) +
                             " block checksums, expected " + std::to_string(expected));
  }
  if (block_count > r.remaining() / 4) {
    return Corrupt(path, where.str() + ": " + std::to_string(block_count) +
                             " block checksums cannot fit in the " +
                             std::to_string(r.remaining()) + " remaining bytes");
  }
  chunk->block_crc32c.resize(block_count);
  for (uint32_t& crc : chunk->block_crc32c) {
    SP_ASSIGN_OR_RETURN(crc, r.ReadU32());
  }
  return OkStatus();
}

// The block checksums chunk `c` of `tensor` is encoded with: those kept `apart` when given,
// otherwise the chunk's own.
std::span<const uint32_t> BlockCrcs(const TensorMetadata& tensor,
                                    const ChunkChecksums::Tensor* apart, size_t c) {
  if (apart != nullptr) return apart->of(c);
  if (tensor.cells) return {};  // cells hold none
  const InlineVector<uint32_t, 2>& own = tensor.chunks[c].block_crc32c;
  return std::span<const uint32_t>(own.data(), own.size());
}

// The grid a record of version `major` (2 or later) stores `tensor` as, or nullopt for a chunk
// list: every chunk raw (with the block checksums of `checksum_block_bytes`, before version 4),
// and the chunks the cells of a grid.
std::optional<ChunkGrid> StoredGrid(const TensorMetadata& tensor,
                                    const ChunkChecksums::Tensor* apart,
                                    uint64_t checksum_block_bytes, uint32_t major) {
  if (checksum_block_bytes == 0) return std::nullopt;  // invalid; the list shows the decoder why
  if (!RecordsHoldChecksums(major)) {
    if (tensor.cells) return tensor.grid;
    for (const StoredChunk& chunk : tensor.chunks) {
      if (chunk.encoding != ChunkEncoding::kRaw) return std::nullopt;
    }
    return FindChunkGrid(tensor.chunks, tensor.shape);
  }
  if (tensor.cells) {  // raw cells of a grid: a grid record when each has its checksums
    if (!tensor.grid || apart == nullptr) return std::nullopt;
    std::vector<uint64_t> lengths;
    ChunkByteLengths(tensor, &lengths);
    for (size_t c = 0; c < lengths.size(); ++c) {
      if (apart->of(c).size() != ChecksumBlockCount(lengths[c], checksum_block_bytes)) {
        return std::nullopt;
      }
    }
    return tensor.grid;
  }
  for (size_t c = 0; c < tensor.chunks.size(); ++c) {
    const StoredChunk& chunk = tensor.chunks[c];
    if (chunk.encoding != ChunkEncoding::kRaw ||
        BlockCrcs(tensor, apart, c).size() !=
            ChecksumBlockCount(chunk.byte_length, checksum_block_bytes)) {
      return std::nullopt;
    }
  }
  return FindChunkGrid(tensor.chunks, tensor.shape);
}

// Every chunk with its file, data offset, box and block checksums: at fixed width before version
// 3, packed from version 3 (DecodeChunk), without the checksums from version 4.
void EncodeChunkList(const TensorMetadata& tensor, const ChunkChecksums::Tensor* apart,
                     uint32_t major, ByteWriter& w) {
  const bool packed = major >= 3;
  const bool with_crcs = RecordsHoldChecksums(major);
  if (packed) {
    w.PutVarint(tensor.chunks.size());
  } else {
    w.PutU32(static_cast<uint32_t>(tensor.chunks.size()));
  }
  uint32_t file = 0;
  uint64_t data_offset = 0;
  for (size_t c = 0; c < tensor.chunks.size(); ++c) {
    const StoredChunk& chunk = tensor.chunks[c];
    const std::span<const uint32_t> crcs =
        with_crcs ? BlockCrcs(tensor, apart, c) : std::span<const uint32_t>();
    if (packed) {
      w.PutSignedVarint(static_cast<int64_t>(chunk.file) - file);
      w.PutSignedVarint(static_cast<int64_t>(chunk.data_offset - data_offset));
      file = chunk.file;
      data_offset = chunk.data_offset;
      for (int64_t v : chunk.box.offsets) w.PutVarint(static_cast<uint64_t>(v));
      for (int64_t v : chunk.box.sizes) w.PutVarint(static_cast<uint64_t>(v));
      if (with_crcs) w.PutVarint(crcs.size());
    } else {
      w.PutU32(chunk.file);
      w.PutU64(chunk.data_offset);
      w.PutU64(chunk.byte_length);
      for (int64_t v : chunk.box.offsets) w.PutI64(v);
      for (int64_t v : chunk.box.sizes) w.PutI64(v);
      w.PutU32(static_cast<uint32_t>(crcs.size()));
    }
    for (uint32_t crc : crcs) w.PutU32(crc);
  }
}

// The step from one cell's file and data offset to the next's (from file 0 and offset 0 to the
// first cell's): what a run of cells repeats.
struct CellStep {
  int64_t file = 0;
  int64_t data_offset = 0;  // the difference of two u64, wrapped
  friend bool operator==(const CellStep&, const CellStep&) = default;
};

// The step to cell `c` of `tensor` (its chunks, or its cells) from the cell before it.
CellStep StepTo(const TensorMetadata& tensor, size_t c) {
  const uint32_t file = c == 0 ? 0 : ChunkFile(tensor, c - 1);
  const uint64_t data_offset = c == 0 ? 0 : ChunkDataOffset(tensor, c - 1);
  return {static_cast<int64_t>(ChunkFile(tensor, c)) - file,
          static_cast<int64_t>(ChunkDataOffset(tensor, c) - data_offset)};
}

// The cells' files and offsets as runs of cells that repeat one step: a varint count of runs,
// then each run's length (varint) and step (two signed varints). Each run is as long as it can
// be, so the runs of given cells are one sequence. A tensor sharded over ranks, one cell per rank
// at the same offset of each rank's file, is two runs (the first cell, then a step of one file).
void EncodeCellRuns(const TensorMetadata& tensor, ByteWriter& w) {
  const size_t cells = ChunkCount(tensor);
  for (int pass = 0; pass < 2; ++pass) {  // the runs counted, then written
    uint64_t runs = 0;
    for (size_t c = 0; c < cells;) {
      const CellStep step = StepTo(tensor, c);
      size_t end = c + 1;
      while (end < cells && StepTo(tensor, end) == step) ++end;
      if (pass == 1) {
        w.PutVarint(end - c);
        w.PutSignedVarint(step.file);
        w.PutSignedVarint(step.data_offset);
      }
      ++runs;
      c = end;
    }
    if (pass == 0) w.PutVarint(runs);
  }
}

// Per dimension the interval count and its cut points (an even step, or the interior points);
// then file and offset of every cell, row-major (at fixed width before version 3; from version 3
// as runs of cells, EncodeCellRuns); then, before version 4, every cell's block checksums, in the
// same order.
void EncodeGrid(const TensorMetadata& tensor, const ChunkChecksums::Tensor* apart,
                const ChunkGrid& grid, uint32_t major, ByteWriter& w) {
  for (const std::vector<int64_t>& bounds : grid.bounds) {
    w.PutU32(static_cast<uint32_t>(bounds.size() - 1));
    if (const int64_t step = GridEvenStep(bounds)) {
      w.PutU8(kEvenCuts);
      w.PutI64(step);
    } else {
      w.PutU8(kListedCuts);
      for (size_t k = 1; k + 1 < bounds.size(); ++k) w.PutI64(bounds[k]);
    }
  }
  const size_t cells = ChunkCount(tensor);
  if (major >= 3) {
    EncodeCellRuns(tensor, w);
  } else {
    for (size_t c = 0; c < cells; ++c) {
      w.PutU32(ChunkFile(tensor, c));
      w.PutU64(ChunkDataOffset(tensor, c));
    }
  }
  if (!RecordsHoldChecksums(major)) return;
  for (size_t c = 0; c < cells; ++c) {
    for (uint32_t crc : BlockCrcs(tensor, apart, c)) w.PutU32(crc);
  }
}

// The cut points of a grid record (after the layout byte): per dimension an interval count n in
// [1, shape[d]], then either an even step s (cut k at k * s, with (n - 1) * s < shape[d] <= n * s)
// or n - 1 interior cut points, strictly increasing inside (0, shape[d]). The cell count is at
// most kMaxChunks, and each cell must be able to fit in `cell_bytes` of what remains (unless 0).
Result<ChunkGrid> DecodeGridBounds(ByteReader& r, const Shape& shape, const std::string& where,
                                   std::string_view path, uint64_t cell_bytes) {
  const size_t rank = shape.size();
  ChunkGrid grid;
  grid.bounds.resize(rank);
  grid.strides.resize(rank);
  uint64_t cells = 1;  // of the dimensions so far
  for (size_t d = 0; d < rank; ++d) {
    const std::string dimension = where + ": dimension " + std::to_string(d);
    SP_ASSIGN_OR_RETURN(uint32_t intervals, r.ReadU32());
    if (intervals == 0 || static_cast<int64_t>(intervals) > shape[d] || intervals > kMaxChunks) {
      return Corrupt(path, dimension + " of size " + std::to_string(shape[d]) + " cut into " +
                               std::to_string(intervals) + " intervals");
    }
    // Every cell takes `cell_bytes` of the record: its count bounds what the cut points may
    // allocate.
    cells *= intervals;  // both at most 2^24
    if (cells > kMaxChunks) return Corrupt(path, where + ": too many chunks");
    if (cell_bytes > 0 && cells > r.remaining() / cell_bytes) {
      return Corrupt(path, where + ": " + std::to_string(cells) +
                               " grid cells cannot fit in the " + std::to_string(r.remaining()) +
                               " remaining bytes");
    }
    SP_ASSIGN_OR_RETURN(uint8_t kind, r.ReadU8());
    std::vector<int64_t>& bounds = grid.bounds[d];
    if (kind == kEvenCuts) {
      SP_ASSIGN_OR_RETURN(int64_t step, r.ReadI64());
      // (n - 1) * step < shape <= n * step, without overflow: step <= shape here.
      if (step <= 0 || step > shape[d] || (intervals - 1) > (shape[d] - 1) / step ||
          shape[d] > static_cast<int64_t>(intervals) * step) {
        return Corrupt(path, dimension + " of size " + std::to_string(shape[d]) + " cut into " +
                                 std::to_string(intervals) + " intervals of " +
                                 std::to_string(step));
      }
      bounds.resize(intervals + 1);
      for (uint32_t k = 0; k < intervals; ++k) bounds[k] = static_cast<int64_t>(k) * step;
      bounds[intervals] = shape[d];
      continue;
    }
    if (kind != kListedCuts) {
      return Corrupt(path, dimension + ": unknown cut kind " + std::to_string(kind));
    }
    if (intervals - 1 > r.remaining() / 8) {
      return Corrupt(path, dimension + ": " + std::to_string(intervals - 1) +
                               " cut points cannot fit in the " + std::to_string(r.remaining()) +
                               " remaining bytes");
    }
    bounds.reserve(intervals + 1);
    bounds.push_back(0);
    for (uint32_t k = 1; k < intervals; ++k) {
      SP_ASSIGN_OR_RETURN(int64_t cut, r.ReadI64());
      if (cut <= bounds.back() || cut >= shape[d]) {
        return Corrupt(path, dimension + " cut point " + std::to_string(k) + " at " +
                                 std::to_string(cut) + " is not between " +
                                 std::to_string(bounds.back()) + " and " +
                                 std::to_string(shape[d]) + " (exclusive)");
      }
      bounds.push_back(cut);
    }
    bounds.push_back(shape[d]);
  }
  uint64_t stride = 1;
  for (size_t d = rank; d-- > 0;) {
    grid.strides[d] = stride;
    stride *= grid.bounds[d].size() - 1;  // the product is `cells`, checked above
  }
  return grid;
}

// A cell's file and bytes as CheckChunkBytes checks them (its byte length is its box's), without
// a message: millions of cells pass, and the message is built only for one that fails.
bool CellBytesHold(uint32_t file, uint64_t data_offset, uint64_t byte_length,
                   const CheckpointMetadata& summary) {
  return file < summary.files.size() && InDataBytes(summary.files[file], data_offset, byte_length);
}

// Every cell of a version-4 grid whose placement `runs` gives (their files checked to be u32s),
// kept packed: each cell's file and bytes are checked as CheckChunkBytes checks them, its byte
// length from an odometer over the grid's intervals (no box is built but for a message), and its
// file and offset by its run's steps. The cells hold no checksums.
Status KeepGridCells(const ChunkGrid& grid, uint64_t item, std::vector<CellRun> runs,
                     const CheckpointMetadata& summary, const std::string& where,
                     std::string_view path, TensorMetadata* tensor) {
  const size_t rank = grid.bounds.size();
  // Per dimension, the interval of the current cell, and the byte length of every prefix of the
  // dimensions' intervals (the last: the cell's); a step recomputes them from the dimension that
  // moved.
  std::vector<size_t> at(rank, 0);
  std::vector<uint64_t> prefix(rank + 1, item);
  const auto interval = [&](size_t d) {
    return static_cast<uint64_t>(grid.bounds[d][at[d] + 1] - grid.bounds[d][at[d]]);
  };
  for (size_t d = 0; d < rank; ++d) prefix[d + 1] = prefix[d] * interval(d);
  uint64_t c = 0;
  for (const CellRun& run : runs) {
    uint32_t file = run.file;
    uint64_t data_offset = run.data_offset;
    for (uint64_t n = 0; n < run.count; ++n, ++c) {
      const uint64_t byte_length = prefix[rank];  // within the shape's 2^62 bytes
      if (!CellBytesHold(file, data_offset, byte_length, summary)) {
        return CheckChunkBytes(StoredChunk(GridCellBox(grid, c), file, data_offset, byte_length),
                               byte_length, summary, ChunkWhere{where, c}, path);
      }
      file = static_cast<uint32_t>(file + run.file_step);
      data_offset += run.offset_step;
      size_t d = rank;
      while (d-- > 0) {
        if (++at[d] + 1 < grid.bounds[d].size()) break;
        at[d] = 0;
      }
      if (d == static_cast<size_t>(-1)) continue;  // past the last cell
      for (size_t e = d; e < rank; ++e) prefix[e + 1] = prefix[e] * interval(e);
    }
  }
  auto packed = std::make_shared<PackedChunks>();
  packed->grid = grid;
  packed->element_bytes = item;
  packed->cell_count = c;
  packed->runs = std::move(runs);
  packed->checksums.chunks = c;
  tensor->chunks = ChunkList(std::move(packed));
  return OkStatus();
}

// Every cell is checked (its file and bytes, then its checksum count against the bytes left), in
// the order and with the messages of a decoding that keeps them all, so that every copy of the
// metadata decoded from the same bytes fails alike, whatever it keeps. With `keep`, only the
// cells that share a point with one of its boxes become chunks (TensorMetadata::kept).
Status DecodeGridCells(ByteReader& r, const CheckpointMetadata& summary, const std::string& where,
                       std::string_view path, const std::vector<Box>* keep,
                       TensorMetadata* tensor) {
  const ChunkGrid& grid = *tensor->grid;
  const uint64_t cells = grid.cell_count();
  const bool packed = summary.version_major >= 3;
  const bool with_crcs = RecordsHoldChecksums(summary.version_major);
  const uint64_t cell_bytes = GridCellBytes(summary.version_major);
  if (cell_bytes > 0 && cells > r.remaining() / cell_bytes) {
    return Corrupt(path, where + ": " + std::to_string(cells) + " grid cells cannot fit in the " +
                             std::to_string(r.remaining()) + " remaining bytes");
  }
  // The (file, data_offset) table: before version 3 of fixed width, and it fits (checked above),
  // so it is read in place; from version 3 runs of cells (EncodeCellRuns), decoded first (their
  // end is where the checksums begin), each run checked to name only u32 files.
  std::string_view table;
  std::vector<CellRun> runs;
  if (packed) {
    // Runs of cells (EncodeCellRuns): each at least 3 bytes and a cell long.
    SP_ASSIGN_OR_RETURN(uint32_t run_count, r.ReadVarintCount(3));
    if (run_count == 0 || run_count > cells) {
      return Corrupt(path, where + ": " + std::to_string(run_count) + " runs of cells for " +
                               std::to_string(cells) + " grid cells");
    }
    runs.reserve(run_count);
    int64_t file = 0;
    uint64_t data_offset = 0;
    uint64_t c = 0;
    for (uint32_t run = 0; run < run_count; ++run) {
      SP_ASSIGN_OR_RETURN(uint64_t length, r.ReadVarint());
      SP_ASSIGN_OR_RETURN(int64_t file_step, r.ReadSignedVarint());
      SP_ASSIGN_OR_RETURN(int64_t offset_step, r.ReadSignedVarint());
      if (length == 0 || length > cells - c || (run + 1 == run_count && length != cells - c)) {
        return Corrupt(path, where + ": run " + std::to_string(run) + " of " +
                                 std::to_string(length) + " cells from cell " +
                                 std::to_string(c) + " does not end " +
                                 (run + 1 == run_count ? "at" : "within") + " the " +
                                 std::to_string(cells) + " grid cells");
      }
      // The files step evenly: when the run's first and last are u32 files, so is every one
      // between; otherwise the cell that leaves the range is found one by one.
      int64_t first = 0, span = 0, last = 0;
      const bool fits =
          !__builtin_add_overflow(file, file_step, &first) && first >= 0 && first <= UINT32_MAX &&
          !__builtin_mul_overflow(static_cast<int64_t>(length - 1), file_step, &span) &&
          !__builtin_add_overflow(first, span, &last) && last >= 0 && last <= UINT32_MAX;
      if (!fits) {
        int64_t at = file;
        for (uint64_t k = 0; k < length; ++k) {
          SP_ASSIGN_OR_RETURN(at, PackedFile(at, file_step, summary, ChunkWhere{where, c + k},
                                             path));
        }
        return InternalError(where + ": a run of files out of range passed every cell's check");
      }
      // Held as AppendCellRun would hold the cells: a run of one cell takes the step after it.
      CellRun* last_run = runs.empty() ? nullptr : &runs.back();
      if (last_run != nullptr &&
          (last_run->count == 1 || (last_run->file_step == file_step &&
                                    last_run->offset_step == static_cast<uint64_t>(offset_step)))) {
        last_run->count += length;
        last_run->file_step = file_step;
        last_run->offset_step = static_cast<uint64_t>(offset_step);
      } else {
        const bool one = length == 1;  // a run of one cell has no step
        runs.push_back(CellRun{c, length, static_cast<uint32_t>(first), one ? 0 : file_step,
                               data_offset + static_cast<uint64_t>(offset_step),
                               one ? 0 : static_cast<uint64_t>(offset_step)});
      }
      file = last;
      data_offset += length * static_cast<uint64_t>(offset_step);  // wraps; checked per cell
      c += length;
    }
  } else {
    SP_ASSIGN_OR_RETURN(table, r.ReadRaw(cells * 12));
  }
  const uint64_t item = DTypeSize(tensor->dtype);
  if (packed && !with_crcs && keep == nullptr) return KeepGridCells(grid, item, std::move(runs),
                                                                      summary, where, path, tensor);
  std::vector<uint32_t> kept;
  if (keep != nullptr) {
    kept = ChunksReached(*tensor, *keep);  // through the grid: no chunk is built yet
    if (kept.size() == cells) keep = nullptr;  // every cell: the whole grid, as without a filter
  }
  // The whole grid is kept packed (ChunkList): each cell's file, offset and checksums, no
  // StoredChunk until a consumer asks for one.
  std::shared_ptr<PackedChunks> kept_packed;
  if (keep == nullptr) {
    kept_packed = std::make_shared<PackedChunks>();
    kept_packed->grid = grid;
    kept_packed->element_bytes = item;
  }
  GridCellWalk walk(grid);  // the cells' boxes, in chunk order
  const Box& box = walk.box();
  tensor->chunks.clear();
  if (!kept_packed) tensor->chunks.reserve(kept.size());
  // With `keep`, where each kept chunk's checksums begin among the cells' (counted in checksums);
  // and the first cell whose checksums do not fit in the bytes left (reported only when every
  // cell's bytes hold, as a decoding that checks the bytes of all cells first reports it).
  std::vector<uint64_t> crc_at;
  if (keep != nullptr) crc_at.reserve(kept.size());
  // Packed, each cell's checksum count: the same for all (per_chunk), or where each starts
  // (starts, from the first cell whose count differs).
  uint64_t per_chunk = 0;
  std::vector<uint64_t> starts;
  const uint64_t crc_bytes = r.remaining();
  uint64_t crc_count = 0;
  std::optional<Status> crcs_overflow;
  size_t next_kept = 0;
  size_t run = 0;  // packed: the run of cell c, and its file and data offset
  uint32_t run_file = 0;
  uint64_t run_offset = 0;
  std::vector<CellRun> placed;  // fixed width, kept packed: the cells' runs
  for (uint64_t c = 0; c < cells; ++c) {
    uint32_t file = 0;
    uint64_t data_offset = 0;
    if (packed) {
      if (c == runs[run].first + runs[run].count) ++run;
      if (c == runs[run].first) {
        run_file = runs[run].file;
        run_offset = runs[run].data_offset;
      } else {
        run_file = static_cast<uint32_t>(run_file + runs[run].file_step);
        run_offset += runs[run].offset_step;
      }
      file = run_file;
      data_offset = run_offset;
    } else {
      file = DecodeFixed32(table.data() + c * 12);
      data_offset = DecodeFixed64(table.data() + c * 12 + 4);
      if (kept_packed) AppendCellRun(&placed, c, file, data_offset);
    }
    const uint64_t byte_length = static_cast<uint64_t>(box.volume()) * item;  // within the shape
    const bool kept_here = keep != nullptr && next_kept < kept.size() && kept[next_kept] == c;
    if (!CellBytesHold(file, data_offset, byte_length, summary)) {
      SP_RETURN_IF_ERROR(CheckChunkBytes(StoredChunk(box, file, data_offset, byte_length),
                                         byte_length, summary, ChunkWhere{where, c}, path));
    }
    // A cell within one block (most are) has one checksum: no division.
    const uint64_t blocks = !with_crcs                                   ? 0
                            : byte_length <= summary.checksum_block_bytes ? 1
                                : ChecksumBlockCount(byte_length, summary.checksum_block_bytes);
    if (!crcs_overflow && blocks > (crc_bytes - crc_count * 4) / 4) {
      crcs_overflow = Corrupt(path, where + " chunk " + std::to_string(c) + ": " +
                                        std::to_string(blocks) +
                                        " block checksums cannot fit in the " +
                                        std::to_string(crc_bytes - crc_count * 4) +
                                        " remaining bytes");
    }
    if (kept_packed) {
      if (c == 0) per_chunk = blocks;
      if (starts.empty() && blocks != per_chunk) {
        starts.reserve(cells + 1);
        for (uint64_t before = 0; before < c; ++before) starts.push_back(before * per_chunk);
      }
      if (!starts.empty()) starts.push_back(crc_count);
    } else if (kept_here) {
      tensor->chunks.emplace_back(box, file, data_offset, byte_length);
      crc_at.push_back(crc_count);
      ++next_kept;
    }
    if (!crcs_overflow) crc_count += blocks;
    walk.Next();
  }
  if (crcs_overflow) return *crcs_overflow;
  SP_ASSIGN_OR_RETURN(std::string_view crcs, r.ReadRaw(crc_count * 4));
  if (kept_packed) {
    kept_packed->cell_count = cells;
    kept_packed->runs = packed ? std::move(runs) : std::move(placed);
    ChunkChecksums::Tensor& sums = kept_packed->checksums;
    if (!starts.empty()) {
      starts.push_back(crc_count);
      sums.starts = std::move(starts);
    } else {
      sums.chunks = cells;
      sums.per_chunk = per_chunk;
    }
    sums.crcs.resize(crc_count);
    for (uint64_t i = 0; i < crc_count; ++i) sums.crcs[i] = DecodeFixed32(crcs.data() + i * 4);
    tensor->chunks = ChunkList(std::move(kept_packed));
    return OkStatus();
  }
  for (size_t i = 0; with_crcs && i < tensor->chunks.size(); ++i) {
    StoredChunk& chunk = tensor->chunks[i];
    const uint64_t blocks = ChecksumBlockCount(chunk.byte_length, summary.checksum_block_bytes);
    const uint64_t first = crc_at[i];
    chunk.block_crc32c.resize(blocks);
    for (uint64_t b = 0; b < blocks; ++b) {
      chunk.block_crc32c[b] = DecodeFixed32(crcs.data() + (first + b) * 4);
    }
  }
  tensor->grid.reset();
  tensor->kept = std::move(kept);
  return OkStatus();
}

// Appends `chunk` (number c) to the chunks a decoder keeps packed as a list (PackedChunks), with
// its checksums: the same count for every chunk (per_chunk) or, from the first chunk whose count
// differs, where each chunk's begin (`starts`).
void AppendListed(const StoredChunk& chunk, uint64_t c, PackedChunks* packed) {
  packed->files.push_back(chunk.file);
  packed->data_offsets.push_back(chunk.data_offset);
  for (int64_t offset : chunk.box.offsets) packed->boxes.push_back(offset);
  for (int64_t size : chunk.box.sizes) packed->boxes.push_back(size);
  ChunkChecksums::Tensor& sums = packed->checksums;
  const uint64_t blocks = chunk.block_crc32c.size();
  if (c == 0) sums.per_chunk = blocks;
  if (sums.starts.empty() && blocks != sums.per_chunk) {
    for (uint64_t before = 0; before < c; ++before) sums.starts.push_back(before * sums.per_chunk);
  }
  if (!sums.starts.empty()) sums.starts.push_back(sums.crcs.size());
  sums.crcs.insert(sums.crcs.end(), chunk.block_crc32c.begin(), chunk.block_crc32c.end());
}

// The varint at `*at` of `bytes` (moving past it), or false when it is cut off or does not fit
// in 64 bits.
bool TakeVarint(std::string_view bytes, size_t* at, uint64_t* out) {
  uint64_t value = 0;
  for (int shift = 0; shift < 70 && *at < bytes.size(); shift += 7) {
    const uint8_t b = static_cast<uint8_t>(bytes[(*at)++]);
    if (shift == 63 && b > 1) return false;
    value |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (b < 0x80) {
      *out = value;
      return true;
    }
  }
  return false;
}

// The `count` chunks of a version-4 chunk list at the start of `bytes`, checked as DecodeChunk and
// DecodeChunkList check them, into `listed` (empty, their room reserved), and the bytes they
// take into `taken`; false when any check fails (the caller decodes them again by DecodeChunk,
// which says why). Without a Result per value read, a chunk costs a fraction of DecodeChunk's.
bool TakeListedChunks(std::string_view bytes, uint32_t count, const TensorMetadata& tensor,
                      const CheckpointMetadata& summary, PackedChunks* listed, size_t* taken) {
  const size_t rank = tensor.shape.size();
  const uint64_t shape_volume = static_cast<uint64_t>(ShapeVolume(tensor.shape));
  size_t at = 0;
  int64_t file = 0;
  uint64_t data_offset = 0, covered = 0;
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t file_step = 0, offset_step = 0;
    if (!TakeVarint(bytes, &at, &file_step) || !TakeVarint(bytes, &at, &offset_step) ||
        __builtin_add_overflow(file, UnZigZag(file_step), &file) || file < 0 ||
        static_cast<uint64_t>(file) >= summary.files.size()) {
      return false;
    }
    data_offset += static_cast<uint64_t>(UnZigZag(offset_step));  // wraps, as DecodeChunk's
    const size_t first = listed->boxes.size();
    for (size_t v = 0; v < 2 * rank; ++v) {
      uint64_t value = 0;
      if (!TakeVarint(bytes, &at, &value)) return false;
      listed->boxes.push_back(static_cast<int64_t>(value));
    }
    const int64_t* offsets = listed->boxes.data() + first;
    const int64_t* sizes = offsets + rank;
    uint64_t volume = 1;
    for (size_t d = 0; d < rank; ++d) {
      if (sizes[d] < 0 || sizes[d] > tensor.shape[d] || offsets[d] < 0 ||
          offsets[d] > tensor.shape[d] - sizes[d]) {
        return false;
      }
      volume *= static_cast<uint64_t>(sizes[d]);
    }
    const uint64_t byte_length = volume * listed->element_bytes;
    if (!CellBytesHold(static_cast<uint32_t>(file), data_offset, byte_length, summary)) {
      return false;
    }
    covered += volume;  // both terms <= 2^62: no overflow
    if (covered > shape_volume) return false;
    listed->files.push_back(static_cast<uint32_t>(file));
    listed->data_offsets.push_back(data_offset);
  }
  *taken = at;
  return covered == shape_volume;
}

// Every chunk is decoded and checked; with `keep`, only those that share a point with one of its
// boxes are kept (TensorMetadata::kept). Without, a record of version 2 or later (whose encoder
// lists only chunks that are no grid) is kept packed (PackedChunks::listed): a StoredChunk each
// is made only for a consumer that walks them.
Status DecodeChunkList(ByteReader& r, const CheckpointMetadata& summary, const std::string& where,
                       std::string_view path, const std::vector<Box>* keep,
                       TensorMetadata* tensor) {
  const size_t rank = tensor->shape.size();
  const bool packed = summary.version_major >= 3;
  uint32_t chunk_count = 0;
  if (packed) {  // at least a byte for the file, the offset, each box value and the block count
    const bool with_crcs = RecordsHoldChecksums(summary.version_major);
    SP_ASSIGN_OR_RETURN(chunk_count, r.ReadVarintCount((with_crcs ? 3 : 2) + 2 * rank));
  } else {
    SP_ASSIGN_OR_RETURN(chunk_count, r.ReadCount(4 + 8 + 8 + 16 * rank + 4));
  }
  if (chunk_count > kMaxChunks) return Corrupt(path, where + ": too many chunks");
  std::vector<uint32_t> kept;
  StoredChunk scratch;
  StoredChunk previous;  // a packed record's file and offset are given past the chunk before's
  std::shared_ptr<PackedChunks> listed;
  if (keep == nullptr && summary.version_major >= 2) {
    listed = std::make_shared<PackedChunks>();
    listed->listed = true;
    listed->rank = rank;
    listed->element_bytes = DTypeSize(tensor->dtype);
    // The count is bounded by the record's bytes (at least 2 + 2 * rank a chunk).
    listed->boxes.reserve(uint64_t{chunk_count} * 2 * rank);
    listed->files.reserve(chunk_count);
    listed->data_offsets.reserve(chunk_count);
  } else if (keep == nullptr) {
    tensor->chunks.reserve(chunk_count);
  }
  if (listed && !RecordsHoldChecksums(summary.version_major)) {
    ByteReader rest = r;
    SP_ASSIGN_OR_RETURN(std::string_view bytes, rest.ReadRaw(rest.remaining()));
    if (size_t taken = 0;
        TakeListedChunks(bytes, chunk_count, *tensor, summary, listed.get(), &taken)) {
      SP_RETURN_IF_ERROR(r.ReadRaw(taken).status());
      listed->cell_count = chunk_count;
      listed->checksums.chunks = chunk_count;
      tensor->chunks = ChunkList(std::move(listed));
      return OkStatus();
    }
    listed->boxes.clear();  // a check failed: decoded again below, to say which
    listed->files.clear();
    listed->data_offsets.clear();
  }
  const uint64_t shape_volume = static_cast<uint64_t>(ShapeVolume(tensor->shape));
  uint64_t covered = 0;
  for (uint32_t i = 0; i < chunk_count && covered <= shape_volume; ++i) {
    uint64_t volume = 0;
    StoredChunk* chunk =
        keep == nullptr && !listed ? &tensor->chunks.emplace_back() : &scratch;
    SP_RETURN_IF_ERROR(
        DecodeChunk(r, *tensor, summary, ChunkWhere{where, i}, path, packed, &previous, chunk,
                    &volume));
    covered += volume;  // both terms <= 2^62 here: no overflow
    if (listed) {
      AppendListed(scratch, i, listed.get());
    } else if (keep != nullptr && FilterKeeps(*keep, tensor->shape, scratch.box)) {
      tensor->chunks.push_back(scratch);
      kept.push_back(i);
    }
  }
  if (covered != shape_volume) {
    return Corrupt(path, where + ": chunks hold " + std::to_string(covered) +
                             " elements, the shape " + ShapeToString(tensor->shape) + " has " +
                             std::to_string(ShapeVolume(tensor->shape)));
  }
  if (listed) {
    listed->cell_count = chunk_count;
    ChunkChecksums::Tensor& sums = listed->checksums;
    if (sums.starts.empty()) {
      sums.chunks = chunk_count;
    } else {
      sums.starts.push_back(sums.crcs.size());
    }
    tensor->chunks = ChunkList(std::move(listed));
  }
  if (keep != nullptr && kept.size() != chunk_count) tensor->kept = std::move(kept);
  return OkStatus();
}

}  // namespace

void AppendTensorRecord(const TensorMetadata& tensor, uint64_t checksum_block_bytes,
                        uint32_t major, std::string* out, const ChunkChecksums::Tensor* apart) {
  std::optional<ChunkGrid> grid;
  if (major >= 2) grid = StoredGrid(tensor, apart, checksum_block_bytes, major);
  if (tensor.cells && !grid) {
    TensorMetadata listed = tensor;  // a chunk list: the cells as chunks
    ExpandChunkCells(&listed);
    AppendTensorRecord(listed, checksum_block_bytes, major, out, apart);
    return;
  }
  ByteWriter w(out);
  w.PutU8(DTypeCode(tensor.dtype));
  w.PutU8(static_cast<uint8_t>(tensor.shape.size()));
  for (int64_t dim : tensor.shape) w.PutI64(dim);
  if (major < 2) {
    EncodeChunkList(tensor, apart, major, w);
  } else if (grid) {
    w.PutU8(kGrid);
    EncodeGrid(tensor, apart, *grid, major, w);
  } else {
    w.PutU8(kChunkList);
    EncodeChunkList(tensor, apart, major, w);
  }
}

std::string EncodeTensorRecord(const TensorMetadata& tensor, uint64_t checksum_block_bytes,
                               uint32_t major) {
  std::string out;
  AppendTensorRecord(tensor, checksum_block_bytes, major, &out);
  return out;
}

uint64_t TensorRecordBound(const TensorMetadata& tensor, const ChunkChecksums::Tensor* apart) {
  // dtype, rank, shape, layout byte and chunk count (a varint: 10 bytes at most); then each chunk
  // as a chunk list stores it, at fixed width (28 + 16 * rank bytes) or packed (at most 5 for the
  // file, 10 for the offset and the block count, 10 for each box value). A grid costs less per
  // cell (at most 12 bytes at fixed width, or a run of its own: 25 bytes, and its checksums; and
  // 10 for the count of runs) and at most 13 bytes per dimension and 8 per interval (at most a
  // chunk's offsets) more.
  const uint64_t rank = tensor.shape.size();
  uint64_t bytes = 22 + 21 * rank;
  for (size_t c = 0; c < ChunkCount(tensor); ++c) {
    bytes += 28 + 20 * rank + 4 * static_cast<uint64_t>(BlockCrcs(tensor, apart, c).size());
  }
  return bytes;
}

Result<TensorMetadata> DecodeTensorRecord(std::string_view bytes, std::string name,
                                          const CheckpointMetadata& summary, bool newer_minor,
                                          std::string_view path, const std::vector<Box>* keep,
                                          bool index_lists) {
  const std::string where = "tensor \"" + name + "\"";
  ByteReader r(bytes, "metadata file " + std::string(path) + ", " + where);
  TensorMetadata tensor;
  tensor.name = std::move(name);
  SP_ASSIGN_OR_RETURN(uint8_t code, r.ReadU8());
  Result<DType> dtype = DTypeFromCode(code);
  if (!dtype.ok()) return Corrupt(path, where + ": unknown dtype code " + std::to_string(code));
  tensor.dtype = *dtype;
  SP_ASSIGN_OR_RETURN(uint8_t rank, r.ReadU8());
  if (rank > kMaxRank) return Corrupt(path, where + ": rank " + std::to_string(rank) + " > 64");
  SP_RETURN_IF_ERROR(DecodeShape(r, tensor.dtype, rank, where, path, &tensor.shape).status());
  uint8_t layout = kChunkList;
  if (summary.version_major >= 2) {
    SP_ASSIGN_OR_RETURN(layout, r.ReadU8());
  }
  if (layout == kChunkList) {
    SP_RETURN_IF_ERROR(DecodeChunkList(r, summary, where, path, keep, &tensor));
    // From version 2 the encoder lists a tensor's chunks only when they are no grid
    // (FindChunkGrid): the list is indexed here, on the decoder's thread, and not searched for
    // a grid again (IndexChunkGrids).
    if (keep == nullptr && index_lists && summary.version_major >= 2) {
      tensor.index = BuildChunkIndex(tensor.chunks, tensor.shape);
    }
  } else if (layout == kGrid) {
    SP_ASSIGN_OR_RETURN(tensor.grid, DecodeGridBounds(r, tensor.shape, where, path,
                                                      GridCellBytes(summary.version_major)));
    SP_RETURN_IF_ERROR(DecodeGridCells(r, summary, where, path, keep, &tensor));
  } else {
    return Corrupt(path, where + ": unknown layout " + std::to_string(layout));
  }
  if (!r.done() && !newer_minor) {
    return Corrupt(path, where + ": " + std::to_string(r.remaining()) + " unexpected bytes");
  }
  return tensor;
}

uint64_t GridRecordCells(std::string_view bytes, uint32_t major) {
  if (major < 2) return 0;
  ByteReader r(bytes, "");
  const auto cells = [&]() -> Result<uint64_t> {
    SP_RETURN_IF_ERROR(r.ReadU8().status());  // dtype
    SP_ASSIGN_OR_RETURN(uint8_t rank, r.ReadU8());
    for (uint8_t d = 0; d < rank; ++d) SP_RETURN_IF_ERROR(r.ReadI64().status());
    SP_ASSIGN_OR_RETURN(uint8_t layout, r.ReadU8());
    if (layout != kGrid) return uint64_t{0};
    constexpr uint64_t kMost = uint64_t{1} << 62;
    uint64_t count = 1;
    for (uint8_t d = 0; d < rank; ++d) {
      SP_ASSIGN_OR_RETURN(uint32_t intervals, r.ReadU32());
      SP_ASSIGN_OR_RETURN(uint8_t kind, r.ReadU8());
      const uint64_t skip = kind == kEvenCuts ? 8 : 8 * (uint64_t{intervals} - 1);
      if (intervals == 0 || skip > r.remaining()) return uint64_t{0};
      SP_RETURN_IF_ERROR(r.ReadRaw(skip).status());
      count = count > kMost / intervals ? kMost : count * intervals;
    }
    return count;
  }();
  return cells.ok() ? *cells : 0;
}

std::string EncodeObjectRecord(const ObjectEntry& object) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(static_cast<uint8_t>(object.encoding));
  w.PutU64(object.payload.size());
  w.PutRaw(object.payload);
  return out;
}

Result<ObjectEntry> DecodeObjectRecord(std::string_view bytes, std::string name, bool newer_minor,
                                       std::string_view path) {
  const std::string where = "object \"" + name + "\"";
  ByteReader r(bytes, "metadata file " + std::string(path) + ", " + where);
  ObjectEntry object;
  object.name = std::move(name);
  SP_ASSIGN_OR_RETURN(uint8_t encoding, r.ReadU8());
  if (!IsKnownObjectEncoding(encoding)) {
    return Corrupt(path, where + ": unknown encoding " + std::to_string(encoding));
  }
  object.encoding = static_cast<ObjectEncoding>(encoding);
  SP_ASSIGN_OR_RETURN(uint64_t length, r.ReadU64());
  if (length > kMaxObjectBytes || length > r.remaining()) {
    return Corrupt(path, where + ": payload length " + std::to_string(length) + " exceeds " +
                             std::to_string(std::min<uint64_t>(kMaxObjectBytes, r.remaining())));
  }
  SP_ASSIGN_OR_RETURN(std::string_view payload, r.ReadRaw(length));
  object.payload = std::string(payload);
  if (!r.done() && !newer_minor) {
    return Corrupt(path, where + ": " + std::to_string(r.remaining()) + " unexpected bytes");
  }
  return object;
}

}  // namespace sp::native_metadata
