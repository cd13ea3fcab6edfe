// CheckpointMetadata: the in-memory model of one committed checkpoint.
//
// This is what a format driver decodes from disk and what the save planner produces. It says,
// for every tensor, its dtype, global shape and the stored chunks that tile it, and for every
// chunk the data file, the byte range and the checksums. Plain value types; no I/O here.
// docs/FORMAT.md specifies how the native driver encodes it.
#ifndef SHARDPOINT_FORMAT_METADATA_H_
#define SHARDPOINT_FORMAT_METADATA_H_

#include <atomic>
#include <compare>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/inline_vector.h"
#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// Default checksum block: one CRC32C per this many bytes of a chunk (the last block is shorter).
// Block checksums let a resharding load verify exactly the part of a chunk it reads.
inline constexpr uint64_t kDefaultChecksumBlockBytes = uint64_t{1} << 20;

// Where the native format places chunk bytes (docs/FORMAT.md §2): each data section starts at a
// multiple of this many bytes of its file, and a data file holds the chunks whose byte length is
// a multiple of it first, so that those start at multiples of it too. Direct I/O needs file
// offsets (and buffer addresses) aligned to the device's block, 512 or 4096 bytes: a chunk that
// starts on a page can be read straight into a page-aligned destination, without staging.
inline constexpr uint64_t kDataAlignmentBytes = 4096;

struct DataFile {
  std::string name;         // relative to the checkpoint directory
  uint64_t data_start = 0;  // byte offset of the data section (safetensors: 8 + header length)
  uint64_t size = 0;        // total file size in bytes
  int32_t writer_rank = 0;  // the rank that wrote it
  // Where CheckpointMetadata::data_file_checksums: the CRC32C of the file's bytes [0, data_start)
  // (its length and header, which holds the checksums of its chunks); 0 otherwise.
  uint32_t header_crc32c = 0;

  friend bool operator==(const DataFile&, const DataFile&) = default;
};

// Which on-disk format a CheckpointMetadata was decoded from. Every format is read through the
// same model; only the native format carries checksums.
enum class CheckpointFormat : uint8_t {
  kNative = 0,       // docs/FORMAT.md
  kTorchDcp = 1,     // PyTorch distributed checkpoint (.metadata + .distcp files)
  kSafetensors = 2,  // a directory of safetensors files (Hugging Face), with or without an index
};

// How a stored chunk's bytes lie in its file.
enum class ChunkEncoding : uint8_t {
  // byte_length bytes at data_offset: the box's elements in row-major order.
  kRaw = 0,
  // stored_length bytes at data_offset that the format driver decodes into byte_length row-major
  // bytes (a compressed or non-contiguous item of a foreign format). Read whole, never in part.
  kDriverDecoded = 1,
};

// Its fields are ordered to pack into 128 bytes (a large checkpoint's metadata holds millions);
// the constructor takes them in their order of meaning.
struct StoredChunk {
  StoredChunk() = default;
  StoredChunk(Box box, uint32_t file, uint64_t data_offset, uint64_t byte_length,
              InlineVector<uint32_t, 2> block_crc32c = {},
              ChunkEncoding encoding = ChunkEncoding::kRaw, uint64_t stored_length = 0,
              uint16_t driver_tag = 0)
      : box(std::move(box)),
        data_offset(data_offset),
        byte_length(byte_length),
        block_crc32c(std::move(block_crc32c)),
        stored_length(stored_length),
        file(file),
        driver_tag(driver_tag),
        encoding(encoding) {}

  Box box;                  // global coordinates
  uint64_t data_offset = 0; // relative to the file's data_start
  uint64_t byte_length = 0; // box.volume() * DTypeSize(dtype)
  // One per checksum block of this chunk's bytes; empty when the checkpoint has no checksums
  // (CheckpointMetadata::checksum_block_bytes == 0). Most chunks have one or two blocks, kept
  // inline: a checkpoint's metadata holds millions of chunks.
  InlineVector<uint32_t, 2> block_crc32c;
  uint64_t stored_length = 0;  // kDriverDecoded only: the bytes to read and decode
  uint32_t file = 0;           // index into CheckpointMetadata::files
  uint16_t driver_tag = 0;     // kDriverDecoded only: how the driver decodes them (its own codes)
  ChunkEncoding encoding = ChunkEncoding::kRaw;

