// The hf-safetensors driver: a Hugging Face safetensors checkpoint read as a CheckpointMetadata.
//
// Layouts it reads (PATH is what the caller names):
//  - a directory with `model.safetensors.index.json`: the files its weight_map names. The index
//    is checked against the headers: every key it lists is in the file it names, and every tensor
//    of those files is listed (under that file);
//  - a directory without an index: every `*.safetensors` file directly inside it (hidden files and
//    subdirectories are ignored). A tensor name in two files is an error naming both;
//  - one `.safetensors` file: PATH itself. Its one DataFile has an empty name, which resolves to
//    PATH (JoinPath(PATH, "") == PATH);
//  - PyTorch DCP's Hugging Face layout (HuggingFaceStorageWriter): files whose `__metadata__`
//    holds `DCP_SHARDING_INFO`, JSON text {fqn: {"saved_offsets": [...]}} giving the global
//    offsets of each tensor stored in the file. The same fqn in several such files is several
//    chunks of one tensor whose global shape is the element-wise maximum of offsets + sizes.
//
// Every tensor entry becomes one raw chunk (ChunkEncoding::kRaw) covering the entry's box, with
// data_offset = the entry's begin; DataFile::data_start is 8 + the header length. The result has
// format kSafetensors and checksum_block_bytes 0 (the format stores no checksums). Chunk overlaps
// and holes (possible in the DCP layout when a file is missing) are left for Verify and the load
// planner to report.
//
// Headers are hostile input: they are parsed by the safetensors codec (docs/FORMAT.md §2.1), and the
// index and the sharding info are size-capped and checked. Errors are kDataLoss naming the file and
// the tensor; kNotFound when PATH holds no safetensors checkpoint, or holds data files of a
// native shardpoint save that was never committed (they are never loaded). Thread-safe (no shared state);
// headers are read in parallel on `pool` when one is given.
#ifndef SHARDPOINT_FORMAT_SAFETENSORS_HF_DIRECTORY_H_
#define SHARDPOINT_FORMAT_SAFETENSORS_HF_DIRECTORY_H_

#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

inline constexpr char kSafetensorsIndexFileName[] = "model.safetensors.index.json";
inline constexpr char kSafetensorsSuffix[] = ".safetensors";
// The `__metadata__` key under which PyTorch DCP records each tensor's global offsets.
inline constexpr char kDcpShardingInfoKey[] = "DCP_SHARDING_INFO";
// Largest index file read (real ones are a few MiB).
inline constexpr uint64_t kMaxSafetensorsIndexBytes = uint64_t{256} << 20;

// True when PATH is a file whose name ends in ".safetensors", or a directory holding
// model.safetensors.index.json or at least one *.safetensors file. Reads no file contents.
// kNotFound when nothing is at PATH; other store errors as they come.
Result<bool> LooksLikeSafetensorsCheckpoint(Store& store, std::string_view path);

// Reads the headers (and the index, when there is one) of the checkpoint at PATH and returns its
// metadata. `pool` may be null (headers read one by one).
Result<CheckpointMetadata> ReadSafetensorsDirectory(Store& store, std::string_view path,
                                                    ThreadPool* pool = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_SAFETENSORS_HF_DIRECTORY_H_
