// The wire encoding of a CheckpointMetadata, for sending a decoded checkpoint from one rank to the
// others (the coordinator opens the checkpoint once, whatever its format, and every rank gets the
// same model). Not an on-disk format: both ends run the same build. Every field of the model is
// carried, so Decode(Encode(m)) == m, grids included (TensorMetadata::grid); a tensor with a grid
// travels as its cut points and one placement per cell, without boxes. Decoding is bounds-checked
// and refuses trailing bytes.
#ifndef SHARDPOINT_FORMAT_METADATA_WIRE_H_
#define SHARDPOINT_FORMAT_METADATA_WIRE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// Each tensor travels behind its byte length, so that a receiver decodes the tensors in parallel.
// The output is reserved to WireMetadataBound first and never grows past it.
std::string EncodeMetadataForWire(const CheckpointMetadata& metadata);
// At least the bytes of EncodeMetadataForWire(metadata), counted from its sizes in one pass.
uint64_t WireMetadataBound(const CheckpointMetadata& metadata);
// kDataLoss naming the byte offset when `bytes` is not a complete encoding. The tensors are
// decoded on `pool` (null: on the calling thread), with the same result, or the same error (the
// first bad tensor's, by position), as without one. With `filter`, each tensor keeps only the
// chunks the filter reaches (TensorMetadata::kept; a load rank's part), and every chunk is
// decoded and checked as without it, with the same error for the same bytes.
Result<CheckpointMetadata> DecodeMetadataFromWire(std::string_view bytes,
                                                  ThreadPool* pool = nullptr,
                                                  const ChunkFilter* filter = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_METADATA_WIRE_H_