  friend bool operator==(const StoredChunk&, const StoredChunk&) = default;
};
static_assert(sizeof(StoredChunk) <= 128, "StoredChunk: keep the fields packed");

// Stored chunks that are the cells of a regular grid (format/chunk_grid.h): per dimension the
// shape is cut into consecutive intervals, every combination of intervals is one chunk, and the
// chunks are listed in row-major cell order (the last dimension fastest).
struct ChunkGrid {
  // Per dimension d: the n_d + 1 increasing cut points 0 = bounds[d][0] < ... < bounds[d][n_d] =
  // shape[d]; interval k is [bounds[d][k], bounds[d][k + 1]).
  std::vector<std::vector<int64_t>> bounds;
  // Per dimension: the chunk number of cell (k_0, ..., k_{D-1}) is the sum of k_d * strides[d].
  std::vector<uint64_t> strides;

  uint64_t cell_count() const { return strides.empty() ? 1 : strides[0] * (bounds[0].size() - 1); }
  friend bool operator==(const ChunkGrid&, const ChunkGrid&) = default;
};

// An index over stored chunks that are not a grid: the non-empty chunks' numbers sorted by their
// offset along one dimension, with the longest extent of any of them along it, so that the chunks
// under a box are found by a binary search (format/chunk_grid.h: IndexedChunksIntersecting).
struct ChunkIndex {
  uint32_t dim = 0;             // the dimension whose offsets are sorted
  int64_t max_extent = 0;       // the largest size of a chunk along it
  uint64_t chunk_count = 0;     // the tensor's chunks when the index was built (empty ones too)
  std::vector<int64_t> starts;  // sorted offsets along `dim`
  std::vector<uint32_t> chunks; // chunk numbers, in the order of `starts`

  friend bool operator==(const ChunkIndex&, const ChunkIndex&) = default;
};

// The chunks of a tensor held without a StoredChunk each (TensorMetadata::cells): chunk i lies in
// file files[i] at data_offsets[i], and its box is cell i of the tensor's grid or, for a tensor
// without one, boxes[i * 2 * rank, (i + 1) * 2 * rank): its offsets, then its sizes. 12 bytes a
// chunk of a grid, 12 + 16 x rank of a list, where a StoredChunk takes 128.
struct ChunkCells {
  std::vector<uint32_t> files;          // indices into CheckpointMetadata::files
  std::vector<uint64_t> data_offsets;  // relative to the file's data_start
  std::vector<int64_t> boxes;          // empty for a grid tensor

  friend bool operator==(const ChunkCells&, const ChunkCells&) = default;
};

// Block checksums kept apart from the chunks they belong to, tensor by tensor in the order of a
// list of TensorMetadata: chunk c of tensor t has tensors[t].crcs[start(c), start(c + 1)). A
// save's commit collects the ranks' checksums into one (engine/write_reports.h) and encodes the
// metadata from the plan's chunks and these (EncodeMetadata in format/native/metadata_codec.h),
// so that a plan its cache holds is not copied to fill them in: at 8,192 ranks x 1,000 tensors
// the plan's chunks take 600 MiB, this table 19 MiB (4 bytes for a chunk of one block).
struct ChunkChecksums {
  struct Tensor {
    // Where each chunk's checksums start: `starts` (one per chunk, and one more: the end), or,
    // with `starts` empty, `per_chunk` of them for each of `chunks` chunks (what
    // LayOutChunkChecksums gives a tensor whose chunks all have as many blocks: a grid of even
    // cuts, or one of chunks within a block each, which would take 8 bytes a chunk of starts for
    // 4 of checksums).
    std::vector<uint64_t> starts;
    uint64_t chunks = 0;
    uint64_t per_chunk = 0;
    std::vector<uint32_t> crcs;

    uint64_t chunk_count() const { return starts.empty() ? chunks : starts.size() - 1; }
    uint64_t start(size_t chunk) const {
      return starts.empty() ? chunk * per_chunk : starts[chunk];
    }
    std::span<const uint32_t> of(size_t chunk) const {
      const uint64_t first = start(chunk);
      return std::span<const uint32_t>(crcs).subspan(first, start(chunk + 1) - first);
    }
  };
  std::vector<Tensor> tensors;
};

