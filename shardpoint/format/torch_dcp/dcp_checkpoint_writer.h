// The write side of the torch-dcp format as a CheckpointWriter (format/writer.h): what the save
// engine uses for CheckpointFormat::kTorchDcp, plain or as a Megatron-Core torch_dist checkpoint.
//
// LayOutFiles turns every planned chunk into one DCP tensor item (LayoutDcpFiles, dcp_writer.h)
// in `__<rank>_<k>.distcp` files, which carry the save id when they would otherwise replace the
// files of a committed DCP checkpoint before the new one commits. Each rank writes an item's head,
// then the chunk's bytes straight from the caller's memory in pieces (the CRC-32 of each computed
// on the way), then the item's tail with the combined CRC-32. At commit the coordinator writes
// the objects as BYTE_IO items in one more file (a Megatron save: common.pt and metadata.json
// instead) and returns `.metadata`. DCP checkpoints carry no block checksums
// (checksum_block_bytes 0).
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_WRITER_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_WRITER_H_

#include <memory>

#include "shardpoint/format/writer.h"

namespace sp::torch_dcp {

// kind() "torch-dcp", or "megatron" with `megatron`.
std::unique_ptr<CheckpointWriter> MakeDcpCheckpointWriter(bool megatron);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_CHECKPOINT_WRITER_H_
