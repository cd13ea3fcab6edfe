// The native metadata file `shardpoint.metadata` and the native data file conventions.
//
// docs/FORMAT.md §3 specifies the bytes: a fixed header with a section table, a summary (save_id,
// world size, checksum block size, files, attributes), sorted name indexes, and one record per
// tensor and per object, each section and record covered by a CRC32C. The file can be read in
// part: MetadataReader reads the header, summary and indexes, then only the records asked for.
//
// Decoders treat the bytes as hostile: every length is capped, every count is checked against the
// bytes that remain before anything is allocated, arithmetic is checked, and the decoded metadata
// is checked for consistency (chunks inside their files and tensors, checksum counts, sorted
// unique names). Corruption is kDataLoss; a newer major version is kFailedPrecondition. Every
// message names the metadata file's path.
//
// Thread-safety: the free functions are pure. A MetadataReader is immutable after Open and its
// const methods may be called from several threads at once (ReadableFile::ReadAt is thread-safe).
#ifndef SHARDPOINT_FORMAT_NATIVE_METADATA_CODEC_H_
#define SHARDPOINT_FORMAT_NATIVE_METADATA_CODEC_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

inline constexpr char kMetadataFileName[] = "shardpoint.metadata";
// The format version this code writes; it reads every 1.x to 4.x (docs/FORMAT.md §3.2).
// Version 3.1 is 3.0 with each data file's checksums in its header as well, and the headers'
// CRCs in the summary; version 4 is 3.1 without the checksums in the tensor records: what a save
// writes (CheckpointMetadata::data_file_checksums).
inline constexpr uint32_t kNativeFormatMajor = 4;
inline constexpr uint32_t kNativeFormatMinor = 0;
inline constexpr uint32_t kOldestNativeFormatMajor = 1;
// The newest minor version of `major` this code knows (3.1, 4.0; x.0 for the others).
constexpr uint32_t KnownNativeFormatMinor(uint32_t major) {
  return major == 3 ? 1 : major == kNativeFormatMajor ? kNativeFormatMinor : 0;
}

// Encodes `metadata` as a metadata file of version `major` (4, or 3, 2 or 1 for readers that
// predate it; the version fields of `metadata` are not used): version 4 only where
// `metadata.data_file_checksums` (else 3.0), and always where `metadata.checksums_in_headers`;
// 3.1 where `major` is 3 and `metadata.data_file_checksums`; else `major`.0. Version 2 stores a
// tensor whose
// chunks form a grid (format/chunk_grid.h) as the grid's cut points and a file, an offset and
// checksums per cell; version 1 lists every chunk's box. Version 3 is version 2 with the files,
// offsets and boxes of those tables packed (varints, files and offsets as steps from the chunk
// before). Tensors and objects are written sorted
// by name; the caller guarantees unique names and consistent chunks (a file that breaks the rules
// of docs/FORMAT.md is refused by the decoder).
std::string EncodeMetadata(const CheckpointMetadata& metadata,
                           uint32_t major = kNativeFormatMajor);

// The same for metadata whose tensors are `tensors` (`metadata.tensors` is not used: it may be
// empty, or `tensors` itself), with the block checksums of their chunks taken from `checksums`
// (one entry per tensor of `tensors`, in its order) instead of the chunks' own. A save's commit
// encodes this way from the plan its cache holds, without a copy of the plan (engine/save.cc).
// The bytes are those of EncodeMetadata of the same metadata with the checksums filled in.
std::string EncodeMetadata(const CheckpointMetadata& metadata,
                           const std::vector<TensorMetadata>& tensors,
                           const ChunkChecksums& checksums, uint32_t major = kNativeFormatMajor);

// Decodes and validates a whole metadata file held in memory. `path` names it in messages.
// The result's version fields are those of the file. The tensor records are decoded on `pool`
// (null: on the calling thread); the result, or the error (that of the first bad record in name
// order), is the same. With `filter`, each tensor holds only the chunks the filter keeps
// (TensorMetadata::kept), and the file is checked as without it: every byte against its CRC, every
// chunk and cell as a chunk, so that the same bytes give the same error whatever the filter.
// With `chunk_cells` (and no filter), a tensor whose chunks are all raw is held as cells as soon
// as it is decoded (CompactChunkCells in format/chunk_grid.h, which drops the checksums): what a
// save plan holds (SavePlanOptions::chunk_cells), at a fraction of the memory.
Result<CheckpointMetadata> DecodeMetadata(std::string_view bytes, std::string_view path,
                                          ThreadPool* pool = nullptr,
                                          const ChunkFilter* filter = nullptr,
                                          bool chunk_cells = false);

// Reads a metadata file in part. Open reads and validates the header, the summary and the two
// name indexes; ReadTensor / ReadObject read and validate one record each.
class MetadataReader {
  struct PrivateTag {};

 public:
  // Takes ownership of `file`. Errors as for DecodeMetadata.
  static Result<std::unique_ptr<MetadataReader>> Open(std::unique_ptr<ReadableFile> file);

