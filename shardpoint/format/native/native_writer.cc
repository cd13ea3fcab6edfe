#include "shardpoint/format/native/native_writer.h"

#include <algorithm>
#include <map>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/native/metadata_codec.h"

namespace sp {
namespace {

// Writes one piece of a chunk, `bytes` bytes at `data` going to `file_offset`, checksumming each
// block it holds into crcs[0...] (the piece starts on a block boundary). Blocks are checksummed
// and written in groups of about kWriteGroupBytes so each group is still in cache when written,
// and writeback of the piece starts at once so the device works while the CPU goes on.
Status WritePiece(WritableFile& file, uint64_t file_offset, const std::byte* data, uint64_t bytes,
                  uint64_t block_bytes, uint32_t* crcs) {
  const uint64_t group = std::max<uint64_t>(1, kWriteGroupBytes / block_bytes) * block_bytes;
  for (uint64_t lo = 0; lo < bytes; lo += group) {
    const uint64_t hi = std::min(lo + group, bytes);
    for (uint64_t b = lo; b < hi; b += block_bytes) {
      crcs[b / block_bytes] = Crc32c(data + b, std::min(b + block_bytes, hi) - b);
    }
    SP_RETURN_IF_ERROR(file.WriteAt(file_offset + lo, ByteView(data + lo, hi - lo)));
  }
  file.StartWriteback(file_offset, bytes);
  return OkStatus();
}

class NativeChunkWriter : public ChunkWriter {
 public:
  explicit NativeChunkWriter(uint64_t block_bytes) : block_bytes_(block_bytes) {}

  Status QueueChunk(size_t slot, const ChunkBytes& chunk, WritableFile& file, TaskGroup& group,
                    const WrittenCallback* written, std::vector<uint32_t>* block_crc32c) override {
    if (block_bytes_ == 0) return InternalError("native save without a checksum block size");
    block_crc32c->resize(ChecksumBlockCount(chunk.byte_length, block_bytes_));
    const uint64_t block_bytes = block_bytes_;
    const uint64_t step =
        std::max<uint64_t>(block_bytes, kWriteTaskBytes / block_bytes * block_bytes);
    const uint64_t offset = chunk.file_offset;
    const ChunkBytes bytes{chunk.dtype, Box(), chunk.data, chunk.byte_length, offset, chunk.source};
    WritableFile* out = &file;
    uint32_t* crcs = block_crc32c->data();
    for (uint64_t lo = 0; lo < chunk.byte_length; lo += step) {
      const uint64_t hi = std::min(lo + step, chunk.byte_length);
      group.Run([=] {
        SP_ASSIGN_OR_RETURN(const ChunkRange range, FetchChunkRange(bytes, lo, hi));
        SP_RETURN_IF_ERROR(WritePiece(*out, offset + lo, range.data(), hi - lo, block_bytes,
                                      crcs + lo / block_bytes));
        if (written != nullptr && *written) (*written)(hi - lo);
        return OkStatus();
      });
    }
    return OkStatus();
  }

  Status Finish() override { return OkStatus(); }

 private:
  const uint64_t block_bytes_;
};

// The version the metadata is written as: that of files whose headers hold their checksums.
void SetWrittenVersion(CheckpointMetadata* md) {
  md->version_major = kNativeFormatMajor;
  md->version_minor = kNativeFormatMinor;
}

class NativeWriter : public CheckpointWriter {
 public:
  std::string_view kind() const override { return "native"; }
  CheckpointFormat format() const override { return CheckpointFormat::kNative; }
  std::string_view metadata_file_name() const override { return kMetadataFileName; }

  Result<std::vector<std::string>> LayOutFiles(Store&, std::string_view,
                                               CheckpointMetadata* md) const override {
    // The headers list every chunk (a plan's cells become chunks) and keep room for their
    // checksums.
    md->data_file_checksums = true;
    SetWrittenVersion(md);
    for (TensorMetadata& t : md->tensors) ExpandChunkCells(&t);
    SP_ASSIGN_OR_RETURN(const std::vector<uint64_t> data_bytes, Name(md));
    std::vector<std::string> headers = BuildDataFileHeaders(*md);
    for (uint32_t f = 0; f < md->files.size(); ++f) {
      md->files[f].data_start = headers[f].size();
      md->files[f].size = headers[f].size() + data_bytes[f];
    }
    return headers;
  }

  bool ranks_build_headers() const override { return true; }