// Consecutive cells of a packed grid whose files and data offsets step evenly: cell first + k
// (k < count) lies in file `file + k * file_step` at `data_offset + k * offset_step` (u64
// arithmetic, wrapping). A tensor sharded over ranks, one cell per rank at the same offset of
// each rank's file, is one run.
struct CellRun {
  uint64_t first = 0;
  uint64_t count = 0;
  uint32_t file = 0;
  int64_t file_step = 0;
  uint64_t data_offset = 0;
  uint64_t offset_step = 0;

  uint32_t file_of(uint64_t cell) const {
    return static_cast<uint32_t>(file + static_cast<int64_t>(cell - first) * file_step);
  }
  uint64_t data_offset_of(uint64_t cell) const {
    return data_offset + (cell - first) * offset_step;
  }
  friend bool operator==(const CellRun&, const CellRun&) = default;
};

// The chunks of a tensor as the native decoder keeps them (ChunkList): chunk c is raw; a grid's
// cell c of `grid` (format/chunk_grid.h), placed by the run that holds it (`runs`, in cell order,
// covering every cell once); or, for a list (`listed`), the box boxes[c * 2 * rank, (c + 1) * 2 *
// rank) (its offsets, then its sizes), in file files[c] at data_offsets[c]. Its byte length is its
// box's volume times `element_bytes`, its block checksums checksums.of(c). Made by a decoder that
// checked every chunk (its box within the shape, its bytes within its file, and the chunks'
// volumes adding up to the shape's); unpacked into StoredChunks once, on first use.
struct PackedChunks {
  ChunkGrid grid;             // unless `listed`
  bool listed = false;
  size_t rank = 0;
  std::vector<int64_t> boxes;           // `listed`: each chunk's offsets, then its sizes
  std::vector<uint32_t> files;          // `listed`: each chunk's
  std::vector<uint64_t> data_offsets;  // `listed`: each chunk's
  uint64_t element_bytes = 0;
  uint64_t cell_count = 0;
  std::vector<CellRun> runs;  // unless `listed`: the cells' files and data offsets
  ChunkChecksums::Tensor checksums;

  // Chunk c's offsets and sizes, `rank` values each, for a list.
  const int64_t* offsets_of(uint64_t c) const { return boxes.data() + c * 2 * rank; }
  const int64_t* sizes_of(uint64_t c) const { return offsets_of(c) + rank; }
  // Chunk c's box, of a grid or a list.
  Box box_of(uint64_t c) const;
  // Chunk c's file and data offset, of a grid or a list.
  uint32_t file_of(uint64_t c) const { return listed ? files[c] : run_of(c).file_of(c); }
  uint64_t data_offset_of(uint64_t c) const {
    return listed ? data_offsets[c] : run_of(c).data_offset_of(c);
  }

  // The run that holds `cell` (< cell_count) of a grid.
  const CellRun& run_of(uint64_t cell) const {
    if (runs.size() == 1) return runs[0];
    size_t lo = 0, hi = runs.size();  // the last run whose first cell is <= cell
    while (hi - lo > 1) {
      const size_t mid = lo + (hi - lo) / 2;
      (runs[mid].first <= cell ? lo : hi) = mid;
    }
    return runs[lo];
  }

  std::once_flag unpacked_once;
  std::vector<StoredChunk> unpacked;  // the chunks, once unpacked_once ran
  std::atomic<bool> made{false};      // set when they are
};

// Appends cell `cell` (the one after the last of `runs`), placed in `file` at `data_offset`, to
// `runs`: the last run grows when the cell takes its step (or gives a run of one cell its step).
inline void AppendCellRun(std::vector<CellRun>* runs, uint64_t cell, uint32_t file,
                          uint64_t data_offset) {
  if (!runs->empty()) {
    CellRun& last = runs->back();
    const int64_t file_step = static_cast<int64_t>(file) - last.file_of(cell - 1);
    const uint64_t offset_step = data_offset - last.data_offset_of(cell - 1);
    if (last.count == 1) {
      last.file_step = file_step;
      last.offset_step = offset_step;
      ++last.count;
      return;
    }
    if (file_step == last.file_step && offset_step == last.offset_step) {
      ++last.count;
      return;
    }
  }
  runs->push_back(CellRun{cell, 1, file, 0, data_offset, 0});
}

