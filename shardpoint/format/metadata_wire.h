// The wire encoding of a CheckpointMetadata, for sending a decoded checkpoint from one rank to the
// others (the coordinator of a load opens the checkpoint once, whatever its format, and sends
// every rank the same model, or each rank its part of it). Not an on-disk format: both ends run
// the same build. Every field of the model is carried, so Decode(Encode(m)) == m, grids included
// (TensorMetadata::grid); a tensor with a grid travels as its cut points and one placement per
// cell, without boxes. Numbers travel as varints, a chunk's file and offset as their steps from
// the chunk before, and the tensors' names as one table in which each name gives only what it
// does not share with the name before it. Decoding is bounds-checked and refuses trailing bytes.
#ifndef SHARDPOINT_FORMAT_METADATA_WIRE_H_
#define SHARDPOINT_FORMAT_METADATA_WIRE_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// Each tensor travels behind its byte length, so that a receiver decodes the tensors in parallel.
// The output is reserved to WireMetadataBound first and never grows past it.
std::string EncodeMetadataForWire(const CheckpointMetadata& metadata);
// At least the bytes of EncodeMetadataForWire(metadata), counted from its sizes in one pass.
uint64_t WireMetadataBound(const CheckpointMetadata& metadata);
// A load rank's part of `metadata` (which holds every chunk): every tensor's name, dtype and shape,
// and only the chunks `filter` keeps (ChunkFilter), found through grids and indexes; the data
// files those chunks and the stored objects name (the others travel as their count alone); the
// objects and attributes whole. DecodeMetadataFromWire gives what it gives for the whole
// encoding with `filter`, but that the files not named are left without a name.
// A tensor whose chunks are all kept travels whole.
std::string EncodeMetadataPartForWire(const CheckpointMetadata& metadata,
                                      const ChunkFilter& filter);

namespace wire_internal {
struct CellsAs;     // how a tensor's chunks travel (metadata_wire.cc)
struct ReadyParts;  // a tensor's parts encoded once (metadata_wire.cc)
}  // namespace wire_internal

// A ChunkFilter as the coordinator of a load takes it from a rank's request: its names in one
// buffer and its boxes in one array, in name order, so that a request of a thousand tensors is
// decoded into a few allocations instead of a map with a name and a vector per tensor
// (DecodeChunkFilterList; the coordinator decodes one for every rank).
class ChunkFilterList {
 public:
  size_t size() const { return name_ends_.size(); }
  std::string_view name(size_t i) const {
    const size_t begin = i == 0 ? 0 : name_ends_[i - 1];
    return std::string_view(names_).substr(begin, name_ends_[i] - begin);
  }
  std::span<const Box> boxes(size_t i) const {
    const size_t begin = i == 0 ? 0 : box_ends_[i - 1];
    return std::span<const Box>(boxes_).subspan(begin, box_ends_[i] - begin);
  }

 private:
  friend Result<ChunkFilterList> DecodeChunkFilterList(std::string_view bytes,
                                                       std::string_view what);
  std::string names_;
  std::vector<size_t> name_ends_;
  std::vector<Box> boxes_;
  std::vector<size_t> box_ends_;
};

// Encodes parts of one metadata for many ranks, each as EncodeMetadataPartForWire does. What the
// parts share is found once, when it is made, tensor by tensor on `pool` (whether a tensor's
// chunks travel as a grid, with raw cells, and its cut points; each tensor without its chunks,
// and a tensor of few chunks whole and with each chunk alone): a part then costs the chunks it
// holds and a look at every tensor's header, not a pass over every chunk. Encode may be called
// from several threads at once. `metadata` must outlive it and stay unchanged.
class MetadataPartEncoder {
 public:
  explicit MetadataPartEncoder(const CheckpointMetadata& metadata, ThreadPool* pool = nullptr);
  ~MetadataPartEncoder();
  MetadataPartEncoder(const MetadataPartEncoder&) = delete;
  MetadataPartEncoder& operator=(const MetadataPartEncoder&) = delete;

  std::string Encode(const ChunkFilter& filter) const;
  // The same part, appended to `out`.
  void EncodeTo(const ChunkFilterList& filter, std::string* out) const;
  const CheckpointMetadata& metadata() const { return metadata_; }

 private:
  // The part whose boxes of metadata_.tensors[t] are boxes[t], appended to `out`.
  void EncodeBoxes(std::span<const std::span<const Box>> boxes, std::string* out) const;

  const CheckpointMetadata& metadata_;
  std::vector<wire_internal::CellsAs> how_;
  std::vector<wire_internal::ReadyParts> ready_;
  std::string names_;  // every tensor's name, as every part sends them
  // Whether the tensors are sorted by name with no name twice, as CheckpointMetadata promises: a
  // filter is then walked beside them, else each tensor is looked up in it (metadata received
  // from the wire is not checked for order).
  bool names_sorted_ = true;
};

// A ChunkFilter on the wire (what a load rank asks the coordinator for), and back: kDataLoss
// naming `what` and the byte offset for bytes that are not one (truncated, trailing bytes, names
// out of order, a box whose offsets and sizes differ in rank).
std::string EncodeChunkFilter(const ChunkFilter& filter);
Result<ChunkFilter> DecodeChunkFilter(std::string_view bytes, std::string_view what);
// The same bytes as a ChunkFilterList, with the same errors.
Result<ChunkFilterList> DecodeChunkFilterList(std::string_view bytes, std::string_view what);

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
