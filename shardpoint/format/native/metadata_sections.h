// Internal to the native metadata codec: the layout constants of docs/FORMAT.md §3 and the
// encoders and decoders of its sections and records. metadata_codec.h is the public interface.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_FORMAT_NATIVE_METADATA_SECTIONS_H_
#define SHARDPOINT_FORMAT_NATIVE_METADATA_SECTIONS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/native/metadata_codec.h"

namespace sp::native_metadata {

inline constexpr char kMagic[8] = {'\x89', 'S', 'P', 'M', 'D', '\r', '\n', '\x1a'};
inline constexpr size_t kPrefixBytes = 32;        // magic .. file_size
inline constexpr size_t kSectionEntryBytes = 24;  // offset, length, crc, count
inline constexpr uint32_t kSectionCount = 5;      // written by 1.0
inline constexpr uint32_t kMaxSectionCount = 64;

enum SectionId : size_t {
  kSummary = 0,
  kTensorIndex = 1,
  kTensorRecords = 2,
  kObjectIndex = 3,
  kObjectRecords = 4,
};

// Caps (docs/FORMAT.md §3).
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{4} << 30;
inline constexpr uint32_t kMaxSaveIdBytes = 128;
inline constexpr int32_t kMaxWorldSize = 1 << 24;
inline constexpr uint64_t kMaxChecksumBlockBytes = uint64_t{1} << 40;
inline constexpr uint32_t kMaxFiles = 1 << 24;
inline constexpr uint32_t kMaxFileNameBytes = 255;
inline constexpr uint32_t kMaxAttributes = 1 << 20;
inline constexpr uint32_t kMaxAttributeKeyBytes = 4096;
inline constexpr uint32_t kMaxAttributeValueBytes = 1 << 20;
inline constexpr uint32_t kMaxNameBytes = 4096;
inline constexpr uint64_t kMaxRecordBytes = uint64_t{1} << 31;
inline constexpr size_t kMaxRank = 64;
inline constexpr int64_t kMaxDimension = int64_t{1} << 62;
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 62;
inline constexpr uint32_t kMaxChunks = 1 << 24;
inline constexpr uint64_t kMaxObjectBytes = uint64_t{1} << 30;

using Section = MetadataReader::Section;
using RecordSlot = MetadataReader::RecordSlot;

// "metadata file <path>: <problem>" as kDataLoss.
Status Corrupt(std::string_view path, std::string_view problem);

// Checks the 32-byte prefix: magic, version (kFailedPrecondition for a newer major), header
// length and section count against `file_size`. Sets the version fields of `summary`.
Result<uint32_t> DecodePrefix(std::string_view prefix, uint64_t file_size, std::string_view path,
                              CheckpointMetadata* summary);
// Checks the header CRC and the placement of every section; returns the section table.
Result<std::vector<Section>> DecodeSectionTable(std::string_view header, uint64_t file_size,
                                                std::string_view path);
Status CheckCrc(std::string_view bytes, uint32_t expected, std::string_view what,
                std::string_view path);

// With `header_crcs` (versions 3.1 and 4), the summary ends with every data file's header CRC.
std::string EncodeSummary(const CheckpointMetadata& metadata, bool header_crcs = false);
// Fills everything but the version (set already in `out`: it says what the summary holds),
// tensors and objects.
Status DecodeSummary(std::string_view bytes, bool newer_minor, std::string_view path,
                     CheckpointMetadata* out);

// Appends one index entry.
void EncodeIndexEntry(std::string* out, std::string_view name, const RecordSlot& slot);
// Decodes `count` entries; checks names (sorted, unique, capped) and that the records tile
// [0, records_length) in order.
Status DecodeIndex(std::string_view bytes, uint32_t count, uint64_t records_length,
                   std::string_view what, std::string_view path, std::vector<std::string>* names,
                   std::vector<RecordSlot>* slots);

// Tensor record layouts of versions 2 and 3 (docs/FORMAT.md §3.5): a list of chunks, as in
// version 1, or a grid.
enum TensorLayout : uint8_t {
  kChunkList = 0,
  kGrid = 1,
};
// How a grid record gives one dimension's cut points.
enum GridCuts : uint8_t {
  kListedCuts = 0,  // the interior cut points
  kEvenCuts = 1,    // a step: cut k at k * step, the last interval at most a step
};

// A record of format version `major` (1 to 4).
std::string EncodeTensorRecord(const TensorMetadata& tensor, uint64_t checksum_block_bytes,
                               uint32_t major);
// The same, appended to `out`; with `apart`, the chunks' block checksums are those it holds for
// them instead of their own (ChunkChecksums, format/metadata.h).
void AppendTensorRecord(const TensorMetadata& tensor, uint64_t checksum_block_bytes,
                        uint32_t major, std::string* out,
                        const ChunkChecksums::Tensor* apart = nullptr);
// At least the bytes of the record of `tensor` (with the checksums of `apart`, when given) in any
// version: room to reserve so that records appended one after the other never move the bytes
// before them.
uint64_t TensorRecordBound(const TensorMetadata& tensor,
                           const ChunkChecksums::Tensor* apart = nullptr);
// `summary` supplies the files, the checksum block size the chunks are checked against and the
// version of the record. With `keep`, the result holds only the chunks that share a point with
// one of its boxes (TensorMetadata::kept; none for an empty list), and every chunk is checked as
// without it, with the same error for the same bytes. Without `keep`, a chunk list of version 2
// or later comes with its index (TensorMetadata::index) unless `index_lists` is false.
Result<TensorMetadata> DecodeTensorRecord(std::string_view bytes, std::string name,
                                          const CheckpointMetadata& summary, bool newer_minor,
                                          std::string_view path,
                                          const std::vector<Box>* keep = nullptr,
                                          bool index_lists = true);

// The cells a grid record claims (the product of its interval counts, at most 2^62), read from
// its cut points alone; 0 for a chunk list, or bytes that are no grid record (whose decoding
// reports why). From version 4 a cell takes no bytes of a record (its checksums are in the data
// files' headers), so the cells a whole metadata file may describe are bounded by
// GridCellBudget, before any record is decoded (docs/FORMAT.md §3.7).
uint64_t GridRecordCells(std::string_view bytes, uint32_t major);
// The most grid cells, all records together, the metadata of `summary` may describe from version
// 4: kMaxChunks, and 4,096 for each data file (a rank's file holds a cell of each tensor sharded
// over the ranks: 8,192 ranks x 1,000 tensors have about 500 a file). Each cell costs its decoder
// a check and its grid 8 bytes at most, and each data file at least 25 bytes of the summary.
inline uint64_t GridCellBudget(const CheckpointMetadata& summary) {
  return kMaxChunks + 4096 * static_cast<uint64_t>(summary.files.size());
}

std::string EncodeObjectRecord(const ObjectEntry& object);
Result<ObjectEntry> DecodeObjectRecord(std::string_view bytes, std::string name, bool newer_minor,
                                       std::string_view path);

}  // namespace sp::native_metadata

#endif  // SHARDPOINT_FORMAT_NATIVE_METADATA_SECTIONS_H_