// A tensor's stored chunks (TensorMetadata::chunks): a vector of StoredChunk, or the chunks a
// decoder kept packed (PackedChunks: a grid's cells as runs of files and offsets, and checksums
// each, 4 bytes a cell of one block; a list's boxes, files and offsets side by side, 44 bytes a
// chunk of rank 2; where a StoredChunk takes 128) until a consumer asks for them as
// StoredChunks. Opening a checkpoint of millions of chunks then costs their packed bytes, and the
// StoredChunks are made once, for the tensors a consumer walks.
//
// It reads as a std::vector<StoredChunk>: size() and empty() never unpack; the element access,
// the iterators, data() and the conversion to a vector unpack on first use (once, shared by every
// copy, safe from several threads, as reading a vector is); anything that changes the list
// unpacks it into a vector of its own first (a copy shares the packed form until then). file(),
// data_offset(), block_crc32c() and box() read one chunk's placement, checksums and box without
// unpacking.
class ChunkList {
 public:
  using value_type = StoredChunk;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = StoredChunk&;
  using const_reference = const StoredChunk&;
  using pointer = StoredChunk*;
  using const_pointer = const StoredChunk*;
  using iterator = StoredChunk*;
  using const_iterator = const StoredChunk*;

  ChunkList() = default;
  ChunkList(std::vector<StoredChunk> chunks) : list_(std::move(chunks)) {}  // NOLINT: a vector
  ChunkList(std::initializer_list<StoredChunk> chunks) : list_(chunks) {}
  // Chunks kept packed: one per cell of `packed`.
  explicit ChunkList(std::shared_ptr<PackedChunks> packed) : packed_(std::move(packed)) {}

  size_t size() const { return packed_ ? packed_->cell_count : list_.size(); }
  bool empty() const { return size() == 0; }
  size_t capacity() const { return packed_ ? size() : list_.capacity(); }
  // Whether the chunks are held packed (made by a decoder, not yet changed), and as the cells of
  // a grid.
  bool packed() const { return packed_ != nullptr; }
  bool packed_grid() const { return packed_ != nullptr && !packed_->listed; }
  // Whether the StoredChunks exist: always for a vector, for a packed list once walked.
  bool unpacked() const { return !packed_ || packed_->made.load(std::memory_order_acquire); }
  const PackedChunks* packed_chunks() const { return packed_.get(); }

  // The chunks as a vector, unpacked on first use.
  const std::vector<StoredChunk>& vec() const { return packed_ ? Unpacked() : list_; }
  operator const std::vector<StoredChunk>&() const { return vec(); }  // NOLINT: reads as one
  // The chunks as a vector of this list's own, to change.
  std::vector<StoredChunk>& mut() {
    if (packed_) TakeUnpacked();
    return list_;
  }

  const StoredChunk& operator[](size_t i) const { return vec()[i]; }
  StoredChunk& operator[](size_t i) { return mut()[i]; }
  const StoredChunk& at(size_t i) const { return vec().at(i); }
  StoredChunk& at(size_t i) { return mut().at(i); }
  const StoredChunk& front() const { return vec().front(); }
  StoredChunk& front() { return mut().front(); }
  const StoredChunk& back() const { return vec().back(); }
  StoredChunk& back() { return mut().back(); }
  const StoredChunk* data() const { return vec().data(); }
  StoredChunk* data() { return mut().data(); }
  const StoredChunk* begin() const { return data(); }
  const StoredChunk* end() const { return data() + size(); }
  StoredChunk* begin() { return data(); }
  StoredChunk* end() { return data() + size(); }

  void reserve(size_t n) { mut().reserve(n); }
  void resize(size_t n) { mut().resize(n); }
  void clear() {
    packed_.reset();
    list_.clear();
  }
  void push_back(const StoredChunk& chunk) { mut().push_back(chunk); }
  void push_back(StoredChunk&& chunk) { mut().push_back(std::move(chunk)); }
  template <typename... Args>
  StoredChunk& emplace_back(Args&&... args) {
    return mut().emplace_back(std::forward<Args>(args)...);
  }

