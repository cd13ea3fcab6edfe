// Opening a checkpoint of any format shardpoint reads.
//
// One place picks the format driver by what is on disk (docs/DESIGN.md decision 11: no registration
// by static initializers): a native checkpoint has `shardpoint.metadata`; every format decodes into
// the same CheckpointMetadata, so planning, loading, verifying and inspecting are format-blind.
// Chunks of foreign formats that are not plain row-major bytes (ChunkEncoding::kDriverDecoded) are
// turned into row-major bytes by DecodeStoredChunk. Stateless and thread-safe.
#ifndef SHARDPOINT_FORMAT_OPEN_CHECKPOINT_H_
#define SHARDPOINT_FORMAT_OPEN_CHECKPOINT_H_

#include <span>
#include <string_view>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

// The name of a format as users write it: "native", "torch-dcp", "safetensors".
std::string_view CheckpointFormatName(CheckpointFormat format);
// Parses such a name; kInvalidArgument naming the accepted names otherwise.
Result<CheckpointFormat> ParseCheckpointFormat(std::string_view name);

// Which format the checkpoint at `path` is in, judged by its files. kNotFound ("no committed
// checkpoint at PATH ...") when it holds none of them.
Result<CheckpointFormat> DetectCheckpointFormat(Store& store, std::string_view path);

// Decodes the metadata of the checkpoint at `path`, whatever its format. Drivers that must read
// data files to locate chunks spread those reads over `pool` (may be null: one thread).
// Every tensor then passes ValidateCheckpointSizes (metadata.h), whatever the format, so shapes,
// chunk boxes and byte lengths are within the shared limits (kDataLoss naming the tensor and the
// file otherwise). Errors name the file and what is wrong with it; kNotFound when there is no
// checkpoint.
Result<CheckpointMetadata> OpenCheckpointMetadata(Store& store, std::string_view path,
                                                  ThreadPool* pool);

// The two halves of OpenCheckpointMetadata for a native checkpoint, which a load's coordinator
// splits: it reads the metadata file (ReadNativeMetadataFile: `prefix` followed by the file's
// bytes as stored, in one buffer; kNotFound as above when it is missing) and hands the bytes to
// its ranks, and every rank decodes them (DecodeNativeCheckpointMetadata: DecodeMetadata, then
// the checks and the grids and indexes of OpenCheckpointMetadata; `path` is the checkpoint's
// directory, and messages name its metadata file). The two give what OpenCheckpointMetadata
// gives.
Result<std::string> ReadNativeMetadataFile(Store& store, std::string_view path,
                                           std::string_view prefix = {});
// With `filter`, the result holds only the chunks it keeps (DecodeMetadata in
// format/native/metadata_codec.h), and the same bytes give the same error as without it.
Result<CheckpointMetadata> DecodeNativeCheckpointMetadata(std::string_view bytes,
                                                          std::string_view path,
                                                          ThreadPool* pool,
                                                          const ChunkFilter* filter = nullptr);

// Turns the stored bytes of a kDriverDecoded chunk (`stored`, chunk.stored_length bytes read
// from its data_offset) into chunk.byte_length row-major bytes at `out`. Errors name the tensor,
// the chunk and the file.
Status DecodeStoredChunk(const CheckpointMetadata& metadata, const TensorMetadata& tensor,
                         const StoredChunk& chunk, ByteView stored, std::byte* out);

// Reads the payloads of the entries of `objects` that are still stored (ObjectEntry::stored: the
// PyTorch DCP driver opens checkpoints without reading object items); entries that have their
// payload are left as they are. `metadata` is the checkpoint's at `path`; only its format and
// files are read, so `objects` may be metadata.objects itself or copies of its entries. Several
// entries that point at one stored item read and decode it once. On success no entry is stored.
// Errors name the object, the file and the sizes: kResourceExhausted past `limits` (one object
// decoding past max_object_bytes, or the payloads handed out past max_total_bytes together),
// kDataLoss for damaged items; entries may then be partly read.
Status ReadObjectPayloads(Store& store, std::string_view path, const CheckpointMetadata& metadata,
                          std::span<ObjectEntry> objects, const ObjectReadLimits& limits = {});

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_OPEN_CHECKPOINT_H_
