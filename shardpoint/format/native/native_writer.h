// The write side of the native format (docs/FORMAT.md): the CheckpointWriter (format/writer.h)
// that the save engine uses for CheckpointFormat::kNative.
//
// Data files are named d-<save_id>-r<rank:05>-f<k:03>.safetensors; each starts with the
// safetensors header BuildDataFileHeader gives (its length is the file's data_start), followed by
// the chunks at the offsets the plan chose. Every chunk is written straight from the caller's
// memory in pieces, the CRC32C of each checksum block computed on the way and reported to the
// coordinator, which puts them in `shardpoint.metadata` (EncodeMetadata) at commit.
#ifndef SHARDPOINT_FORMAT_NATIVE_NATIVE_WRITER_H_
#define SHARDPOINT_FORMAT_NATIVE_NATIVE_WRITER_H_

#include <memory>

#include "shardpoint/format/writer.h"

namespace sp {

std::unique_ptr<CheckpointWriter> MakeNativeWriter();

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_NATIVE_NATIVE_WRITER_H_
