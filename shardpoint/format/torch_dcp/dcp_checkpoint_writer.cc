#include "shardpoint/format/torch_dcp/dcp_checkpoint_writer.h"

#include <optional>
#include <span>
#include <utility>

#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/base/crc32.h"

namespace sp::torch_dcp {
namespace {

// Data files keep torch's names ("__<rank>_<k>.distcp") unless they would replace the files of a
// committed DCP checkpoint before the new one is committed: then they carry the save id. Asked
// when the files are laid out and again at commit, with the same answer: only the commit changes
// `.metadata`.
Result<std::string> NameSuffix(Store& store, std::string_view path, std::string_view save_id) {
  SP_ASSIGN_OR_RETURN(bool replacing, store.Exists(JoinPath(path, kDcpMetadataFileName)));
  return replacing ? "-" + std::string(save_id) : std::string();
}

// Writes one piece of an item's storage bytes, `bytes` bytes at `data` going to `file_offset`,
// computing their CRC-32 on the way.
Status WriteItemPiece(WritableFile& file, uint64_t file_offset, const std::byte* data,
                      uint64_t bytes, uint32_t* crc32) {
  uint32_t crc = 0;
  for (uint64_t lo = 0; lo < bytes; lo += kWriteGroupBytes) {
    const uint64_t hi = std::min(lo + kWriteGroupBytes, bytes);
    crc = Crc32(crc, data + lo, hi - lo);
    SP_RETURN_IF_ERROR(file.WriteAt(file_offset + lo, ByteView(data + lo, hi - lo)));
  }
  *crc32 = crc;
  file.StartWriteback(file_offset, bytes);
  return OkStatus();
}

// One chunk written as a DCP item: a torch.save archive whose storage bytes are the chunk's; the
// archive's tail (which holds their CRC-32) is written once every piece is done.
struct Item {
  std::optional<torch_save::TorchSaveLayout> layout;
  WritableFile* file = nullptr;
  uint64_t data_offset = 0;  // in the file, of the storage bytes
  std::vector<uint64_t> piece_bytes;
  std::vector<uint32_t> piece_crc32;

  Status WriteTail() const {
    uint32_t crc = 0;
    for (size_t i = 0; i < piece_crc32.size(); ++i) {
      crc = Crc32Combine(crc, piece_crc32[i], piece_bytes[i]);
    }
    const std::string tail = layout->Tail(std::span<const uint32_t>(&crc, 1));
    return file->WriteAt(data_offset + layout->data_bytes(0), AsBytes(tail));
  }
};

class DcpChunkWriter : public ChunkWriter {
 public:
  explicit DcpChunkWriter(size_t chunks) : items_(chunks) {}

  Status QueueChunk(size_t slot, const ChunkBytes& chunk, WritableFile& file, TaskGroup& group,
                    const WrittenCallback* written, std::vector<uint32_t>*) override {
    if (slot >= items_.size()) return InternalError("DCP item slot out of range");
    Item* item = &items_[slot];
    SP_ASSIGN_OR_RETURN(item->layout, ChunkItemLayout(chunk.dtype, chunk.box));
    if (item->layout->data_bytes(0) != chunk.byte_length ||
        item->layout->data_offset(0) > chunk.file_offset) {
      return InternalError("DCP item layout disagrees with the save plan for a chunk of " +
                           std::to_string(chunk.byte_length) + " bytes");
    }
    item->file = &file;
    item->data_offset = chunk.file_offset;
    const uint64_t item_start = chunk.file_offset - item->layout->data_offset(0);
    SP_RETURN_IF_ERROR(file.WriteAt(item_start, AsBytes(item->layout->Head())));
    const size_t pieces =
        static_cast<size_t>((chunk.byte_length + kWriteTaskBytes - 1) / kWriteTaskBytes);
    item->piece_bytes.resize(pieces);
    item->piece_crc32.resize(pieces);
    for (size_t i = 0; i < pieces; ++i) {
      const uint64_t lo = i * kWriteTaskBytes;
      const uint64_t hi = std::min(lo + kWriteTaskBytes, chunk.byte_length);
      item->piece_bytes[i] = hi - lo;
      WritableFile* out = &file;
      uint32_t* crc = &item->piece_crc32[i];
      const ChunkBytes bytes{chunk.dtype, Box(), chunk.data, chunk.byte_length, chunk.file_offset,
                             chunk.source};
      group.Run([=] {
        SP_ASSIGN_OR_RETURN(const ChunkRange range, FetchChunkRange(bytes, lo, hi));
        SP_RETURN_IF_ERROR(WriteItemPiece(*out, bytes.file_offset + lo, range.data(), hi - lo, crc));
        if (written != nullptr && *written) (*written)(hi - lo);
        return OkStatus();
      });
    }
    return OkStatus();
  }

  Status Finish() override {
    for (const Item& item : items_) {
      if (item.layout.has_value()) SP_RETURN_IF_ERROR(item.WriteTail());
    }
    return OkStatus();
  }

