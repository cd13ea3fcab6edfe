#include "shardpoint/format/metadata.h"

#include <algorithm>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {

CheckpointMetadata WithoutTensors(const CheckpointMetadata& metadata) {
  CheckpointMetadata out;
  out.version_major = metadata.version_major;
  out.version_minor = metadata.version_minor;
  out.save_id = metadata.save_id;
  out.world_size = metadata.world_size;
  out.format = metadata.format;
  out.checksum_block_bytes = metadata.checksum_block_bytes;
  out.data_file_checksums = metadata.data_file_checksums;
  out.checksums_in_headers = metadata.checksums_in_headers;
  out.files = metadata.files;
  out.objects = metadata.objects;
  out.attributes = metadata.attributes;
  return out;
}

uint64_t ChunkListBytes(const std::vector<TensorMetadata>& tensors) {
  uint64_t bytes = 0;
  for (const TensorMetadata& t : tensors) {
    if (const PackedChunks* packed = t.chunks.packed_chunks()) {
      bytes += packed->runs.capacity() * sizeof(CellRun) +
               packed->boxes.capacity() * sizeof(int64_t) +
               packed->files.capacity() * sizeof(uint32_t) +
               packed->data_offsets.capacity() * sizeof(uint64_t) +
               packed->checksums.starts.capacity() * sizeof(uint64_t) +
               packed->checksums.crcs.capacity() * sizeof(uint32_t);
    } else {
      bytes += t.chunks.capacity() * sizeof(StoredChunk);
    }
    if (t.cells) {
      bytes += t.cells->files.capacity() * sizeof(uint32_t) +
               t.cells->data_offsets.capacity() * sizeof(uint64_t) +
               t.cells->boxes.capacity() * sizeof(int64_t);
    }
  }
  return bytes;
}

bool FilterBoxReaches(const Box& box, const Shape& shape) {
  // Within the shape first: the volume of a box that is not could overflow.
  return box.rank() == shape.size() && WithinShape(box, shape) && !box.empty();
}

bool FilterKeeps(std::span<const Box> boxes, const Shape& shape, const Box& chunk) {
  if (chunk.rank() != shape.size() || chunk.offsets.size() != shape.size()) return false;
  for (const Box& box : boxes) {
    if (!FilterBoxReaches(box, shape)) continue;
    // Whether they share a point, in wide arithmetic: a decoder asks before it checks the
    // chunk's box, whose numbers may be anything.
    bool shared = true;
    for (size_t d = 0; d < shape.size() && shared; ++d) {
      const __int128 lo = std::max<__int128>(box.offsets[d], chunk.offsets[d]);
      const __int128 hi = std::min<__int128>(__int128{box.offsets[d]} + box.sizes[d],
                                             __int128{chunk.offsets[d]} + chunk.sizes[d]);
      shared = lo < hi;
    }
    if (shared) return true;
  }
  return false;
}

std::optional<uint32_t> ChunkIndexOfNumber(const TensorMetadata& tensor, uint64_t number) {
  if (!tensor.kept) {
    if (number >= tensor.chunks.size()) return std::nullopt;
    return static_cast<uint32_t>(number);
  }
  const std::vector<uint32_t>& kept = *tensor.kept;
  auto it = std::lower_bound(kept.begin(), kept.end(), number);
  if (it == kept.end() || *it != number) return std::nullopt;
  return static_cast<uint32_t>(it - kept.begin());
}

const TensorMetadata* CheckpointMetadata::FindTensor(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorMetadata& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

const ObjectEntry* CheckpointMetadata::FindObject(std::string_view name) const {
  auto it = std::lower_bound(objects.begin(), objects.end(), name,
                             [](const ObjectEntry& o, std::string_view n) { return o.name < n; });
  return it != objects.end() && it->name == name ? &*it : nullptr;
}

}  // namespace sp