  // Sorted, unique.
  const std::vector<std::string>& tensor_names() const { return tensor_names_; }
  const std::vector<std::string>& object_names() const { return object_names_; }
  // version, save_id, world_size, checksum_block_bytes, files, attributes; no tensors or objects.
  const CheckpointMetadata& summary() const { return summary_; }
  const std::string& path() const { return file_->path(); }

  // kNotFound naming the tensor and the file when there is no such tensor; kDataLoss when its
  // record is corrupt. A tensor stored as a grid comes with its grid (TensorMetadata::grid).
  Result<TensorMetadata> ReadTensor(std::string_view name) const;
  Result<ObjectEntry> ReadObject(std::string_view name) const;
  // Everything, reading the two record sections whole and checking their section CRCs; the
  // tensor records decoded on `pool` as DecodeMetadata does.
  // With `filter`, each tensor holds only the chunks it keeps, and with `chunk_cells` a tensor of
  // raw chunks is held as cells (DecodeMetadata).
  Result<CheckpointMetadata> ReadAll(ThreadPool* pool = nullptr,
                                     const ChunkFilter* filter = nullptr,
                                     bool chunk_cells = false) const;

  // A record's place, relative to its records section, and its CRC32C (public for the codec's
  // own helpers; not part of the reader's contract).
  struct RecordSlot {
    uint64_t offset = 0;
    uint64_t length = 0;
    uint32_t crc32c = 0;
  };
  struct Section {
    uint64_t offset = 0;
    uint64_t length = 0;
    uint32_t crc32c = 0;
    uint32_t count = 0;
  };

  explicit MetadataReader(PrivateTag) {}

 private:
  Status LoadHeader();
  Status LoadSummaryAndIndexes();
  Result<std::string> ReadSection(size_t index, std::string_view what) const;
  Result<std::string> ReadRecord(const Section& section, const RecordSlot& slot,
                                 std::string_view kind, std::string_view name) const;
  // A minor version newer than this reader knows of the file's major (KnownNativeFormatMinor).
  bool newer_minor() const {
    return summary_.version_minor > KnownNativeFormatMinor(summary_.version_major);
  }

  std::unique_ptr<ReadableFile> file_;
  std::vector<Section> sections_;
  CheckpointMetadata summary_;
  std::vector<std::string> tensor_names_;
  std::vector<RecordSlot> tensor_slots_;
  std::vector<std::string> object_names_;
  std::vector<RecordSlot> object_slots_;
};

// The safetensors header for data file `file_index` of `metadata`: entries are that file's chunks
// in data_offset order, keyed by ChunkEntryName, and "__metadata__" holds format, format_version
// and save_id and, where metadata.data_file_checksums, "crc32c": room for the chunks' block
// checksums (zeros until FillDataFileChecksums). The engine writes it at offset 0; its size is
// the file's data_start.
std::string BuildDataFileHeader(const CheckpointMetadata& metadata, uint32_t file_index);
// The same header built by the rank that writes the file, from that file's chunks alone: the
// header of save `save_id` listing `chunks`, which must be given in the metadata's order (by
// tensor, then by chunk), with room for their checksums of `checksum_block_bytes` blocks unless
// that is 0. Equal to BuildDataFileHeader of the metadata the save commits.
std::string BuildDataFileHeader(std::string_view save_id, std::vector<DataFileChunk> chunks,
                                uint64_t checksum_block_bytes);
// Writes `crcs`, the block checksums of a data file's chunks in the order of its header's entries
// (by data offset), into the room `header` (BuildDataFileHeader) keeps for them. kInternal when
// the header keeps none or room for another count.
Status FillDataFileChecksums(std::string* header, std::span<const uint32_t> crcs);
// The block checksums a data file's header holds ("crc32c" in its "__metadata__", in the order
// of its entries by data offset), each entry's from the entry's start: a `header` parsed from
// file `path` with chunks of `checksum_block_bytes` blocks. kDataLoss naming the file when it
// holds none or they do not fit its entries.
struct DataFileChecksums {
  std::vector<uint64_t> entry_begin;   // each entry's data offset, in the header's entry order
  std::vector<uint64_t> entry_first;   // where its checksums start in `crcs` (one more: the end)
  std::vector<uint32_t> crcs;

  // The checksums of the chunk of `byte_length` bytes at `data_offset`: of the entries there, the
  // last (those before it are empty chunks); none for an empty chunk, or where no entry starts.
  std::span<const uint32_t> Of(uint64_t data_offset, uint64_t byte_length) const;
};
Result<DataFileChecksums> ReadDataFileChecksums(const SafetensorsHeader& header,
                                                uint64_t checksum_block_bytes,
                                                std::string_view path);
// The headers of every data file of `metadata`, indexed by file: one pass over the chunks (a
// header per file built by BuildDataFileHeader would scan every chunk once per file).
std::vector<std::string> BuildDataFileHeaders(const CheckpointMetadata& metadata);

// "model.layers.0.w@0,128"; "step@" for a rank-0 tensor.
std::string ChunkEntryName(std::string_view tensor, const Box& box);

// "d-<save_id>-r00003-f001.safetensors".
std::string DataFileName(std::string_view save_id, int rank, int file_in_rank);

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_NATIVE_METADATA_CODEC_H_
