// Writing a checkpoint in a given format: one interface for every format a save can produce.
//
// The save engine (engine/save.h) plans which rank writes which chunk of which tensor into which
// of its files, then hands everything that depends on the format to a CheckpointWriter: naming
// and laying out the data files, framing each chunk as it is written, building and committing the
// metadata, cleaning up after a replaced checkpoint, and saying which files are its own. The
// writer is chosen in one place, MakeCheckpointWriter (docs/DESIGN.md decision 11: no
// registration by static initializers), as OpenCheckpointMetadata (open_checkpoint.h) chooses the
// reader. Each format's writer lives in its own folder: native/native_writer.h,
// torch_dcp/dcp_checkpoint_writer.h.
//
// The save sequence, and which side calls what:
//   coordinator  LayOutFiles        names the planned files, places each chunk, returns headers
//                (NameFiles         instead, where ranks_build_headers(): names the files only)
//   every rank   BuildFileHeader    where ranks_build_headers(): the header of each of its files
//   every rank   NewChunkWriter     frames and writes the rank's chunks into its open files
//   coordinator  PrepareCommit      writes side files, returns the metadata file's bytes
//   coordinator  (engine)           writes metadata_file_name() durably: the commit point
//   coordinator  RemoveReplaced     on the writers of every other kind (AllCheckpointWriters)
//   coordinator  OwnsFile           which leftovers the engine's cleanup may remove
//
// A CheckpointWriter is immutable and its methods are thread-safe; a ChunkWriter is thread-safe
// for distinct chunk slots.
#ifndef SHARDPOINT_FORMAT_WRITER_H_
#define SHARDPOINT_FORMAT_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

// A chunk's bytes are written in pieces of at most this many bytes, so that one large tensor
// spreads over every I/O thread.
inline constexpr uint64_t kWriteTaskBytes = uint64_t{16} << 20;
// Within a piece, bytes are checksummed then written in groups of this size, small enough to
// stay in the CPU cache in between.
inline constexpr uint64_t kWriteGroupBytes = uint64_t{1} << 20;

// Called with the byte count of each piece once written (progress reports); may be empty.
using WrittenCallback = std::function<void(uint64_t)>;

// Bytes [lo, hi) of a chunk while a write task works on them: in the chunk's memory, or in a
// buffer that its ChunkSource filled and takes back when the range goes.
class ChunkRange {
 public:
  explicit ChunkRange(const std::byte* data, std::function<void()> release = nullptr)
      : data_(data), release_(std::move(release)) {}
  ChunkRange(ChunkRange&& other) noexcept
      : data_(other.data_), release_(std::exchange(other.release_, nullptr)) {}
  ChunkRange& operator=(ChunkRange&&) = delete;
  ChunkRange(const ChunkRange&) = delete;
  ~ChunkRange() {
    if (release_) release_();
  }
  const std::byte* data() const { return data_; }

 private:
  const std::byte* data_;
  std::function<void()> release_;
};

// Where the bytes of a chunk without memory come from (streaming saves): each write task fetches
// just the range it writes, so that one large chunk is filled and written by every I/O thread at
// once and only the ranges being written are held. Thread-safe for disjoint ranges.
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  virtual Result<ChunkRange> Fetch(uint64_t lo, uint64_t hi) = 0;
};

// One chunk to write: its elements row-major and contiguous at `data` (or, when `source` is set,
// fetched from it range by range), and where they go.
struct ChunkBytes {
  DType dtype = DType::kFloat32;
  Box box;                         // the chunk's box in the global tensor
  const std::byte* data = nullptr;
  uint64_t byte_length = 0;
  // Where the first byte goes in the file: the file's data_start (the length of its header)
  // plus the chunk's data_offset, both as LayOutFiles left them.
  uint64_t file_offset = 0;
  ChunkSource* source = nullptr;   // when set, `data` is null; it outlives the writes
};

