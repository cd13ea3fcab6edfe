// torch.save archives: where a saved tensor's bytes lie, and zero-copy writers for new archives.
//
// A torch.save file (and every item of a DCP `.distcp` file) is a ZIP archive (zip.h) with a
// top-level folder ("archive/" when torch writes to a buffer) holding `data.pkl` (a protocol-2
// pickle that rebuilds the object; tensors refer to their storages through persistent ids),
// `data/<key>` (raw little-endian storage bytes), `byteorder`, `version` and a few optional
// records. docs/TORCH_DCP.md §3 describes the subset read and written here.
//
// Reading never unpickles with code execution: data.pkl goes through the restricted unpickler
// with the TorchSaveTensorGlobals() (tensors) or PlainDataGlobals() (objects) allowlist, and the
// result is interpreted here. Errors are kDataLoss naming `what` (the file and item); valid
// archives shardpoint cannot use (big-endian, quantized or complex32 tensors, compressed entries)
// are kUnimplemented.
//
// Writing is zero-copy: TorchSaveLayout computes the whole archive layout from dtypes and shapes
// alone; the caller writes each tensor's row-major bytes at data_offset(i) and computes their
// CRC-32 (zip.h's Crc32) while doing so; Head / Between / Tail return the framing bytes around
// them. The archive equals what torch.save writes for the same tensors except that the optional
// `.data/serialization_id` record is left out; torch.load(weights_only=True) reads it.
// All functions are thread-safe; layouts are immutable.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_TORCH_SAVE_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_TORCH_SAVE_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/geometry/box.h"

namespace sp::torch_save {

// Largest data.pkl the readers accept.
inline constexpr uint64_t kMaxDataPklBytes = uint64_t{64} << 20;
// Most dimensions a tensor may have.
inline constexpr size_t kMaxTensorRank = 64;

struct TorchSaveTensorInfo {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<int64_t> strides;  // in elements
  int64_t storage_offset = 0;    // in elements, from the start of the storage
  std::string record;            // the storage's ZIP entry, e.g. "archive/data/0"
  uint64_t data_offset = 0;      // byte offset of the storage's first byte in the archive
  uint64_t storage_bytes = 0;    // bytes of the storage

  // True when the view is the whole storage in row-major order (offset 0, C-contiguous
  // strides, storage_bytes == numel * itemsize): the bytes can be copied as they are.
  bool IsDenseRowMajor() const;
};

// Parses a torch.save archive of one tensor (a DCP tensor item) in [0, archive_length) of
// `read`: the ZIP directory, `version`, `byteorder` (big-endian is kUnimplemented), data.pkl
// (`torch._utils._rebuild_tensor_v2` / `_v3` with a storage persistent id), and the storage
// record. Checks that the record is stored, its size matches the storage, and the view
// (offset, shape, strides) lies inside the storage. Reads only the directory, data.pkl, the small
// records and the storage's local header.
Result<TorchSaveTensorInfo> ParseTorchSaveTensor(const RangeReader& read, uint64_t archive_length,
                                                 std::string_view what);

struct TorchSaveNamedTensor {
  std::string name;
  TorchSaveTensorInfo info;
};

// Parses a torch.save archive of a dict or OrderedDict of str -> tensor (pytorch_model.bin, an
// nn.Module state dict), in the pickle's order. Tensors may share storages.
Result<std::vector<TorchSaveNamedTensor>> ParseTorchSaveStateDict(const RangeReader& read,
                                                                  uint64_t archive_length,
                                                                  std::string_view what);

// Parses a torch.save archive of plain data (a DCP BYTE_IO item written by torch: int, float,
// str, list, dict, tuple, ...). Anything else (arbitrary Python objects) is kDataLoss naming the
// global that is not allowed; this never runs code.
Result<PlainValue> ParseTorchSaveObject(const RangeReader& read, uint64_t archive_length,
                                        std::string_view what);

// Largest BYTE_IO item the DCP reader examines for plain data when it opens a checkpoint;
// larger items stay torch.save archives.
inline constexpr uint64_t kMaxPlainObjectItemBytes = uint64_t{4} << 20;

// A DCP BYTE_IO item (a torch.save archive, `archive` bytes) as a stored object: plain data
// (ParseTorchSaveObject succeeds) becomes ObjectEncoding::kPlain with a pickle written by
// EncodePlainPickle; anything else, including items over kMaxPlainObjectItemBytes and archives
// the restricted reader cannot parse, stays ObjectEncoding::kTorchSave with the archive as is.
// Never runs code.
ObjectEntry ObjectFromTorchSaveItem(std::string name, std::string archive);

struct TorchSaveTensorSpec {
  std::string name;  // dict key (ignored for a single-tensor archive)
  DType dtype = DType::kFloat32;
  Shape shape;
};

class TorchSaveLayout {
 public:
  // The archive torch.save(tensor) writes for a row-major tensor: what DCP stores per tensor item.
  static Result<TorchSaveLayout> ForTensor(DType dtype, const Shape& shape);
  // The archive torch.save({name: tensor, ...}) writes (pytorch_model.bin); names unique.
  static Result<TorchSaveLayout> ForStateDict(std::vector<TorchSaveTensorSpec> tensors);