  // Chunk i's file, data offset and block checksums, read from the packed form when there is
  // one (nothing is unpacked), else from the chunk.
  uint32_t file(size_t i) const {
    return packed_ ? packed_->file_of(i) : list_[i].file;
  }
  uint64_t data_offset(size_t i) const {
    return packed_ ? packed_->data_offset_of(i) : list_[i].data_offset;
  }
  std::span<const uint32_t> block_crc32c(size_t i) const {
    if (packed_) return packed_->checksums.of(i);
    return std::span<const uint32_t>(list_[i].block_crc32c.data(), list_[i].block_crc32c.size());
  }
  // Chunk i's box (a copy), read from the packed form when there is one.
  Box box(size_t i) const { return packed_ ? packed_->box_of(i) : list_[i].box; }

  friend bool operator==(const ChunkList& a, const ChunkList& b) { return a.vec() == b.vec(); }

 private:
  const std::vector<StoredChunk>& Unpacked() const;  // packed_ set
  void TakeUnpacked();                               // packed_ set; clears it

  std::vector<StoredChunk> list_;  // the chunks, unless packed_ holds them
  std::shared_ptr<PackedChunks> packed_;
};

// One chunk of a data file as the file's header lists it: what the rank that writes the file
// knows of the chunk, without the rest of the checkpoint's metadata.
struct DataFileChunk {
  std::string_view tensor;   // the tensor's name
  DType dtype = DType::kFloat32;
  const Box* box = nullptr;  // global coordinates
  uint64_t data_offset = 0;  // relative to the file's data_start
  uint64_t byte_length = 0;
};

struct TensorMetadata {
  TensorMetadata() = default;
  TensorMetadata(std::string name, DType dtype, Shape shape, std::vector<StoredChunk> chunks = {})
      : name(std::move(name)), dtype(dtype), shape(std::move(shape)), chunks(std::move(chunks)) {}

  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  ChunkList chunks;  // non-empty boxes, no overlaps, covering the shape
  // Set when `chunks` are the cells of this grid, in its order: an index over them that a load
  // plan searches by arithmetic instead of scanning the chunks. Set only by whoever proved it
  // (the save planner, the native decoder of a grid record, IndexChunkGrids); code that changes
  // `chunks` of a tensor that has one must reset it. Not part of equality: it says nothing the
  // chunks do not.
  std::optional<ChunkGrid> grid;
  // Set instead of `grid` for chunks that are not one (IndexChunkGrids), with the same rules.
  std::optional<ChunkIndex> index;
  // Set when this copy holds only some of the stored chunks (a load rank's part of the metadata,
  // DecodeMetadata with a ChunkFilter in format/native/metadata_codec.h): chunks[i] is the stored
  // chunk numbered kept[i], ascending. Stored chunk numbers are what crosses ranks (the needs and
  // plans of shared reads); ChunkNumber and ChunkIndexOfNumber translate. Unset: every chunk,
  // chunks[i] numbered i. A copy with `kept` set has neither `grid` nor `index`.
  std::optional<std::vector<uint32_t>> kept;
  // Set for a tensor held without a StoredChunk per chunk: `chunks` is empty, and chunk i is raw,
  // in cells->files[i] at cells->data_offsets[i], its box cell i of `grid` (GridCellBox in
  // format/chunk_grid.h) when the tensor has one, else listed in cells->boxes, its byte_length
  // the box's volume times the dtype size, its checksums kept apart (ChunkChecksums). Only a save
  // plan holds tensors so (SavePlanOptions::chunk_cells): at 8,192 ranks x 1,000 tensors its
  // chunks take 83 MiB instead of 600. Metadata that is decoded, received, loaded or shown never
  // has them; ExpandChunkCells gives the chunks.
  std::optional<ChunkCells> cells;

  uint64_t total_bytes() const { return static_cast<uint64_t>(ShapeVolume(shape)) * DTypeSize(dtype); }
  friend bool operator==(const TensorMetadata& a, const TensorMetadata& b) {
    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.chunks == b.chunks &&
           a.kept == b.kept && a.cells == b.cells;
  }
};