 private:
  std::vector<Item> items_;
};

// Megatron-Core's files (common.pt with the objects, metadata.json), both durable before
// `.metadata` commits.
Status WriteMegatronFiles(Store& store, std::string_view path, const CheckpointMetadata& md) {
  const std::string temp_suffix = ".tmp-" + md.save_id;
  SP_ASSIGN_OR_RETURN(std::string common, BuildMegatronCommonFile(md));
  for (const auto& [name, bytes] :
       {std::pair<std::string_view, std::string>{kMegatronCommonFileName, std::move(common)},
        {kMegatronConfigFileName, EncodeMegatronConfig()}}) {
    SP_RETURN_IF_ERROR(
        WriteFileDurably(store, path, name, std::string(name) + temp_suffix, bytes));
  }
  return OkStatus();
}

class DcpCheckpointWriter : public CheckpointWriter {
 public:
  explicit DcpCheckpointWriter(bool megatron) : megatron_(megatron) {}

  std::string_view kind() const override { return megatron_ ? "megatron" : "torch-dcp"; }
  CheckpointFormat format() const override { return CheckpointFormat::kTorchDcp; }
  std::string_view metadata_file_name() const override { return kDcpMetadataFileName; }

  Result<std::vector<std::string>> LayOutFiles(Store& store, std::string_view path,
                                               CheckpointMetadata* md) const override {
    md->checksum_block_bytes = 0;
    SP_ASSIGN_OR_RETURN(const std::string suffix, NameSuffix(store, path, md->save_id));
    SP_RETURN_IF_ERROR(LayoutDcpFiles(md, suffix));
    return std::vector<std::string>(md->files.size());  // items carry their own framing
  }

  std::unique_ptr<ChunkWriter> NewChunkWriter(size_t chunks, uint64_t) const override {
    return std::make_unique<DcpChunkWriter>(chunks);
  }

  // The objects become BYTE_IO items in one more file of the coordinator, or, for a Megatron
  // save, go to common.pt only (no BYTE_IO item is written for them).
  Result<std::string> PrepareCommit(Store& store, std::string_view path, int coordinator,
                                    CheckpointMetadata* md) const override {
    SP_ASSIGN_OR_RETURN(const std::string suffix, NameSuffix(store, path, md->save_id));
    std::vector<ObjectEntry> common_objects;
    if (megatron_) {
      SP_RETURN_IF_ERROR(WriteMegatronFiles(store, path, *md));
      common_objects = std::exchange(md->objects, {});
    }
    SP_ASSIGN_OR_RETURN(DcpObjectFile objects, BuildDcpObjectFile(*md, coordinator, suffix));
    SP_ASSIGN_OR_RETURN(std::string encoded, BuildDcpMetadataFile(*md, objects, path));
    if (megatron_) md->objects = std::move(common_objects);
    if (!objects.items.empty()) {
      SP_RETURN_IF_ERROR(
          WriteFileDurably(store, path, objects.name, objects.name + ".tmp", objects.bytes));
      md->files.push_back(DataFile{objects.name, 0, objects.bytes.size(), coordinator});
    }
    return encoded;
  }

  // `.metadata` unless it is the new checkpoint's; for the Megatron kind also Megatron-Core's
  // files, which would make readers take the new checkpoint for a Megatron one (and read the old
  // common.pt): they go when metadata.json is Megatron's (best effort).
  Status RemoveReplaced(Store& store, std::string_view path,
                        std::string_view committed_name) const override {
    if (committed_name != kDcpMetadataFileName) {
      const std::string metadata_path = JoinPath(path, kDcpMetadataFileName);
      if (Result<bool> exists = store.Exists(metadata_path); exists.ok() && *exists) {
        SP_RETURN_IF_ERROR(store.RemoveFile(metadata_path));
        SP_RETURN_IF_ERROR(store.SyncDir(path));
      }
    }
    if (megatron_) RemoveMegatronFiles(store, path);
    return OkStatus();
  }

  bool OwnsFile(std::string_view name) const override {
    return (name.starts_with("__") &&
            (name.ends_with(".distcp") || name.ends_with(".distcp.tmp"))) ||
           name.starts_with(std::string(kDcpMetadataFileName) + ".tmp-");
  }

 private:
  static void RemoveMegatronFiles(Store& store, std::string_view path) {
    const std::string config_path = JoinPath(path, kMegatronConfigFileName);
    Result<std::unique_ptr<ReadableFile>> file = store.OpenReadable(config_path);
    if (!file.ok() || (*file)->size() > kMaxMegatronConfigBytes) return;
    std::string text((*file)->size(), '\0');
    MutableByteView out(reinterpret_cast<std::byte*>(text.data()), text.size());
    if (!(*file)->ReadAt(0, out).ok() || !ParseMegatronConfig(text, config_path).ok()) return;
    store.RemoveFile(config_path).IgnoreError();
    store.RemoveFile(JoinPath(path, kMegatronCommonFileName)).IgnoreError();
  }

  const bool megatron_;
};

}  // namespace

std::unique_ptr<CheckpointWriter> MakeDcpCheckpointWriter(bool megatron) {
  return std::make_unique<DcpCheckpointWriter>(megatron);
}

}  // namespace sp::torch_dcp
