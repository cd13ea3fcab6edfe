#include "shardpoint/format/metadata.h"

#include <algorithm>

#include "shardpoint/exec/task_group.h"

namespace sp {

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

// The chunk's stored bytes [data_start + data_offset, +length) lie inside its file's size.
Status CheckChunkInFile(const DataFile& file, const StoredChunk& c, std::string_view where) {
  const uint64_t length = c.encoding == ChunkEncoding::kRaw ? c.byte_length : c.stored_length;
  uint64_t begin = 0;
  uint64_t end = 0;
  if (__builtin_add_overflow(file.data_start, c.data_offset, &begin) ||
      __builtin_add_overflow(begin, length, &end) || end > file.size) {
    return DataLossError(std::string(where) + ": bytes [" + std::to_string(c.data_offset) + ", +" +
                         std::to_string(length) + ") after the data start " +
                         std::to_string(file.data_start) + " lie outside the file's " +
                         std::to_string(file.size) + " bytes");
  }
  return OkStatus();
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
  if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) {
    return DataLossError(std::string(where) + ": box " + box.ToString() + " has another rank than the shape " +
                         ShapeToString(shape));
  }
  uint64_t volume = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t offset = box.offsets[d];
    const int64_t size = box.sizes[d];
    if (offset < 0 || size < 0 || size > shape[d] || offset > shape[d] - size) {
      return DataLossError(std::string(where) + ": dimension " + std::to_string(d) + " [" +
                           std::to_string(offset) + ", +" + std::to_string(size) +
                           ") lies outside the shape " + ShapeToString(shape));
    }
    volume *= static_cast<uint64_t>(size);  // each prefix <= the shape's prefix <= 2^62
  }
  return volume;
}

namespace {

// Whether chunk `c` of `tensor` (whose shape passed CheckedTensorBytes) passes every check of
// ValidateTensorSizes below. The checks that name what failed run only for a chunk that does not:
// their message names the chunk's box and file, and building it for each of millions of chunks
// cost more than the checks.
bool ChunkSizesHold(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                    const StoredChunk& c) {
  const size_t rank = tensor.shape.size();
  if (c.file >= metadata.files.size() || c.box.offsets.size() != rank ||
      c.box.sizes.size() != rank) {
    return false;
  }
  uint64_t volume = 1;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t offset = c.box.offsets[d];
    const int64_t size = c.box.sizes[d];
    if (offset < 0 || size < 0 || size > tensor.shape[d] || offset > tensor.shape[d] - size) {
      return false;
    }
    volume *= static_cast<uint64_t>(size);  // each prefix <= the shape's prefix <= 2^62
  }
  if (c.byte_length != volume * DTypeSize(tensor.dtype)) return false;
  const DataFile& file = metadata.files[c.file];
  const uint64_t length = c.encoding == ChunkEncoding::kRaw ? c.byte_length : c.stored_length;
  uint64_t begin = 0;
  uint64_t end = 0;
  return !__builtin_add_overflow(file.data_start, c.data_offset, &begin) &&
         !__builtin_add_overflow(begin, length, &end) && end <= file.size;
}

}  // namespace

Status ValidateTensorSizes(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                           std::string_view source) {
  const std::string where = std::string(source) + ": tensor '" + tensor.name + "'";
  SP_RETURN_IF_ERROR(CheckedTensorBytes(tensor.dtype, tensor.shape, where).status());
  for (const StoredChunk& c : tensor.chunks) {
    if (ChunkSizesHold(metadata, tensor, c)) continue;
    const std::string chunk_where = ChunkWhere(metadata, tensor, c, source);
    if (c.file >= metadata.files.size()) {
      return DataLossError(chunk_where + ": file index " + std::to_string(c.file) +
                           " is out of range (" + std::to_string(metadata.files.size()) + " files)");
    }
    SP_ASSIGN_OR_RETURN(uint64_t volume, CheckedBoxVolume(c.box, tensor.shape, chunk_where));
    const uint64_t expected = volume * DTypeSize(tensor.dtype);  // <= 2^62: the shape passed
    if (c.byte_length != expected) {
      return DataLossError(chunk_where + ": byte length " + std::to_string(c.byte_length) +
                           ", expected " + std::to_string(expected) + " (" +
                           std::to_string(volume) + " elements of " +
                           std::string(DTypeName(tensor.dtype)) + ")");
    }
    SP_RETURN_IF_ERROR(CheckChunkInFile(metadata.files[c.file], c, chunk_where));
    return InternalError(chunk_where + ": refused by the quick checks, passed by the others");
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
    const std::vector<StoredChunk>& chunks = tensors[t].chunks;
    ChunkChecksums::Tensor& table = checksums.tensors[t];
    table.starts.resize(chunks.size() + 1);
    uint64_t blocks = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      table.starts[c] = blocks;
      blocks += ChecksumBlockCount(chunks[c].byte_length, block_bytes);
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
    if (checksums.tensors[t].starts.size() != tensors[t].chunks.size() + 1) {
      return InternalError("the checksums of tensor '" + tensors[t].name + "' are for " +
                           std::to_string(checksums.tensors[t].starts.size()) +
                           " chunk boundaries, not " +
                           std::to_string(tensors[t].chunks.size() + 1));
    }
  }
  return OkStatus();
}

Status FillChecksums(const ChunkChecksums& checksums, std::vector<TensorMetadata>* tensors) {
  SP_RETURN_IF_ERROR(CheckChecksumsFit(*tensors, checksums));
  for (size_t t = 0; t < tensors->size(); ++t) {
    std::vector<StoredChunk>& chunks = (*tensors)[t].chunks;
    for (size_t c = 0; c < chunks.size(); ++c) {
      chunks[c].block_crc32c = InlineVector<uint32_t, 2>(checksums.tensors[t].of(c));
    }
  }
  return OkStatus();
}

}  // namespace sp
