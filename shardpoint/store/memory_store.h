// MemoryStore: an in-memory file system with directories, for tests and tools.
//
// It follows PosixStore's semantics and reports the same status codes (its errors are built by
// ErrnoToStatus from the errno a POSIX file system would give): NewWritableFile needs the parent
// directory and truncates an existing file in place; Rename replaces a file at the destination
// atomically and moves whole directories; an open handle stays attached to its file across a
// rename or a removal, like a file descriptor to its inode. Nothing is ever lost: Sync and SyncDir
// only check their target; use FaultStore on top to model crashes.
//
// Paths: "/a//b/" and "a/b" name the same entry (see NormalizePath); the root always exists and is
// a directory; ".." is not resolved. All methods are thread-safe; WriteAt and ReadAt may run from
// several threads on the same file (each copy holds that file's lock).
#ifndef SHARDPOINT_STORE_MEMORY_STORE_H_
#define SHARDPOINT_STORE_MEMORY_STORE_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/store/store.h"

namespace sp {

class MemoryStore : public Store {
 public:
  MemoryStore() = default;
  ~MemoryStore() override;

  MemoryStore(const MemoryStore&) = delete;
  MemoryStore& operator=(const MemoryStore&) = delete;

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override;
  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override;
  Status CreateDirs(std::string_view path) override;
  Status Rename(std::string_view from, std::string_view to) override;
  Status SyncDir(std::string_view path) override;
  Status RemoveFile(std::string_view path) override;
  Status RemoveDir(std::string_view path) override;
  Result<bool> IsDirectory(std::string_view path) override;
  Result<bool> Exists(std::string_view path) override;
  Result<std::vector<DirEntry>> ListDir(std::string_view path) override;
  std::string name() const override { return "memory"; }

  // Bytes held by all files (for tests of bounded memory).
  uint64_t TotalFileBytes() const;

  // The contents of one file, shared with the handles open on it.
  struct FileData;

 private:
  struct Node {
    bool is_directory = false;
    std::shared_ptr<FileData> file;  // null for directories
  };

  // All take mu_ held. Keys are normalized paths without a leading '/'; the root is "".
  const Node* Find(const std::string& key) const;
  // 0 when the parent of `key` is a directory, else ENOENT or ENOTDIR.
  int ParentError(const std::string& key) const;
  bool HasChildren(const std::string& key) const;
  Status RenameDirectory(const std::string& from, const std::string& to, std::string_view what);

  mutable std::mutex mu_;
  std::map<std::string, Node> nodes_;
};

}  // namespace sp

#endif  // SHARDPOINT_STORE_MEMORY_STORE_H_
