// PosixStore: a Store over the local (or a network-mounted) POSIX file system.
//
// Paths are file system paths, used as given (relative paths resolve against the working
// directory). Files are opened with O_CLOEXEC. WriteAt / ReadAt use pwrite / pread, retry on EINTR
// and loop over short transfers, so a single call moves all its bytes or fails; they may be called
// from several threads at once on disjoint ranges of the same file. Sync is fdatasync; SyncDir
// opens the directory (O_RDONLY | O_DIRECTORY) and fsyncs it; Rename is rename(2), atomic within
// one file system. Every error comes from ErrnoToStatus and names the operation, the path and,
// for data transfers, the offset: "write /ckpt/d-0.safetensors at offset 4096: No space left on
// device (errno 28)".
//
// Reads open only regular files: the file is opened with O_NONBLOCK (so that a FIFO standing in
// for a checkpoint file cannot block the reader) and anything fstat does not call a regular file
// (a FIFO, a socket, a device, a directory) is refused with an error naming the path and what
// it is.
//
// Symbolic links (docs/FORMAT.md, "Symbolic links"): OpenInDirectory refuses a file that a link
// leads out of its checkpoint directory, unless the store is made with allow_external_links. The
// checkpoint directory itself may be a link (latest -> step_100), and links that stay inside it
// are followed.
//
// A PosixStore holds only its options; all methods are thread-safe.
#ifndef SHARDPOINT_STORE_POSIX_STORE_H_
#define SHARDPOINT_STORE_POSIX_STORE_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/store/store.h"

namespace sp {

struct PosixStoreOptions {
  // Open files of a checkpoint that symbolic links lead outside its directory.
  bool allow_external_links = false;
};

// What a block device's request queue takes (Linux sysfs, `<dir>/queue/max_segments` and
// `max_sectors_kb`; a partition's are its disk's, `<dir>/../queue`): the most segments (runs of
// physically contiguous memory) and the most bytes one request carries. 0 where unknown.
struct BlockQueueLimits {
  uint64_t max_segments = 0;
  uint64_t max_request_bytes = 0;

  // A request into 4 KiB pages that are not contiguous is cut at max_segments pages, before its
  // largest size.
  bool small_pages_shorten_requests() const {
    return max_segments > 0 && max_request_bytes > 0 && max_segments * 4096 < max_request_bytes;
  }
};
// The limits of the block device directory `dir` (/sys/dev/block/MAJOR:MINOR for the device
// that holds a file: PosixStore's readable files ask for their own).
BlockQueueLimits ReadBlockQueueLimits(const std::string& dir);

class PosixStore : public Store {
 public:
  explicit PosixStore(PosixStoreOptions options = {}) : options_(options) {}

  // Creates or truncates the file (mode 0644). kNotFound when the parent directory is missing,
  // kInvalidArgument when `path` is a directory.
  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override;
  // kNotFound when absent, kInvalidArgument when `path` is a directory, kDataLoss when it is
  // another kind of file that is not a regular file (FIFO, socket, device).
  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override;
  // kFailedPrecondition for a file that a link leads outside `dir` (see above); else as
  // OpenReadable.
  Result<std::unique_ptr<ReadableFile>> OpenInDirectory(std::string_view dir,
                                                        std::string_view name) override;
  // lstat of each component of `name` below `dir`; realpath of the file and of `dir`.
  Result<LinkInfo> FindLink(std::string_view dir, std::string_view name) override;
  bool allows_external_links() const override { return options_.allow_external_links; }
  // stat of both: the same st_dev and st_ino.
  Result<bool> SameFile(std::string_view a, std::string_view b) override;
  // FileCondition::kAbsent through link(2); kUnimplemented for kVersion.
  Status WriteFileIf(std::string_view path, std::string_view bytes,
                     const FileCondition& condition) override;
  // mkdir -p (mode 0755). kFailedPrecondition when a component exists and is not a directory.
  Status CreateDirs(std::string_view path) override;
  Status Rename(std::string_view from, std::string_view to) override;
  Status SyncDir(std::string_view path) override;
  Status RemoveFile(std::string_view path) override;
  // kFailedPrecondition when the directory is not empty.
  Status RemoveDir(std::string_view path) override;
  Result<bool> IsDirectory(std::string_view path) override;
  // false for ENOENT / ENOTDIR; other failures (EACCES, ...) are errors.
  Result<bool> Exists(std::string_view path) override;
  // Sizes and kinds come from stat (symbolic links are followed); "." and ".." are left out.
  Result<std::vector<DirEntry>> ListDir(std::string_view path) override;
  std::string name() const override { return "posix"; }

 private:
  PosixStoreOptions options_;
};

}  // namespace sp

#endif  // SHARDPOINT_STORE_POSIX_STORE_H_
