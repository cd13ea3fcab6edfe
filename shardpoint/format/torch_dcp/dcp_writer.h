// The write side of the torch-dcp driver: how the save engine lays out and frames a PyTorch DCP
// checkpoint that torch.distributed.checkpoint.load reads.
//
// A save plans chunks exactly as for the native format; then LayoutDcpFiles turns every chunk
// into one DCP tensor item (a torch.save archive of the chunk) in `__<rank>_<k>.distcp` files.
// The chunk's bytes still go straight from the caller's memory to data_offset; the writing rank
// adds the framing around them (ItemHead before, ItemTail after, the latter once the CRC-32 of
// the bytes is known). Objects become BYTE_IO items in one more file that the coordinator writes
// at commit, and BuildDcpMetadataFile produces `.metadata`. Pure functions; thread-safe.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_WRITER_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

// The torch.save archive layout of one chunk's item.
Result<torch_save::TorchSaveLayout> ChunkItemLayout(DType dtype, const Box& box);

// Renames md's data files to "__<writer_rank>_<k><name_suffix>.distcp" and lays each one out as a
// sequence of items, one per chunk in the order of their data_offset: sets each chunk's
// data_offset to where its bytes go, each file's data_start to 0 and size to the sum of its
// items. torch names files "__<rank>_<k>.distcp" (empty suffix); a save that replaces a committed
// DCP checkpoint must not reuse its names (its files are renamed into place before the commit),
// so it passes a suffix unique to the save, e.g. "-<save_id>"; torch reads any name .metadata gives.
Status LayoutDcpFiles(CheckpointMetadata* md, std::string_view name_suffix = "");

struct DcpObjectItem {
  std::string name;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct DcpObjectFile {
  std::string name;               // "__<rank>_<k>.distcp", after the data files of `rank`
  std::string bytes;              // the items, back to back
  std::vector<DcpObjectItem> items;
};

// The BYTE_IO items of md's objects, written by the coordinator `rank` to a file named like the
// data files (with the same `name_suffix`): JSON values become
// torch.save archives of the same Python values, bytes a torch.save of bytes, pickled objects an
// archive around their pickle, torch-save payloads stay as they are. An empty dict gets no item
// (as in torch's own checkpoints). kInvalidArgument naming the object when its JSON cannot be
// represented (an integer beyond 64 bits among them).
Result<DcpObjectFile> BuildDcpObjectFile(const CheckpointMetadata& md, int rank,
                                         std::string_view name_suffix = "");

// `.metadata` for md (laid out by LayoutDcpFiles) and its objects. planner_data comes from the
// "python.state_dict_paths" attribute when present, else each key is its own one-element path.
Result<std::string> BuildDcpMetadataFile(const CheckpointMetadata& md, const DcpObjectFile& objects,
                                         std::string_view checkpoint_id);

// Megatron-Core's common.pt (megatron.h) holding md's objects: each the torch.save archive its
// BYTE_IO item would be, placed at its nested path from "python.state_dict_paths" (empty dicts
// included). A Megatron save writes this instead of BYTE_IO items. kInvalidArgument naming the
// object when it cannot be represented.
Result<std::string> BuildMegatronCommonFile(const CheckpointMetadata& md);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_WRITER_H_
