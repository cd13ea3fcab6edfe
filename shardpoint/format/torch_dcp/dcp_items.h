// DCP data items that are not plain torch.save archives: stream-transformed items (zstd) and
// chunks stored in safetensors files by torch's HuggingFaceStorageWriter.
//
// Stream transforms: `_StorageInfo.transform_descriptors` lists the transforms applied to an
// item's bytes. torch 2.13 has one, ZStandard (`_extension.ZStandard`, descriptor
// "stream.zstd/1"): the item is one zstd stream, without the content size in its frame header;
// offset/length in `.metadata` describe the compressed bytes. The decompressed bytes are the
// torch.save archive (or BYTE_IO bytes) the item would otherwise be.
//
// Safetensors: HuggingFaceStorageWriter writes ordinary safetensors files whose entries are named
// by FQN and whose "__metadata__" has "DCP_SHARDING_INFO" = JSON {fqn: {"saved_offsets": [...]}}
// giving each chunk's offsets in the global tensor. No `.metadata` is written; the item offsets
// it records in memory are not usable, so the data is located through the safetensors header.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_ITEMS_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_ITEMS_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/geometry/box.h"

namespace sp::torch_dcp {

inline constexpr char kZstdTransformDescriptor[] = "stream.zstd/1";

// Undoes the transforms `descriptors` lists on an item's stored bytes. No descriptors: the bytes
// are returned as they are. One "stream.zstd/<1.x>": zstd-decompressed, refusing output larger
// than `max_decoded_bytes` (kResourceExhausted) and corrupt or truncated streams (kDataLoss).
// Unknown or several descriptors: kUnimplemented. `what` names the item in messages.
Result<std::string> DecodeTransformedItem(std::span<const std::string> descriptors, ByteView stored,
                                          uint64_t max_decoded_bytes, std::string_view what);

// Compresses `raw` as one zstd stream, as torch's ZStandard extension does (level 3, no content
// size in the frame header), so that the result decodes with DecodeTransformedItem.
Result<std::string> EncodeZstdItem(ByteView raw, int level = 3);

// One chunk stored in a DCP safetensors file.
struct DcpSafetensorsChunk {
  std::string fqn;
  DType dtype = DType::kFloat32;
  Box box;                   // offsets from DCP_SHARDING_INFO (zeros when absent), sizes = shape
  uint64_t data_offset = 0;  // byte offset of the row-major data in the file
  uint64_t data_bytes = 0;
};

// The chunks of a safetensors file written by HuggingFaceStorageWriter (or any safetensors file:
// without DCP_SHARDING_INFO every entry is a whole tensor at offset zero). kDataLoss naming
// `path` when DCP_SHARDING_INFO is not valid JSON of the expected shape or names an unknown
// entry or gives offsets of another rank.
Result<std::vector<DcpSafetensorsChunk>> DcpSafetensorsChunks(const SafetensorsHeader& header,
                                                              std::string_view path);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_ITEMS_H_