  Status NameFiles(Store&, std::string_view, CheckpointMetadata* md) const override {
    SP_RETURN_IF_ERROR(Name(md).status());
    md->data_file_checksums = true;  // the writers put them in their headers
    SetWrittenVersion(md);
    for (DataFile& file : md->files) file.data_start = file.size = 0;  // the writers report them
    return OkStatus();
  }

  std::string BuildFileHeader(std::string_view save_id, std::vector<DataFileChunk> chunks,
                              uint64_t checksum_block_bytes) const override {
    return BuildDataFileHeader(save_id, std::move(chunks), checksum_block_bytes);
  }

  Status FillFileChecksums(std::string* header, std::span<const uint32_t> crcs) const override {
    return FillDataFileChecksums(header, crcs);
  }

  // The save id is in the file's name once (d-<id>-r...) and in its header once, as the value of
  // "save_id" in "__metadata__" (a JSON string of hex digits, needing no escapes).
  bool RenameForSave(std::string_view old_id, std::string_view new_id, std::string* name,
                     std::string* header) const override {
    if (old_id.size() != new_id.size() || old_id.empty()) return false;
    auto replace_once = [&](std::string* text, const std::string& before, const std::string& after) {
      const std::string token = before + std::string(old_id) + after;
      const size_t at = text->find(token);
      if (at == std::string::npos || text->find(token, at + 1) != std::string::npos) return false;
      text->replace(at + before.size(), old_id.size(), new_id);
      return true;
    };
    std::string new_name = *name;
    std::string new_header = header != nullptr ? *header : std::string();
    if (!replace_once(&new_name, "d-", "-r")) return false;
    if (header != nullptr && !replace_once(&new_header, "\"save_id\":\"", "\"")) return false;
    *name = std::move(new_name);
    if (header != nullptr) *header = std::move(new_header);
    return true;
  }

  std::unique_ptr<ChunkWriter> NewChunkWriter(size_t,
                                              uint64_t checksum_block_bytes) const override {
    return std::make_unique<NativeChunkWriter>(checksum_block_bytes);
  }

  Result<std::string> PrepareCommit(Store&, std::string_view, int,
                                    CheckpointMetadata* md) const override {
    return EncodeMetadata(*md);
  }

  Result<std::string> PrepareCommitApart(Store&, std::string_view, int, CheckpointMetadata* md,
                                         const std::vector<TensorMetadata>& tensors,
                                         const ChunkChecksums& checksums) const override {
    SP_RETURN_IF_ERROR(CheckChecksumsFit(tensors, checksums));
    return EncodeMetadata(*md, tensors, checksums);
  }

  Status RemoveReplaced(Store& store, std::string_view path,
                        std::string_view committed_name) const override {
    if (committed_name == kMetadataFileName) return OkStatus();
    const std::string metadata_path = JoinPath(path, kMetadataFileName);
    // Not knowing whether it is there (the next save retries) is no reason to fail a commit.
    if (Result<bool> exists = store.Exists(metadata_path); !exists.ok() || !*exists) {
      return OkStatus();
    }
    SP_RETURN_IF_ERROR(store.RemoveFile(metadata_path));
    return store.SyncDir(path);
  }

  bool OwnsFile(std::string_view name) const override {
    return (name.starts_with("d-") &&
            (name.ends_with(".safetensors") || name.ends_with(".safetensors.tmp"))) ||
           name.starts_with(std::string(kMetadataFileName) + ".tmp-");
  }

 private:
  // Names md's data files (d-<save_id>-r<rank>-f<k>) and returns the bytes of chunks each holds.
  static Result<std::vector<uint64_t>> Name(CheckpointMetadata* md) {
    std::vector<uint64_t> data_bytes(md->files.size(), 0);
    std::vector<uint64_t> lengths;
    for (const TensorMetadata& t : md->tensors) {
      ChunkByteLengths(t, &lengths);
      for (size_t c = 0; c < lengths.size(); ++c) {
        const uint32_t file = ChunkFile(t, c);
        if (file >= md->files.size()) {
          return InternalError("tensor '" + t.name + "' has a chunk in file " +
                               std::to_string(file) + " of " + std::to_string(md->files.size()));
        }
        data_bytes[file] += lengths[c];
      }
    }
    std::map<int32_t, int> next_k;  // writer rank -> files named so far
    for (DataFile& file : md->files) {
      file.name = DataFileName(md->save_id, file.writer_rank, next_k[file.writer_rank]++);
    }
    return data_bytes;
  }
};

}  // namespace

std::unique_ptr<CheckpointWriter> MakeNativeWriter() { return std::make_unique<NativeWriter>(); }

}  // namespace sp
