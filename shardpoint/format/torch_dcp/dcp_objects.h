// The objects (BYTE_IO items) of a PyTorch DCP checkpoint, read only when they are needed.
//
// Opening a DCP checkpoint records where each object's item lies (DcpObjectEntry) and reads none
// of them: `inspect` and tensor-only loads never touch object items, so a small checkpoint whose
// items are zstd bombs, or whose entries all point at one item, costs nothing to open.
// ReadDcpObjectPayloads reads the items of the entries a consumer asks for (load, convert, diff,
// verify): each stored item once however many entries point at it, zstd items decoded as a
// stream and refused past ObjectReadLimits::max_object_bytes (or from the frame header when it
// declares more), and the payloads handed out capped together by max_total_bytes. Each item
// then becomes a kPlain or kTorchSave payload as ObjectFromTorchSaveItem (torch_save.h) decides;
// no code is ever run. Thread-safe; no global state.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_OBJECTS_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_OBJECTS_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/store/store.h"

namespace sp::torch_dcp {

// The entry for object `name` whose item is `item` in data file `file` (`data_file`, of the
// checkpoint at `path`): encoding kTorchSave, no payload, `stored` set. kDataLoss when the item
// lies outside its file; kUnimplemented for stream transforms other than stream.zstd/1.
Result<ObjectEntry> DcpObjectEntry(std::string name, const DcpStorageEntry& item, uint32_t file,
                                   const DataFile& data_file, std::string_view path);

// Reads and decodes the payloads of the entries of `objects` that are still stored; other entries
// are left as they are. `metadata` is the checkpoint's at `path` (only its files are read, so
// `objects` may be metadata.objects itself). On success every entry has its payload and no
// `stored`. Errors name the object, the file and the item's offset: kResourceExhausted past a
// limit (with the sizes), kDataLoss for a damaged or truncated item or a missing file; entries
// may then be partly read.
Status ReadDcpObjectPayloads(Store& store, std::string_view path, const CheckpointMetadata& metadata,
                             std::span<ObjectEntry> objects, const ObjectReadLimits& limits);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_OBJECTS_H_