  size_t tensor_count() const { return data_bytes_.size(); }
  uint64_t total_size() const { return zip_.total_size(); }
  // Where tensor i's row-major bytes go, and how many there are.
  uint64_t data_offset(size_t i) const { return zip_.data_offset(kFixedHead + i); }
  uint64_t data_bytes(size_t i) const { return data_bytes_[i]; }
  const std::string& data_pkl() const { return pickle_; }

  // Bytes [0, data_offset(0)); with no tensors, the bytes before the `version` record.
  std::string Head() const;
  // Bytes [data_offset(i) + data_bytes(i), data_offset(i + 1)), i + 1 < tensor_count().
  // `crc32` is the CRC-32 of tensor i's bytes.
  std::string Between(size_t i, uint32_t crc32) const;
  // The rest of the archive, after the last tensor's bytes. `crc32s` has one CRC-32 per tensor.
  std::string Tail(std::span<const uint32_t> crc32s) const;

 private:
  static constexpr size_t kFixedHead = 4;  // data.pkl, .format_version, .storage_alignment, byteorder
  static Result<TorchSaveLayout> Make(std::string pickle, const std::vector<TorchSaveTensorSpec>& t);
  void AppendFixed(std::string* out, size_t entry) const;

  ZipLayout zip_;
  std::string pickle_;
  std::vector<uint64_t> data_bytes_;
  std::vector<std::string> fixed_;  // contents of the non-tensor entries, by entry index
};

// The interface the DCP writer uses for one tensor item.
using TensorItemLayout = TorchSaveLayout;
inline Result<TensorItemLayout> LayoutTensorItem(DType dtype, const Shape& shape) {
  return TorchSaveLayout::ForTensor(dtype, shape);
}
// Bytes before the tensor data (independent of the data and its CRC).
inline std::string TensorItemPrefix(const TensorItemLayout& layout) { return layout.Head(); }
// Bytes after the tensor data.
inline std::string TensorItemSuffix(const TensorItemLayout& layout, uint32_t crc32) {
  return layout.Tail(std::span<const uint32_t>(&crc32, 1));
}

// A whole torch.save archive of plain data: what DCP writes for a BYTE_IO item, readable by
// torch.load(weights_only=True). kInvalidArgument as for WritePlainValue.
Result<std::string> EncodePlainObjectItem(const PlainValue& value);

// The storage class torch.save names for `dtype` ("FloatStorage"), or "" for dtypes saved
// through UntypedStorage and _rebuild_tensor_v3 (uint16/32/64, float8 variants).
std::string_view TorchStorageClassName(DType dtype);

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_TORCH_SAVE_H_
