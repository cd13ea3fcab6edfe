// A PyTorch DCP checkpoint directory as a CheckpointMetadata (the read side of the torch-dcp
// driver), and the pieces the save engine uses to write one.
//
// Reading: `.metadata` is decoded by the restricted unpickler (dcp_metadata.h); then every tensor
// item is located: the torch.save archive of each chunk is parsed (ZIP directory, data.pkl, the
// storage record's local header: a few small reads per item, spread over a thread pool) so that
// a chunk whose storage is the whole tensor in row-major order becomes a kRaw chunk pointing
// straight at its bytes, which loads then read in part like any native chunk. Items stored
// otherwise (non-contiguous strides, a storage larger than the view, zstd-compressed) become
// kDriverDecoded chunks, read whole and turned into row-major bytes by DecodeDcpChunk.
// Non-tensor items (BYTE_IO) are located, not read: each becomes an ObjectEntry with `stored` set
// (dcp_objects.h); ReadObjectPayloads (format/open_checkpoint.h) reads the ones a consumer needs,
// where the restricted torch.save reader makes plain data an ObjectEncoding::kPlain payload and
// anything else a kTorchSave one holding the archive as is (ObjectFromTorchSaveItem in
// torch_save.h); no code is ever run. DCP's planner_data (the nested state-dict paths) becomes
// the "python.state_dict_paths" attribute the Python package reads for native checkpoints.
//
// Writing: DcpFileName names data files as torch does; BuildDcpMetadataFile turns the metadata
// of a save (with DCP item offsets) into `.metadata` bytes. Thread-safe; no global state.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_H_

#include <string>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp::torch_dcp {

// Attribute holding the nested state-dict paths as JSON [[key, [component, ...]], ...].
inline constexpr char kStateDictPathsAttribute[] = "python.state_dict_paths";

// driver_tag values of kDriverDecoded DCP chunks and of stored DCP objects.
inline constexpr uint32_t kDcpItemPlain = 0;  // a torch.save archive stored as is
inline constexpr uint32_t kDcpItemZstd = 1;   // a zstd stream of one ("stream.zstd/1")

// Decodes the DCP checkpoint at `path` (`.metadata` must exist). Errors are kDataLoss naming the
// file and the key: an item that lies outside its file, an archive whose dtype or shape differs
// from `.metadata`, a damaged archive; kUnimplemented for valid features shardpoint cannot read.
Result<CheckpointMetadata> ReadDcpCheckpoint(Store& store, std::string_view path, ThreadPool* pool);

// Turns a kDriverDecoded DCP chunk's stored bytes into chunk.byte_length row-major bytes.
Status DecodeDcpChunk(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                      const StoredChunk& chunk, ByteView stored, std::byte* out);

// "__<rank>_<index><suffix>.distcp".
std::string DcpFileName(int rank, int index, std::string_view suffix = "");

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_H_