namespace sp {
namespace {

// The product of `sizes`, saturating at UINT64_MAX.
uint64_t SaturatingVolume(std::span<const int64_t> sizes) {
  uint64_t volume = 1;
  for (int64_t s : sizes) {
    if (s <= 0) return 0;
    if (__builtin_mul_overflow(volume, static_cast<uint64_t>(s), &volume)) return UINT64_MAX;
  }
  return volume;
}

std::string ChunkWhere(const CheckpointMetadata& md, const TensorMetadata& t, const StoredChunk& c,
                       std::string_view source) {
  std::string where = std::string(source) + ": tensor '" + t.name + "' chunk " + c.box.ToString();
  if (c.file < md.files.size()) where += " in " + md.files[c.file].name;
  return where;
}

// The bytes a chunk stores: byte_length, or stored_length for a chunk its driver decodes.
uint64_t StoredBytes(const StoredChunk& c) {
  return c.encoding == ChunkEncoding::kRaw ? c.byte_length : c.stored_length;
}

// Whether the chunk's stored bytes [data_start + data_offset, +StoredBytes) lie inside its file's
// size (compared without wrapping).
bool ChunkInFile(const DataFile& file, const StoredChunk& c) {
  uint64_t begin = 0;
  uint64_t end = 0;
  return !__builtin_add_overflow(file.data_start, c.data_offset, &begin) &&
         !__builtin_add_overflow(begin, StoredBytes(c), &end) && end <= file.size;
}

// The message of a chunk that fails ChunkInFile.
Status OutsideFileError(const DataFile& file, const StoredChunk& c, std::string_view where) {
  return DataLossError(std::string(where) + ": bytes [" + std::to_string(c.data_offset) + ", +" +
                       std::to_string(StoredBytes(c)) + ") after the data start " +
                       std::to_string(file.data_start) + " lie outside the file's " +
                       std::to_string(file.size) + " bytes");
}

// A box checked against a shape: its volume, or the first dimension in which it leaves the
// shape (kOtherRank when its rank is not the shape's). Offsets and sizes are compared without
// wrapping; with a shape that passed CheckedTensorBytes the volume cannot overflow.
struct BoxCheck {
  static constexpr size_t kInside = SIZE_MAX;
  static constexpr size_t kOtherRank = SIZE_MAX - 1;
  uint64_t volume = 1;
  size_t bad = kInside;
};

BoxCheck CheckBox(const Box& box, const Shape& shape) {
  BoxCheck check;
  if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) {
    check.bad = BoxCheck::kOtherRank;
    return check;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t offset = box.offsets[d];
    const int64_t size = box.sizes[d];
    if (offset < 0 || size < 0 || size > shape[d] || offset > shape[d] - size) {
      check.bad = d;
      return check;
    }
    check.volume *= static_cast<uint64_t>(size);  // each prefix <= the shape's prefix <= 2^62
  }
  return check;
}

}  // namespace

Result<uint64_t> CheckedTensorBytes(DType dtype, const Shape& shape, std::string_view where) {
  if (shape.size() > kMaxTensorDims) {
    return DataLossError(std::string(where) + ": " + std::to_string(shape.size()) +
                         " dimensions, more than " + std::to_string(kMaxTensorDims));
  }
  uint64_t bytes = DTypeSize(dtype);
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0 || static_cast<uint64_t>(shape[d]) > kMaxTensorBytes) {
      return DataLossError(std::string(where) + ": dimension " + std::to_string(d) + " of shape " +
                           ShapeToString(shape) + " is out of range [0, 2^62]");
    }
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(shape[d]), &bytes) ||
        bytes > kMaxTensorBytes) {
      return DataLossError(std::string(where) + ": shape " + ShapeToString(shape) + " of " +
                           std::string(DTypeName(dtype)) + " exceeds 2^62 bytes");
    }
  }
  return bytes;
}

Result<uint64_t> CheckedBoxVolume(const Box& box, const Shape& shape, std::string_view where) {
  const BoxCheck check = CheckBox(box, shape);
  if (check.bad == BoxCheck::kInside) return check.volume;
  if (check.bad == BoxCheck::kOtherRank) {
    return DataLossError(std::string(where) + ": box " + box.ToString() +
                         " has another rank than the shape " + ShapeToString(shape));
  }
  const size_t d = check.bad;
  return DataLossError(std::string(where) + ": dimension " + std::to_string(d) + " [" +
                       std::to_string(box.offsets[d]) + ", +" + std::to_string(box.sizes[d]) +
                       ") lies outside the shape " + ShapeToString(shape));
}

Status ValidateTensorSizes(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                           std::string_view source) {
  const std::string where = std::string(source) + ": tensor '" + tensor.name + "'";
  SP_RETURN_IF_ERROR(CheckedTensorBytes(tensor.dtype, tensor.shape, where).status());
  // Chunks kept packed were made by the native decoder, after it checked each one's box (a grid's
  // cut points, or a listed box) within the shape and its file and bytes as below
  // (format/native): unpacking them to check again would cost what keeping them packed saves.
  if (tensor.chunks.packed()) return OkStatus();
  const uint64_t item = DTypeSize(tensor.dtype);
  for (const StoredChunk& c : tensor.chunks) {
    // The checks first, and a message (naming the chunk's box and file) only for a chunk that
    // fails one: building it for each of millions of chunks cost more than the checks.
    const bool file_known = c.file < metadata.files.size();
    const BoxCheck box = CheckBox(c.box, tensor.shape);
    const bool length_holds = box.bad == BoxCheck::kInside && c.byte_length == box.volume * item;
    if (file_known && length_holds && ChunkInFile(metadata.files[c.file], c)) continue;
    const std::string chunk_where = ChunkWhere(metadata, tensor, c, source);
    if (!file_known) {
      return DataLossError(chunk_where + ": file index " + std::to_string(c.file) +
                           " is out of range (" + std::to_string(metadata.files.size()) +
                           " files)");
    }
    if (box.bad != BoxCheck::kInside) {
      return CheckedBoxVolume(c.box, tensor.shape, chunk_where).status();
    }
    if (!length_holds) {
      return DataLossError(chunk_where + ": byte length " + std::to_string(c.byte_length) +
                           ", expected " + std::to_string(box.volume * item) + " (" +
                           std::to_string(box.volume) + " elements of " +
                           std::string(DTypeName(tensor.dtype)) + ")");
    }
    return OutsideFileError(metadata.files[c.file], c, chunk_where);
  }
  return OkStatus();
}

