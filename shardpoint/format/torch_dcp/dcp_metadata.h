// The PyTorch DCP `.metadata` file: its model, a validating decoder and an encoder.
//
// `.metadata` is `pickle.dump(torch.distributed.checkpoint.metadata.Metadata)`: for every
// flattened state-dict key either a tensor (dtype, global size, the saved chunks as boxes) or a
// bytes entry (any non-tensor value), the planner's data (for the default planner a dict
// fqn -> path tuple), the storage data (for each chunk or bytes entry: the file, offset and
// length of its item, and the stream transforms applied to it), the storage meta and a version.
// docs/TORCH_DCP.md §2 describes what is read and written.
//
// DecodeDcpMetadata never runs pickle code: it unpickles with DcpMetadataGlobals() and then
// checks everything: known dtypes, chunk boxes inside the global size, no duplicate keys,
// storage entries that name known keys and chunks, sane file names, offsets and lengths, and a
// storage entry for every chunk and bytes entry. Errors are kDataLoss naming the `.metadata` path
// and the key; a valid file using something shardpoint does not support (complex32, sparse
// layouts) is kUnimplemented.
//
// EncodeDcpMetadata writes a protocol-2 pickle that torch 2.13's FileSystemReader.read_metadata
// (plain pickle.load) and dcp.load accept, using only classes present in every torch >= 2.4.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_DCP_METADATA_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_DCP_METADATA_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/geometry/box.h"

namespace sp::torch_dcp {

inline constexpr char kDcpMetadataFileName[] = ".metadata";
inline constexpr char kDcpVersion[] = "1.0.0";  // what torch 2.13 writes
// Largest `.metadata` DecodeDcpMetadata accepts.
inline constexpr uint64_t kMaxDcpMetadataBytes = uint64_t{1} << 30;

// TensorProperties' memory format (torch's _MEM_FORMAT_ENCODING).
enum class DcpMemoryFormat : uint8_t { kContiguous = 0, kChannelsLast = 1, kPreserve = 2 };

struct DcpTensorProperties {
  DType dtype = DType::kFloat32;
  bool requires_grad = false;
  DcpMemoryFormat memory_format = DcpMemoryFormat::kContiguous;
  bool pin_memory = false;  // the layout is always torch.strided (others are refused)

  friend bool operator==(const DcpTensorProperties&, const DcpTensorProperties&) = default;
};

// One state_dict_metadata entry.
struct DcpEntry {
  enum class Kind : uint8_t { kTensor, kBytes };

  std::string fqn;
  Kind kind = Kind::kTensor;
  DcpTensorProperties properties;  // kTensor
  Shape size;                      // kTensor: the global shape
  std::vector<Box> chunks;         // kTensor: saved chunks; list position = chunk index

  friend bool operator==(const DcpEntry&, const DcpEntry&) = default;
};

// One storage_data entry: MetadataIndex -> _StorageInfo.
struct DcpStorageEntry {
  std::string fqn;
  std::optional<std::vector<int64_t>> chunk_offsets;  // tensors: the chunk's offsets; bytes: none
  std::optional<int64_t> index;                       // the chunk index hint, when stored
  std::string relative_path;                          // "__0_0.distcp"
  uint64_t offset = 0;                                // of the item in the file
  uint64_t length = 0;
  std::vector<std::string> transform_descriptors;     // e.g. {"stream.zstd/1"}; usually empty

  friend bool operator==(const DcpStorageEntry&, const DcpStorageEntry&) = default;
};

struct DcpStorageMeta {
  std::optional<std::string> checkpoint_id;  // a pathlib path is joined into one string
  std::optional<std::string> save_id;
  std::optional<std::string> load_id;
  std::vector<std::string> modules;

  friend bool operator==(const DcpStorageMeta&, const DcpStorageMeta&) = default;
};

struct DcpMetadata {
  std::vector<DcpEntry> state_dict_metadata;  // file order; unique fqns
  std::optional<torch_save::PlainValue> planner_data;     // None / absent -> nullopt
  std::vector<DcpStorageEntry> storage_data;  // file order
  std::optional<DcpStorageMeta> storage_meta;
  std::optional<std::string> version;

  const DcpEntry* Find(std::string_view fqn) const;
  // The storage entry of tensor `fqn`'s chunk at `offsets`, or of bytes entry `fqn` (offsets
  // null); null when there is none.
  const DcpStorageEntry* FindStorage(std::string_view fqn,
                                     const std::vector<int64_t>* offsets) const;

  friend bool operator==(const DcpMetadata&, const DcpMetadata&) = default;
};

// Decodes and validates `.metadata` bytes; `path` names the file in every message.
Result<DcpMetadata> DecodeDcpMetadata(ByteView bytes, std::string_view path);

// Encodes `metadata` as a protocol-2 pickle. Checks the same rules as the decoder (so what it
// writes decodes to an equal value, with checkpoint_id written as a str) and returns
// kInvalidArgument naming the key otherwise.
Result<std::string> EncodeDcpMetadata(const DcpMetadata& metadata);

// Checks the rules DecodeDcpMetadata checks on a model: unique keys, chunks inside their tensors,
// storage entries for known keys and chunks only and for every chunk and bytes entry, safe
// relative paths, offsets and lengths that do not overflow. Errors carry `code` and name `path`
// and the key.
Status ValidateDcpMetadata(const DcpMetadata& metadata, std::string_view path,
                           StatusCode code = StatusCode::kInvalidArgument);

// planner_data of torch's DefaultSavePlanner: fqn -> the path of keys (str) and list indexes
// (int) it was flattened from.
struct DcpPlannerPath {
  std::string fqn;
  std::vector<std::variant<std::string, int64_t>> path;

  friend bool operator==(const DcpPlannerPath&, const DcpPlannerPath&) = default;
};
torch_save::PlainValue MakeDcpPlannerData(const std::vector<DcpPlannerPath>& paths);
// kDataLoss when `planner_data` is not a dict of str -> tuple of str / int.
Result<std::vector<DcpPlannerPath>> ParseDcpPlannerData(const torch_save::PlainValue& planner_data);

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_DCP_METADATA_H_