// How many stored chunks `tensor` holds: its chunks, or its cells (TensorMetadata::cells).
inline uint64_t ChunkCount(const TensorMetadata& tensor) {
  return tensor.cells ? tensor.cells->files.size() : tensor.chunks.size();
}

// Places chunk `c` of `tensor`, as a chunk or as a cell: its file and data offset.
inline void PlaceChunk(TensorMetadata& tensor, size_t c, uint32_t file, uint64_t data_offset) {
  if (tensor.cells) {
    tensor.cells->files[c] = file;
    tensor.cells->data_offsets[c] = data_offset;
  } else {
    tensor.chunks[c].file = file;
    tensor.chunks[c].data_offset = data_offset;
  }
}

// The file and data offset of chunk `c` of `tensor`, as a chunk or as a cell.
inline uint32_t ChunkFile(const TensorMetadata& tensor, size_t c) {
  return tensor.cells ? tensor.cells->files[c] : tensor.chunks[c].file;
}
inline uint64_t ChunkDataOffset(const TensorMetadata& tensor, size_t c) {
  return tensor.cells ? tensor.cells->data_offsets[c] : tensor.chunks[c].data_offset;
}

// Which stored chunks a copy of a checkpoint's metadata keeps (a load rank's part of it: the
// native decoder's DecodeMetadata): per tensor name, boxes in global coordinates. A tensor keeps
// the chunks that share a point with one of its boxes (TensorMetadata::kept), and a tensor the
// filter does not name keeps none.
using ChunkFilter = std::map<std::string, std::vector<Box>, std::less<>>;

// Whether `box` of a ChunkFilter can reach chunks of a tensor of `shape`: of its rank, not empty
// and inside it (a load plan refuses the others, which reach nothing).
bool FilterBoxReaches(const Box& box, const Shape& shape);

// Whether a chunk whose box is `chunk` of a tensor of `shape` shares a point with one of `boxes`
// that can reach chunks (a chunk of another rank than the shape's is kept by none).
bool FilterKeeps(std::span<const Box> boxes, const Shape& shape, const Box& chunk);

// The stored number of chunks[index] of `tensor` (TensorMetadata::kept).
inline uint32_t ChunkNumber(const TensorMetadata& tensor, size_t index) {
  return tensor.kept ? (*tensor.kept)[index] : static_cast<uint32_t>(index);
}

// The index into `tensor.chunks` of the stored chunk numbered `number`, or nullopt when this copy
// does not hold it (past the chunks, or not kept).
std::optional<uint32_t> ChunkIndexOfNumber(const TensorMetadata& tensor, uint64_t number);

enum class ObjectEncoding : uint8_t {
  kJson = 1,    // UTF-8 JSON text of a plain-data value
  kPickle = 2,  // pickled bytes; loaded only with an explicit opt-in
  kBytes = 3,   // opaque bytes
  kTorchSave = 4,  // a torch.save archive of a Python object (PyTorch DCP's non-tensor items);
                   // loaded with torch.load(weights_only=True), anything more only with the
                   // same opt-in as kPickle
  kPlain = 5,  // a pickle of plain data only (None, bool, int64, float, str, bytes, list, tuple,
               // dict): exact where JSON is not; always decoded by a restricted unpickler
};

// True for the encoding bytes the decoders accept (1 to 5).
inline constexpr bool IsKnownObjectEncoding(uint8_t encoding) {
  return encoding >= static_cast<uint8_t>(ObjectEncoding::kJson) &&
         encoding <= static_cast<uint8_t>(ObjectEncoding::kPlain);
}

// Where an object's bytes lie in a data file, for drivers that read object payloads only when
// they are needed (PyTorch DCP: a BYTE_IO item, possibly zstd-compressed). Opening such a
// checkpoint reads and decodes none of them, so that a small hostile checkpoint cannot make
// `inspect` decode gigabytes.
struct StoredObjectItem {
  uint32_t file = 0;        // index into CheckpointMetadata::files
  uint64_t offset = 0;      // byte offset of the item in the file
  uint64_t length = 0;      // stored bytes (compressed, for a compressed item)
  uint32_t driver_tag = 0;  // how the driver decodes them (its own codes)

