// DirectWriteFile: a WritableFile whose large writes bypass the page cache.
//
// A save writes each byte once and does not read it back, so staging it in the page cache only
// costs: the kernel copies it there, must write it back before the final fdatasync, and keeps
// memory busy that the training job wants. O_DIRECT needs the offset, the length and the memory
// of every write aligned (ReadableFile::direct_io_alignment, typically 512 or 4096 bytes), and a
// checkpoint packs its chunks back to back at any offset from caller memory at any address. So a
// write of at least `min_bytes` is cut in three: the whole aligned blocks inside it are copied
// into aligned staging buffers (from `staging`, at most `piece_bytes` at a time) and written
// directly; the partial blocks at its two ends go through the page cache (ordinary WriteAt).
// Two writes never share a whole block, so no block is written both ways. Smaller writes, and
// files the store cannot write directly (direct_io_alignment() 0: tmpfs, a store without it),
// are ordinary writes. Sync makes both kinds durable.
//
// Thread-safe for disjoint ranges, as WritableFile.
#ifndef SHARDPOINT_ENGINE_DIRECT_WRITE_H_
#define SHARDPOINT_ENGINE_DIRECT_WRITE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "shardpoint/exec/buffer_pool.h"
#include "shardpoint/store/store.h"

namespace sp {

class DirectWriteFile final : public WritableFile {
 public:
  DirectWriteFile(std::unique_ptr<WritableFile> base, BufferPool& staging, uint64_t min_bytes,
                  uint64_t piece_bytes = uint64_t{4} << 20);

  Status WriteAt(uint64_t offset, ByteView data) override;
  Status Sync() override { return base_->Sync(); }
  Status Close() override { return base_->Close(); }
  const std::string& path() const override { return base_->path(); }
  Status Preallocate(uint64_t size) override { return base_->Preallocate(size); }
  void StartWriteback(uint64_t offset, uint64_t length) override {
    base_->StartWriteback(offset, length);
  }
  uint64_t direct_io_alignment() const override { return base_->direct_io_alignment(); }
  Status WriteDirectAt(uint64_t offset, ByteView data) override {
    return base_->WriteDirectAt(offset, data);
  }

  // Bytes written directly so far.
  uint64_t direct_bytes() const { return direct_bytes_.load(); }

 private:
  std::unique_ptr<WritableFile> base_;
  BufferPool& staging_;
  uint64_t min_bytes_;
  uint64_t piece_bytes_;
  std::atomic<uint64_t> direct_bytes_{0};
};

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_DIRECT_WRITE_H_