// Bytes [lo, hi) of `chunk`: from its source, or its memory at byte lo. Write tasks call it.
// (Inline: the format libraries that call it sit below the one that picks a writer.)
inline Result<ChunkRange> FetchChunkRange(const ChunkBytes& chunk, uint64_t lo, uint64_t hi) {
  if (lo > hi || hi > chunk.byte_length) {
    return InternalError("write task range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                         ") outside a chunk of " + std::to_string(chunk.byte_length) + " bytes");
  }
  if (chunk.source != nullptr) return chunk.source->Fetch(lo, hi);
  if (chunk.data == nullptr && hi > lo) {
    return InternalError("a chunk with neither memory nor a source");
  }
  return ChunkRange(chunk.data + lo);
}

// Writes the chunks of one rank's save into its open data files, framed as the format wants.
class ChunkWriter {
 public:
  virtual ~ChunkWriter() = default;
  // Queues the writes of chunk `slot` (below the count given to NewChunkWriter) into `file` on
  // `group`, calling *written (when non-empty) after each piece. The CRC32C of each checksum
  // block goes to *block_crc32c when the format keeps them (native); otherwise it stays empty.
  // chunk.data (or chunk.source) must stay valid until `group` is done. Each task fetches its
  // piece with FetchChunkRange; a piece is at most kWriteTaskBytes (or one checksum block).
  virtual Status QueueChunk(size_t slot, const ChunkBytes& chunk, WritableFile& file,
                            TaskGroup& group, const WrittenCallback* written,
                            std::vector<uint32_t>* block_crc32c) = 0;
  // Once every queued write is done: writes what follows the chunks (a DCP item's tail, which
  // holds the CRC-32 of its bytes). Nothing to do for formats without framing after the bytes.
  virtual Status Finish() = 0;
};

class CheckpointWriter {
 public:
  virtual ~CheckpointWriter() = default;

  // "native", "torch-dcp" or "megatron": writers of different kinds produce checkpoints that a
  // reader tells apart.
  virtual std::string_view kind() const = 0;
  virtual CheckpointFormat format() const = 0;
  // The file whose appearance commits a checkpoint of this kind.
  virtual std::string_view metadata_file_name() const = 0;

  // Coordinator, after planning (the plan leaves file names empty; a rank's files are in the
  // order of their number k within the rank): names md's data files, places every chunk
  // (StoredChunk::data_offset), sets each file's data_start and size, and may change
  // md->checksum_block_bytes (0: no checksums). Returns the header to write at offset 0 of each
  // file (its length is the file's data_start). May look at what is already at `path`.
  virtual Result<std::vector<std::string>> LayOutFiles(Store& store, std::string_view path,
                                                       CheckpointMetadata* md) const = 0;

  // Whether the rank that writes a data file builds its header (BuildFileHeader) from the chunks
  // it writes there, and reports the file's data_start and size with its checksums. The
  // coordinator of such a format calls NameFiles instead of LayOutFiles: a save of thousands of
  // ranks then builds its headers on every rank at once, and the coordinator never holds them
  // (millions of entries at 8,192 ranks x 1,000 tensors).
  virtual bool ranks_build_headers() const { return false; }

  // Coordinator, where ranks_build_headers(): what LayOutFiles does but the headers: names md's
  // data files and places every chunk, leaving each file's data_start and size to the reports of
  // its writing rank.
  virtual Status NameFiles(Store& store, std::string_view path, CheckpointMetadata* md) const {
    return InternalError(std::string(kind()) + " checkpoints have their files laid out whole");
  }

  // The rank writing a data file of save `save_id`, where ranks_build_headers(): the header to
  // write at its offset 0 (its length is the file's data_start), from the file's chunks in the
  // metadata's order (by tensor, then by chunk), with checksums of `checksum_block_bytes` blocks.
  // The same bytes LayOutFiles returns for the file.
  virtual std::string BuildFileHeader(std::string_view save_id, std::vector<DataFileChunk> chunks,
                                      uint64_t checksum_block_bytes) const {
    return std::string();
  }