  friend bool operator==(const StoredObjectItem&, const StoredObjectItem&) = default;
  friend auto operator<=>(const StoredObjectItem&, const StoredObjectItem&) = default;
};

// Caps on reading stored object payloads (ReadObjectPayloads in format/open_checkpoint.h).
struct ObjectReadLimits {
  // One object's decoded payload (and its stored item).
  uint64_t max_object_bytes = uint64_t{1} << 30;
  // The payloads one call hands out, together: entries that share one stored item count once
  // each, since each gets its own copy.
  uint64_t max_total_bytes = uint64_t{2} << 30;
};

struct ObjectEntry {
  ObjectEntry() = default;
  ObjectEntry(std::string name, ObjectEncoding encoding, std::string payload,
              std::optional<StoredObjectItem> stored = std::nullopt)
      : name(std::move(name)),
        encoding(encoding),
        payload(std::move(payload)),
        stored(std::move(stored)) {}

  std::string name;
  ObjectEncoding encoding = ObjectEncoding::kJson;
  std::string payload;
  // Set while the payload has not been read: `payload` is empty and `encoding` is what the stored
  // item is before the driver classifies it (DCP: kTorchSave). ReadObjectPayloads
  // (format/open_checkpoint.h) reads and decodes it, sets `encoding` and `payload`, and clears
  // this. Consumers of payloads (load, convert, diff, verify) call it first; save refuses
  // entries that still have it.
  std::optional<StoredObjectItem> stored;

  // The payload's size, or the stored item's while it is not read.
  uint64_t size_bytes() const { return stored ? stored->length : payload.size(); }
  friend bool operator==(const ObjectEntry&, const ObjectEntry&) = default;
};

// How many block checksums a chunk of `byte_length` bytes has: ceil(byte_length / block_bytes),
// none when `block_bytes` is 0 (a format that stores no checksums). docs/FORMAT.md §3.5.
inline uint64_t ChecksumBlockCount(uint64_t byte_length, uint64_t block_bytes) {
  return byte_length == 0 || block_bytes == 0 ? 0 : (byte_length - 1) / block_bytes + 1;
}

// The table of `tensors`' checksums, laid out and zero: every chunk's start for
// ChecksumBlockCount(byte_length, block_bytes) checksums, given as a count per chunk for a tensor
// whose chunks all have the same count. Tensor by tensor on `pool` when given
// (an allocation failing there is kResourceExhausted).
Result<ChunkChecksums> LayOutChunkChecksums(const std::vector<TensorMetadata>& tensors,
                                            uint64_t block_bytes, ThreadPool* pool = nullptr);

// kInternal naming the tensor unless `checksums` has an entry for every tensor of `tensors` and a
// start for every chunk of each, and one more (or a count per chunk for as many chunks as the
// tensor has and as many checksums as they take).
Status CheckChecksumsFit(const std::vector<TensorMetadata>& tensors,
                         const ChunkChecksums& checksums);

// Sets the block checksums of every chunk of `tensors` to those `checksums` holds for it (after
// CheckChecksumsFit). A tensor held as cells is given its chunks first (ExpandChunkCells).
Status FillChecksums(const ChunkChecksums& checksums, std::vector<TensorMetadata>* tensors);

struct CheckpointMetadata {
  // The native format's (format/native/metadata_codec.h): the version metadata without the data
  // files' checksums is written as, and what a native save sets (4.0) and a decoder reads.
  uint32_t version_major = 3;
  uint32_t version_minor = 0;
  std::string save_id;  // unique per save; data file names carry it
  int32_t world_size = 1;
  CheckpointFormat format = CheckpointFormat::kNative;
  // 0: the format stores no checksums (foreign formats); chunks are read unverified.
  uint64_t checksum_block_bytes = kDefaultChecksumBlockBytes;
  // Native only: every data file's header holds the block checksums of its chunks and the
  // metadata each header's CRC32C (DataFile::header_crc32c; docs/FORMAT.md §2.2). Set by a native
  // save and by the decoder of a version 3.1 or 4 file; the encoder then writes version 4 (whose
  // tensor records hold no checksums), and 3.0 without it.
  bool data_file_checksums = false;
  // The chunks hold no block checksums here (StoredChunk::block_crc32c and the packed checksums
  // are empty): the metadata was decoded from a version 4 file, and reads take each chunk's
  // checksums from its data file's header, checked against DataFile::header_crc32c
  // (engine/header_checksums.h). Implies data_file_checksums.
  bool checksums_in_headers = false;
  // A load rank's part of the metadata received from the coordinator (EncodeMetadataPartForWire
  // in format/metadata_wire.h) holds only the files its chunks and objects name; the others keep
  // their place, without a name.
  std::vector<DataFile> files;
  std::vector<TensorMetadata> tensors;   // sorted by name, names unique
  std::vector<ObjectEntry> objects;      // sorted by name, names unique
  std::map<std::string, std::string> attributes;  // free-form string pairs (e.g. "step")

