// FaultStore: wraps another Store to inject errors and to simulate a machine crash (after rocksdb's
// fault_injection_fs). For tests of the commit protocol and of error paths; not for production.
//
// Errors. FailNext(op, error, count) makes the next `count` calls of `op` fail; FailMatching(op,
// substring, error) makes every call of `op` on a path containing `substring` fail until
// ClearFaults(). A failing call does nothing to the base store (a failing Close still releases the
// base handle, as close(2) does) and returns `error`'s code with the message
// "<operation> <path>[ at offset N]: <error's message>". A one-shot fault is checked before the
// matching ones. Rename matches when either path contains the substring.
//
// Counters. count(op) is the number of calls of `op` made through this store, failed ones
// included. Store::ReadFile counts as one kOpen and one kRead. direct_reads() is the number of
// ReadableFile::ReadDirectAt calls among the kRead ones.
//
// Crash model. The store keeps a model of the directories it has used, as a tree of inodes: each
// directory holds its live entries (what the base store holds now) and its durable entries (what
// would survive a crash), and each file its durable content:
//  - file contents: a file's durable content is what it held at its last successful Sync (through
//    this store, from any handle on it); writes, truncations and Preallocate after that are not
//    durable. A file created through this store and never synced has empty durable content. The
//    content belongs to the file, not to its name: it follows the file across renames.
//  - directory entries: creating a file or a directory (CreateDirs), renaming (both the removal of
//    the source entry and the new or replaced destination entry) and removing are durable only
//    after a successful SyncDir of the directory that holds the entry. SyncDir(d) makes the
//    current entries of d durable, and only those of d (not of its subdirectories or parent).
//    The entries of a directory belong to the directory, not to its path: a renamed directory
//    takes its (durable) entries along, and an un-synced directory rename brings it back whole.
// SimulateCrash() rewrites the base store to the durable state: every directory gets back its
// durable entries (a created file whose directory was never synced disappears; an un-synced rename
// is reverted, bringing back the source and any file it replaced; an un-synced removal brings the
// file back), every surviving file gets its durable content (unsynced writes are dropped; a file
// never synced becomes empty), and an entry whose parent directory did not survive is lost with
// it. A file durable under two names after a cross-directory rename keeps both (like a hard link).
// Whatever existed in the base store before this store first touched it counts as durable; changes
// made to the base store directly, not through this store, are not modelled. After a crash every
// handle opened before it fails with kFailedPrecondition (the process that held it is gone), and
// the model starts afresh from the base store. Use either absolute or relative paths with one
// FaultStore, not both (they are modelled as two separate trees).
//
// Cost: each writable handle keeps a copy of the bytes written through it (its content at the next
// Sync); the first change to a file that existed before (truncation, rename, removal, or the
// rename of a directory holding it) reads it whole; every directory on a path used is listed once.
// A crash rewrites every file changed through this store. Use it on test-sized data.
//
// Thread-safety: all methods are thread-safe. Namespace operations are serialized by one lock;
// WriteAt and ReadAt on disjoint ranges run concurrently.
#ifndef SHARDPOINT_STORE_FAULT_STORE_H_
#define SHARDPOINT_STORE_FAULT_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/store/store.h"

namespace sp {

class FaultStore : public Store {
 public:
  enum class Op {
    kCreate,      // NewWritableFile
    kWrite,       // WritableFile::WriteAt and WritableFile::Preallocate
    kSync,        // WritableFile::Sync
    kClose,       // WritableFile::Close
    kRename,      // Rename
    kSyncDir,     // SyncDir
    kRead,        // ReadableFile::ReadAt
    kOpen,        // OpenReadable
    kRemove,      // RemoveFile and RemoveDir
    kCreateDirs,  // CreateDirs
    kList,        // ListDir
  };
  static constexpr int kNumOps = 11;
  // "create", "write", ...
  static std::string_view OpName(Op op);

  // `base` is borrowed and must outlive this store.
  explicit FaultStore(Store* base);
  ~FaultStore() override;

  FaultStore(const FaultStore&) = delete;
  FaultStore& operator=(const FaultStore&) = delete;

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
  // "fault(<base name>)".
  std::string name() const override;

  // The next `count` calls of `op` fail with `error` (which must not be OK). Replaces a pending
  // one-shot fault of the same op.
  void FailNext(Op op, Status error, int count = 1);
  // Every call of `op` on a path containing `path_substring` fails with `error`.
  void FailMatching(Op op, std::string path_substring, Status error);
  // Removes every pending fault.
  void ClearFaults();

  // Rewrites the base store to the durable state described above. Returns an error only when the
  // base store fails while being rewritten.
  Status SimulateCrash();

  int64_t count(Op op) const;
  int64_t direct_reads() const { return direct_reads_.load(); }
  void ResetCounts();

  // Defined in fault_store.cc.
  struct Inode;     // a file
  struct DirInode;  // a directory
  class WritableHandle;
  class ReadableHandle;
  // A directory entry: exactly one of the two is set.
  struct Entry {
    std::shared_ptr<Inode> file;
    std::shared_ptr<DirInode> dir;
  };

 private:
  struct Located {  // an entry's place: its parent directory and its name there
    DirInode* parent;
    std::string name;
  };
  struct MatchFault {
    Op op;
    std::string substring;
    Status error;
  };

  // Counts the call and returns the injected error for it, if any; `what` names the operation.
  Status CheckFault(Op op, std::string_view path, std::string_view other_path,
                    const std::string& what);
  // The following take mu_ held; `normal` is a NormalizePath result.
  Status Load(DirInode* dir, const std::string& path);
  Result<DirInode*> FindDir(const std::string& normal);
  Result<std::optional<Located>> Locate(const std::string& normal);
  Status Capture(Inode* file, const std::string& path);
  Status CaptureTree(DirInode* dir, const std::string& path);
  Status RecordCreatedDirs(const std::string& normal);
  Status RemoveLive(DirInode* dir, const std::string& path, bool whole);
  Status BuildDurable(DirInode* dir, const std::string& path, bool fresh);
  void RecordSync(const std::shared_ptr<Inode>& file, std::string content);
  uint64_t epoch() const { return epoch_.load(); }

  Store* base_;
  std::array<std::atomic<int64_t>, kNumOps> counts_{};
  std::atomic<int64_t> direct_reads_{0};

  std::mutex fault_mu_;
  std::array<std::pair<Status, int>, kNumOps> next_faults_;  // error, calls left
  std::vector<MatchFault> matching_faults_;

  std::mutex mu_;  // guards the trees below and every Inode / DirInode
  std::shared_ptr<DirInode> absolute_root_;  // "/..."
  std::shared_ptr<DirInode> relative_root_;  // "a/b", relative to the working directory
  std::atomic<uint64_t> epoch_{0};           // bumped by SimulateCrash
};

}  // namespace sp

#endif  // SHARDPOINT_STORE_FAULT_STORE_H_