  // The rank that wrote a data file's chunks, before it writes the file's header: puts `crcs`,
  // the block checksums of the file's chunks in data offset order, into `header` where the
  // format keeps them there (native, docs/FORMAT.md §2); nothing elsewhere.
  virtual Status FillFileChecksums(std::string* header, std::span<const uint32_t> crcs) const {
    return OkStatus();
  }

  // For a save whose plan comes from a SavePlanCache (engine/save_plan_cache.h): turns the name
  // and, when `header` is not null, the header of a file laid out for save `old_id` into those of
  // the same file laid out for save `new_id` (of the same length), nothing else changing (data
  // offsets, sizes, header length), and returns true; false when this format's layout is not
  // renamed that way (the engine then lays the files out again) or the text is not what it made.
  virtual bool RenameForSave(std::string_view old_id, std::string_view new_id, std::string* name,
                             std::string* header) const {
    return false;
  }

  // Every rank: a writer for `chunks` chunks. checksum_block_bytes is the metadata's.
  virtual std::unique_ptr<ChunkWriter> NewChunkWriter(size_t chunks,
                                                      uint64_t checksum_block_bytes) const = 0;

  // Coordinator, once every data file is durable and md holds the reported block checksums:
  // writes durably the files that must exist before the commit (adding to md->files those the
  // metadata names) and returns the bytes of the metadata file. The engine then writes them as
  // metadata_file_name(), which commits the checkpoint.
  virtual Result<std::string> PrepareCommit(Store& store, std::string_view path, int coordinator,
                                            CheckpointMetadata* md) const = 0;

  // PrepareCommit of metadata whose tensors are `tensors`, with the block checksums the ranks
  // reported in `checksums` (one entry per tensor, in its order) instead of their chunks' own:
  // `tensors` is md->tensors itself, or a plan's that a plan cache holds (md->tensors is then
  // empty). The default fills the checksums into md->tensors, copying `tensors` there first when
  // they are not md's, and calls PrepareCommit; the native writer encodes them as they are,
  // without a copy of the plan.
  virtual Result<std::string> PrepareCommitApart(Store& store, std::string_view path,
                                                 int coordinator, CheckpointMetadata* md,
                                                 const std::vector<TensorMetadata>& tensors,
                                                 const ChunkChecksums& checksums) const {
    if (&tensors != &md->tensors) md->tensors = tensors;
    SP_RETURN_IF_ERROR(FillChecksums(checksums, &md->tensors));
    return PrepareCommit(store, path, coordinator, md);
  }

  // Coordinator, after a checkpoint of another kind committed at `path` with metadata file
  // `committed_name`: removes what a replaced checkpoint of this kind left that would make
  // readers take the directory for one of this kind (its metadata file unless that is
  // `committed_name`; Megatron-Core's files). Errors removing a metadata file are returned;
  // other removals are best effort.
  virtual Status RemoveReplaced(Store& store, std::string_view path,
                                std::string_view committed_name) const = 0;

  // Whether `name` (in a checkpoint directory) is a file that saves of this kind create and that
  // is garbage unless a committed metadata names it: data files, their temporaries, metadata
  // temporaries. Files of other kinds, and the user's, are never claimed.
  virtual bool OwnsFile(std::string_view name) const = 0;
};

// The writer for a save: kNative, kTorchDcp, or kTorchDcp with `megatron` (a Megatron-Core
// torch_dist checkpoint). kInvalidArgument for kSafetensors ("use consolidation") and for
// `megatron` with another format.
Result<std::unique_ptr<CheckpointWriter>> MakeCheckpointWriter(CheckpointFormat format,
                                                               bool megatron);

// One writer of every kind a save can produce, in a fixed order (native, torch-dcp, megatron):
// for what concerns every kind of checkpoint at a path (is one committed there, whose leftovers
// are these).
std::vector<std::unique_ptr<CheckpointWriter>> AllCheckpointWriters();

}  // namespace sp

#endif  // SHARDPOINT_FORMAT_WRITER_H_