  const TensorMetadata* FindTensor(std::string_view name) const;
  const ObjectEntry* FindObject(std::string_view name) const;
  friend bool operator==(const CheckpointMetadata&, const CheckpointMetadata&) = default;
};

// `metadata` with no tensors: every other field copied, the tensors not.
CheckpointMetadata WithoutTensors(const CheckpointMetadata& metadata);

// The memory the chunk lists of `tensors` take (their capacity in StoredChunk, their grid
// cells', and the packed form of packed chunk lists, not their StoredChunks once unpacked).
uint64_t ChunkListBytes(const std::vector<TensorMetadata>& tensors);

// ---- Size validation shared by every format's reader (docs/FORMAT.md §3.7) ----
//
// Every size a reader computes from untrusted bytes (a shape's volume, a chunk's box, a byte
// length, a coverage count) goes through these checks, with checked arithmetic, before it is
// used to size a buffer or a copy. The limits are those of the native format: a tensor holds at
// most kMaxTensorBytes bytes, computed dimension by dimension (every prefix product of the shape
// times the dtype size stays within the limit, so the volume of the shape and of every box inside
// it fits in int64 whatever the order of multiplication).

// Largest tensor, in bytes, any reader accepts.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 62;
// Most dimensions a tensor may have.
inline constexpr size_t kMaxTensorDims = 64;

// The byte size of a `dtype` tensor of `shape`. kDataLoss "<where>: ..." naming the shape when it
// has more than kMaxTensorDims dimensions, a dimension outside [0, 2^62], or more than
// kMaxTensorBytes bytes ("... exceeds 2^62 bytes"; checked after every dimension, so a shape is
// refused as soon as a prefix of it is too large).
Result<uint64_t> CheckedTensorBytes(DType dtype, const Shape& shape, std::string_view where);

// The element count of `box` after checking that it has the rank of `shape`, non-negative
// offsets and sizes, and offset + size <= dimension in every dimension (compared without
// wrapping). `shape` must have passed CheckedTensorBytes. kDataLoss "<where>: ..." naming the box
// and the shape otherwise.
Result<uint64_t> CheckedBoxVolume(const Box& box, const Shape& shape, std::string_view where);

// Checks one decoded tensor of `metadata`: its shape (CheckedTensorBytes), and for every chunk
// its box (CheckedBoxVolume), its byte_length (the box's volume times the dtype size), its file
// index and that its bytes (stored_length of them for kDriverDecoded chunks) lie inside its data
// file. `source` names the checkpoint; errors are kDataLoss "<source>: tensor 'NAME' ..." naming
// the chunk's file and the offending numbers. Coverage is not required here (verify reports
// chunks that leave part of a tensor uncovered; the load plan refuses them).
Status ValidateTensorSizes(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                           std::string_view source);

// ValidateTensorSizes for every tensor of `metadata`, tensor by tensor on `pool` (null: on the
// calling thread); the error of the first bad tensor in order, with or without a pool.
Status ValidateCheckpointSizes(const CheckpointMetadata& metadata, std::string_view source,
                               ThreadPool* pool = nullptr);

// The number of elements the chunks of `tensor` hold, summed with checked arithmetic: saturates
// at UINT64_MAX instead of wrapping. Chunk volumes are computed with checked arithmetic too, so
// any tensor may be passed; only a tensor that passed ValidateTensorSizes gives a meaningful
// count below the saturation.
uint64_t CountChunkElements(const TensorMetadata& tensor);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_METADATA_H_