Status ValidateCheckpointSizes(const CheckpointMetadata& metadata, std::string_view source,
                               ThreadPool* pool) {
  return ParallelForInOrder(pool, static_cast<int64_t>(metadata.tensors.size()), [&](int64_t t) {
    return ValidateTensorSizes(metadata, metadata.tensors[t], source);
  });
}

uint64_t CountChunkElements(const TensorMetadata& tensor) {
  uint64_t covered = 0;
  // Packed chunks are the cells of a grid, which tile the shape, or a list whose volumes the
  // decoder checked add up to the shape's.
  if (tensor.chunks.packed()) return SaturatingVolume(tensor.shape);
  for (const StoredChunk& c : tensor.chunks) {
    if (__builtin_add_overflow(covered, SaturatingVolume(c.box.sizes), &covered)) return UINT64_MAX;
  }
  return covered;
}

Result<ChunkChecksums> LayOutChunkChecksums(const std::vector<TensorMetadata>& tensors,
                                            uint64_t block_bytes, ThreadPool* pool) {
  ChunkChecksums checksums;
  checksums.tensors.resize(tensors.size());
  const auto lay_out = [&](int64_t t) {
    std::vector<uint64_t> lengths;
    ChunkByteLengths(tensors[t], &lengths);
    ChunkChecksums::Tensor& table = checksums.tensors[t];
    const uint64_t per_chunk =
        lengths.empty() ? 0 : ChecksumBlockCount(lengths.front(), block_bytes);
    if (std::all_of(lengths.begin(), lengths.end(), [&](uint64_t length) {
          return ChecksumBlockCount(length, block_bytes) == per_chunk;
        })) {
      table.chunks = lengths.size();
      table.per_chunk = per_chunk;
      table.crcs.resize(lengths.size() * per_chunk);
      return OkStatus();
    }
    table.starts.resize(lengths.size() + 1);
    uint64_t blocks = 0;
    for (size_t c = 0; c < lengths.size(); ++c) {
      table.starts[c] = blocks;
      blocks += ChecksumBlockCount(lengths[c], block_bytes);
    }
    table.starts.back() = blocks;
    table.crcs.resize(blocks);
    return OkStatus();
  };
  if (pool != nullptr) {
    SP_RETURN_IF_ERROR(ParallelFor(pool, static_cast<int64_t>(tensors.size()), lay_out));
  } else {
    for (size_t t = 0; t < tensors.size(); ++t) (void)lay_out(static_cast<int64_t>(t));
  }
  return checksums;
}

Status CheckChecksumsFit(const std::vector<TensorMetadata>& tensors,
                         const ChunkChecksums& checksums) {
  if (checksums.tensors.size() != tensors.size()) {
    return InternalError("the checksums of " + std::to_string(checksums.tensors.size()) +
                         " tensors for metadata of " + std::to_string(tensors.size()));
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const ChunkChecksums::Tensor& table = checksums.tensors[t];
    if (!table.starts.empty() && table.starts.size() != ChunkCount(tensors[t]) + 1) {
      return InternalError("the checksums of tensor '" + tensors[t].name + "' are for " +
                           std::to_string(table.starts.size()) + " chunk boundaries, not " +
                           std::to_string(ChunkCount(tensors[t]) + 1));
    }
    uint64_t blocks = 0;
    if (table.starts.empty() &&
        (table.chunks != ChunkCount(tensors[t]) ||
         __builtin_mul_overflow(table.chunks, table.per_chunk, &blocks) ||
         blocks != table.crcs.size())) {
      return InternalError("the checksums of tensor '" + tensors[t].name + "' are for " +
                           std::to_string(table.chunks) + " chunks of " +
                           std::to_string(table.per_chunk) + " in " +
                           std::to_string(table.crcs.size()) + ", not for its " +
                           std::to_string(ChunkCount(tensors[t])) + " chunks");
    }
  }
  return OkStatus();
}

Status FillChecksums(const ChunkChecksums& checksums, std::vector<TensorMetadata>* tensors) {
  SP_RETURN_IF_ERROR(CheckChecksumsFit(*tensors, checksums));
  for (size_t t = 0; t < tensors->size(); ++t) {
    if ((*tensors)[t].cells) ExpandChunkCells(&(*tensors)[t]);
    std::vector<StoredChunk>& chunks = (*tensors)[t].chunks.mut();
    for (size_t c = 0; c < chunks.size(); ++c) {
      chunks[c].block_crc32c = InlineVector<uint32_t, 2>(checksums.tensors[t].of(c));
    }
  }
  return OkStatus();
}

}  // namespace sp
