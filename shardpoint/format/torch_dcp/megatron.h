// Megatron-Core `torch_dist` checkpoints: the two files megatron-core adds to a PyTorch DCP
// checkpoint, read and written without running code (docs/TORCH_DCP.md §6).
//
// `megatron.core.dist_checkpointing.save` with the default `torch_dist` backend writes a DCP
// checkpoint (tensors as DCP chunks; `.metadata` also carries `all_local_plans`, which
// dcp_metadata.cc accepts) plus:
//  - `metadata.json`: {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
//    "common_backend": "torch", "common_backend_version": 1}. megatron-core treats a directory
//    without it as "not a distributed checkpoint".
//  - `common.pt`: torch.save of a dict, the state dict's values that are not sharded (iteration,
//    args, plain settings, nested dicts of them).
//
// Reading: DecodeMegatronCommon flattens common.pt's dict the way the Python package flattens a
// state dict (python/shardpoint/_flatten.py: non-empty dicts walked by str key; lists and tuples
// walked by index when they hold a dict or a tensor at some depth) and turns every leaf into a
// standalone torch.save archive: plain data through EncodePlainObjectItem, anything else (an
// argparse.Namespace, a tensor, a set) re-emitted from the inert pickle tree, with the storage
// records it refers to copied along. Globals are recorded, never called; loading such an archive
// is the caller's decision (ObjectEncoding::kTorchSave needs allow_pickle in Python).
//
// Writing: EncodeMegatronCommon builds common.pt from torch.save archives of the objects (one per
// object) and their nested paths, re-emitting each archive's pickle into one dict (storages
// renumbered); torch.load(weights_only=True) reads it when the objects are plain data or tensors.
//
// Every decoder treats its bytes as hostile: size caps, bounded recursion and node counts, safe
// storage record names. Errors are kDataLoss naming the file (and the key); valid files using
// something not supported (another sharded backend, such as zarr) are kUnimplemented.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/store/store.h"

namespace sp::torch_dcp {

inline constexpr char kMegatronConfigFileName[] = "metadata.json";
inline constexpr char kMegatronCommonFileName[] = "common.pt";
inline constexpr uint64_t kMaxMegatronConfigBytes = uint64_t{1} << 20;
inline constexpr uint64_t kMaxMegatronCommonBytes = uint64_t{1} << 30;
// Most pickle values one re-emitted archive may hold (shared subtrees count once per use).
inline constexpr uint64_t kMaxReemittedValues = uint64_t{1} << 22;
// The list positions of common.pt that no object fills (None, as Python pads a list) are at most
// kCommonPaddingBase plus kCommonPaddingPerStep per step of the objects' paths: a path names its
// list positions by number, so without a bound a few bytes of paths would ask for millions of
// placeholders (found by fuzz/objects_fuzz.cc).
inline constexpr uint64_t kCommonPaddingBase = uint64_t{1} << 16;
inline constexpr uint64_t kCommonPaddingPerStep = 16;
// The keys of common.pt's objects (each object's dotted name, kept twice, and its path, counted
// at 32 bytes a step plus its strings) are at most kCommonKeyBytesBase plus
// kCommonKeyBytesPerByte per byte of common.pt. A path that many objects share is stored once
// in the archive but spelled out in each of their keys: without a bound, 2 KB of paths asking
// for 15,376 list positions at depth 56 made 15,376 keys of 1 KB each (0.4 GB, found by
// fuzz/objects_fuzz.cc), and a memo-shared key string can repeat at every level of a path.
inline constexpr uint64_t kCommonKeyBytesBase = uint64_t{32} << 20;
inline constexpr uint64_t kCommonKeyBytesPerByte = 8;
// Checkpoint attribute prefix of the metadata.json fields ("megatron.sharded_backend", ...).
inline constexpr char kMegatronAttributePrefix[] = "megatron.";

// metadata.json.
struct MegatronConfig {
  std::string sharded_backend = "torch_dist";
  int64_t sharded_backend_version = 1;
  std::string common_backend = "torch";
  int64_t common_backend_version = 1;

  friend bool operator==(const MegatronConfig&, const MegatronConfig&) = default;
};

// Parses metadata.json (`path` names it in messages). kDataLoss when it is not a JSON object
// with a str sharded_backend (and, when present, int versions and a str common_backend);
// kUnimplemented naming the file and the backend for anything but torch_dist version 1 with
// the torch common backend version 1. Other keys are ignored.
Result<MegatronConfig> ParseMegatronConfig(std::string_view text, std::string_view path);

// The metadata.json megatron-core 0.16 writes for torch_dist.
std::string EncodeMegatronConfig(const MegatronConfig& config = MegatronConfig());

// The fields as checkpoint attributes: megatron.sharded_backend, megatron.sharded_backend_version,
// megatron.common_backend, megatron.common_backend_version.
void AddMegatronConfigAttributes(const MegatronConfig& config, CheckpointMetadata* md);

struct MegatronCommon {
  std::vector<ObjectEntry> objects;    // flattened keys, each a kTorchSave archive; file order
  std::vector<DcpPlannerPath> paths;   // each object's nested path, same order
};

// Decodes common.pt (a torch.save archive of a dict) into flattened objects. kDataLoss naming
// `path` (and the key) for a damaged archive, a root that is not a dict, a non-str dict key,
// nesting deeper than kMaxPickleWalkDepth or more than kMaxReemittedValues values, keys past
// kCommonKeyBytesBase + kCommonKeyBytesPerByte * its size, or a storage record that is missing or
// has an unsafe name.
Result<MegatronCommon> DecodeMegatronCommon(ByteView archive, std::string_view path);

struct MegatronObjectArchive {
  std::string name;
  std::string archive;  // a torch.save archive of the object's value
};

// common.pt holding every object at its nested path (`paths`; an object without one is a
// top-level key). kInvalidArgument naming the object when its archive cannot be read or two
// paths conflict (a value and a container at the same place).
Result<std::string> EncodeMegatronCommon(const std::vector<MegatronObjectArchive>& objects,
                                         const std::vector<DcpPlannerPath>& paths);

// The hook of the DCP reader: when `path` holds metadata.json, validates it (errors as for
// ParseMegatronConfig), adds its fields as attributes, decodes common.pt (kDataLoss when
// missing) and adds its objects to md->objects and their paths to the "python.state_dict_paths"
// attribute. A common.pt key equal to a key of `.metadata` is kDataLoss. Without metadata.json
// nothing is read. md->objects (sorted on entry) stays sorted.
Status AddMegatronFiles(Store& store, std::string_view path, CheckpointMetadata* md);

// Re-emits the value of the torch.save archive `archive` (data.pkl unpickled inertly, every
// global allowed) as a new standalone torch.save archive, copying the storages it refers to.
// Exposed for tests; errors as for DecodeMegatronCommon, naming `what`.
Result<std::string> ReemitTorchSaveArchive(ByteView archive, std::string_view what);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_H_
