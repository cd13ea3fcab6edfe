// Tensor and object records of the native metadata file (docs/FORMAT.md §3.5-3.6).
#include "shardpoint/base/coding.h"
#include "shardpoint/format/native/metadata_sections.h"

namespace sp::native_metadata {
namespace {

uint64_t ExpectedBlockCount(uint64_t byte_length, uint64_t block_bytes) {
  return byte_length == 0 ? 0 : (byte_length - 1) / block_bytes + 1;
}

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

// Reads one chunk's box, checks it lies in `shape`, and returns its volume.
Result<uint64_t> DecodeBox(ByteReader& r, const Shape& shape, std::string_view where,
                           std::string_view path, Box* box) {
  box->offsets.resize(shape.size());
  box->sizes.resize(shape.size());
  for (int64_t& v : box->offsets) {
    SP_ASSIGN_OR_RETURN(v, r.ReadI64());
  }
  for (int64_t& v : box->sizes) {
    SP_ASSIGN_OR_RETURN(v, r.ReadI64());
  }
  uint64_t volume = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t offset = box->offsets[d];
    int64_t size = box->sizes[d];
    if (size < 0 || size > shape[d] || offset < 0 || offset > shape[d] - size) {
      return Corrupt(path, std::string(where) + ": dimension " + std::to_string(d) + " [" +
                               std::to_string(offset) + ", +" + std::to_string(size) +
                               ") lies outside the shape " + ShapeToString(shape));
    }
    volume *= static_cast<uint64_t>(size);  // each size <= its dimension: no overflow
  }
  return volume;
}

Status CheckChunkBytes(const StoredChunk& chunk, uint64_t expected_bytes,
                       const CheckpointMetadata& summary, std::string_view where,
                       std::string_view path) {
  if (chunk.byte_length != expected_bytes) {
    return Corrupt(path, std::string(where) + ": byte length " +
                             std::to_string(chunk.byte_length) + ", expected " +
                             std::to_string(expected_bytes) + " for box " + chunk.box.ToString());
  }
  if (chunk.file >= summary.files.size()) {
    return Corrupt(path, std::string(where) + ": file index " + std::to_string(chunk.file) +
                             " is out of range (" + std::to_string(summary.files.size()) +
                             " files)");
  }
  const DataFile& file = summary.files[chunk.file];
  uint64_t data_bytes = file.size - file.data_start;
  if (chunk.data_offset > data_bytes || chunk.byte_length > data_bytes - chunk.data_offset) {
    return Corrupt(path, std::string(where) + ": bytes [" + std::to_string(chunk.data_offset) +
                             ", +" + std::to_string(chunk.byte_length) + ") lie outside the " +
                             std::to_string(data_bytes) + " data bytes of " + file.name);
  }
  return OkStatus();
}

Status DecodeChunk(ByteReader& r, const TensorMetadata& tensor, const CheckpointMetadata& summary,
                   std::string_view where, std::string_view path, StoredChunk* chunk,
                   uint64_t* volume) {
  SP_ASSIGN_OR_RETURN(chunk->file, r.ReadU32());
  SP_ASSIGN_OR_RETURN(chunk->data_offset, r.ReadU64());
  SP_ASSIGN_OR_RETURN(chunk->byte_length, r.ReadU64());
  SP_ASSIGN_OR_RETURN(*volume, DecodeBox(r, tensor.shape, where, path, &chunk->box));
  SP_RETURN_IF_ERROR(
      CheckChunkBytes(*chunk, *volume * DTypeSize(tensor.dtype), summary, where, path));
  SP_ASSIGN_OR_RETURN(uint32_t block_count, r.ReadCount(4));
  uint64_t expected = ExpectedBlockCount(chunk->byte_length, summary.checksum_block_bytes);
  if (block_count != expected) {
    return Corrupt(path, std::string(where) + ": " + std::to_string(block_count) +
                             " block checksums, expected " + std::to_string(expected));
  }
  chunk->block_crc32c.resize(block_count);
  for (uint32_t& crc : chunk->block_crc32c) {
    SP_ASSIGN_OR_RETURN(crc, r.ReadU32());
  }
  return OkStatus();
}

}  // namespace

std::string EncodeTensorRecord(const TensorMetadata& tensor) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(DTypeCode(tensor.dtype));
  w.PutU8(static_cast<uint8_t>(tensor.shape.size()));
  for (int64_t dim : tensor.shape) w.PutI64(dim);
  w.PutU32(static_cast<uint32_t>(tensor.chunks.size()));
  for (const StoredChunk& chunk : tensor.chunks) {
    w.PutU32(chunk.file);
    w.PutU64(chunk.data_offset);
    w.PutU64(chunk.byte_length);
    for (int64_t v : chunk.box.offsets) w.PutI64(v);
    for (int64_t v : chunk.box.sizes) w.PutI64(v);
    w.PutU32(static_cast<uint32_t>(chunk.block_crc32c.size()));
    for (uint32_t crc : chunk.block_crc32c) w.PutU32(crc);
  }
  return out;
}

Result<TensorMetadata> DecodeTensorRecord(std::string_view bytes, std::string name,
                                          const CheckpointMetadata& summary, bool newer_minor,
                                          std::string_view path) {
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
  SP_ASSIGN_OR_RETURN(uint32_t chunk_count, r.ReadCount(4 + 8 + 8 + 16 * rank + 4));
  if (chunk_count > kMaxChunks) return Corrupt(path, where + ": too many chunks");
  tensor.chunks.resize(chunk_count);
  const uint64_t shape_volume = static_cast<uint64_t>(ShapeVolume(tensor.shape));
  uint64_t covered = 0;
  for (uint32_t i = 0; i < chunk_count && covered <= shape_volume; ++i) {
    uint64_t volume = 0;
    SP_RETURN_IF_ERROR(DecodeChunk(r, tensor, summary, where + " chunk " + std::to_string(i),
                                   path, &tensor.chunks[i], &volume));
    covered += volume;  // both terms <= 2^62 here: no overflow
  }
  if (covered != shape_volume) {
    return Corrupt(path, where + ": chunks hold " + std::to_string(covered) +
                             " elements, the shape " + ShapeToString(tensor.shape) + " has " +
                             std::to_string(ShapeVolume(tensor.shape)));
  }
  if (!r.done() && !newer_minor) {
    return Corrupt(path, where + ": " + std::to_string(r.remaining()) + " unexpected bytes");
  }
  return tensor;
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
