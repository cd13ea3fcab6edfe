#include "shardpoint/store/posix_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace sp {
namespace {

// The most one pread / pwrite call is asked to move (Linux caps a single transfer near 2 GiB).
constexpr size_t kMaxTransfer = size_t{1} << 30;
constexpr size_t kMaxIovecs = 1024;  // IOV_MAX on Linux

// Where a scatter read through several preadv calls stands in its pieces: the first piece not yet
// read completely and the bytes of it already read. A transfer that stops inside a piece resumes
// there.
class ScatterCursor {
 public:
  explicit ScatterCursor(std::span<const MutableByteView> pieces) : pieces_(pieces) {}

  bool done() const { return next_ >= pieces_.size(); }
  // The iovecs of the next transfer (at most kMaxIovecs pieces, kMaxTransfer bytes); empty when
  // only empty pieces remain.
  const std::vector<iovec>& Next() {
    iov_.clear();
    size_t batch = 0;
    for (size_t i = next_; i < pieces_.size() && iov_.size() < kMaxIovecs && batch < kMaxTransfer;
         ++i) {
      const size_t skip = i == next_ ? done_in_ : 0;
      const size_t len = std::min(pieces_[i].size() - skip, kMaxTransfer - batch);
      if (len == 0) continue;
      iov_.push_back(iovec{pieces_[i].data() + skip, len});
      batch += len;
    }
    return iov_;
  }
  // `n` more bytes arrived.
  void Advance(size_t n) {
    while (next_ < pieces_.size() && n >= pieces_[next_].size() - done_in_) {
      n -= pieces_[next_].size() - done_in_;
      done_in_ = 0;
      ++next_;
    }
    done_in_ += n;
  }

 private:
  std::span<const MutableByteView> pieces_;
  std::vector<iovec> iov_;
  size_t next_ = 0;
  size_t done_in_ = 0;
};

Status ClosedError(std::string_view op, std::string_view path) {
  return FailedPreconditionError(OpOn(op, path) + ": the file is already closed");
}

// The alignment O_DIRECT requests on `fd` need: what statx reports (Linux 6.1+: the larger of
// the memory and the offset alignment; 0 when the file system has no direct I/O for this file),
// else 4096, which covers the logical block sizes of common devices.
uint64_t DirectIoAlignment(int fd) {
#ifdef STATX_DIOALIGN
  struct statx stx;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
    if (stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0) return 0;
    return std::max<uint64_t>(stx.stx_dio_mem_align, stx.stx_dio_offset_align);
  }
#endif
  return 4096;
}

// The first unsigned number in file `path`, or 0.
uint64_t ReadNumberFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[32] = {};
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  return n > 0 ? std::strtoull(text, nullptr, 10) : 0;
}

// The limits of the block device that holds the open file `fd` (nothing for file systems without
// one: tmpfs, network file systems).
BlockQueueLimits QueueLimitsOf(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || major(st.st_dev) == 0) return {};
  return ReadBlockQueueLimits("/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                              std::to_string(minor(st.st_dev)));
}

// A second descriptor of the open file `fd` with O_DIRECT and `access` (O_RDONLY, O_WRONLY),
// reopened through /proc/self/fd so that it is the same inode even if the path was replaced
// since; -1 where the file system has no direct I/O for it (EINVAL: tmpfs) or there is no /proc.
// *alignment: what requests on it must be aligned to.
int ReopenDirect(int fd, int access, uint64_t* alignment) {
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  int direct;
  do {
    direct = ::open(self.c_str(), access | O_CLOEXEC | O_DIRECT);
  } while (direct < 0 && errno == EINTR);
  if (direct < 0) return -1;
  *alignment = DirectIoAlignment(direct);
  if (*alignment == 0) {
    ::close(direct);
    return -1;
  }
  return direct;
}

// kFailedPrecondition unless a direct `op` ("read", "write") of `size` bytes at `offset` from
// or into `data` is aligned to `a`.
Status CheckAligned(std::string_view op, const std::string& path, uint64_t offset, uint64_t size,
                    const void* data, uint64_t a) {
  if (offset % a == 0 && size % a == 0 && reinterpret_cast<uintptr_t>(data) % a == 0) {
    return OkStatus();
  }
  return FailedPreconditionError(OpAt(op, path, offset) + ": a direct " + std::string(op) +
                                 " of " + std::to_string(size) + " bytes is not aligned to " +
                                 std::to_string(a) + " bytes");
}

// Writes all of `data` at `offset` of `fd`; errors name the path and the offset (and `how`).
Status WriteAll(int fd, uint64_t offset, ByteView data, const std::string& path,
                std::string_view how = "") {
  while (!data.empty()) {
    size_t want = std::min(data.size(), kMaxTransfer);
    ssize_t n = ::pwrite(fd, data.data(), want, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, OpAt("write", path, offset) + std::string(how));
    }
    if (n == 0) return InternalError(OpAt("write", path, offset) + ": pwrite wrote 0 bytes");
    data = data.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return OkStatus();
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
  }

  Status WriteAt(uint64_t offset, ByteView data) override {
    if (fd_ < 0) return ClosedError("write", path_);
    return WriteAll(fd_, offset, data, path_);
  }

  // A second descriptor with O_DIRECT, made on the first use (as for reads); buffered writes keep
  // the first one. Both reach the same inode, so Sync makes either kind durable.
  uint64_t direct_io_alignment() const override {
    std::call_once(direct_once_, [this] {
      if (fd_ >= 0) direct_fd_ = ReopenDirect(fd_, O_WRONLY, &direct_alignment_);
      if (direct_fd_ < 0) direct_alignment_ = 0;
    });
    return direct_alignment_;
  }

  Status WriteDirectAt(uint64_t offset, ByteView data) override {
    if (fd_ < 0) return ClosedError("write", path_);
    const uint64_t a = direct_io_alignment();
    if (a == 0) return WritableFile::WriteDirectAt(offset, data);
    SP_RETURN_IF_ERROR(CheckAligned("write", path_, offset, data.size(), data.data(), a));
    return WriteAll(direct_fd_, offset, data, path_, " (direct I/O)");
  }

  Status Sync() override {
    if (fd_ < 0) return ClosedError("sync", path_);
    while (::fdatasync(fd_) != 0) {
      if (errno != EINTR) return ErrnoToStatus(errno, OpOn("sync", path_));
    }
    return OkStatus();
  }

  Status Close() override {
    if (fd_ < 0) return ClosedError("close", path_);
    if (direct_fd_ >= 0) ::close(std::exchange(direct_fd_, -1));
    int fd = std::exchange(fd_, -1);
    // Linux releases the descriptor even when close fails (EINTR included): never retry.
    if (::close(fd) != 0) return ErrnoToStatus(errno, OpOn("close", path_));
    return OkStatus();
  }

  Status Preallocate(uint64_t size) override {
    if (fd_ < 0) return ClosedError("preallocate", path_);
    if (size == 0) return OkStatus();
    int error = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
    while (error == EINTR) error = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
    // File systems without fallocate support report EOPNOTSUPP or EINVAL: reserving is a hint.
    if (error == 0 || error == EOPNOTSUPP || error == EINVAL) return OkStatus();
    return ErrnoToStatus(error, OpOn("preallocate", path_) + " to " + std::to_string(size) + " bytes");
  }

  void StartWriteback(uint64_t offset, uint64_t length) override {
    // A hint: errors surface, if at all, from the Sync that follows.
    if (fd_ >= 0) ::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(length),
                                    SYNC_FILE_RANGE_WRITE);
  }

  const std::string& path() const override { return path_; }

 private:
  int fd_;
  std::string path_;
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
  mutable uint64_t direct_alignment_ = 0;
};

// Pages whose residency CachedFraction checks one by one (16 MiB of 4 KiB pages); larger ranges
// are sampled, as many pages in windows of 16 spread evenly. A load asks before its first read,
// for every file it reads: for the five cold files of a 1 GiB checkpoint that took 1.5 ms, and
// 9.0 ms page by page (`checkpoint_bench`, "residency check"). The fraction of 4,096 pages is
// within a few percent of the whole's, and the decision it feeds (kColdFraction,
// engine/read_executor.h) is at a half.
constexpr uint64_t kCachedFractionPages = uint64_t{1} << 12;

class PosixReadableFile : public ReadableFile {
 public:
  PosixReadableFile(int fd, std::string path, uint64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}
  ~PosixReadableFile() override {
    ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
  }

  // A second descriptor of the same open file with O_DIRECT (reopened through /proc/self/fd, so
  // it is the same inode even if the path was replaced since), made on the first use; buffered
  // reads keep the first one.
  uint64_t direct_io_alignment() const override {
    std::call_once(direct_once_, [this] {
      direct_fd_ = ReopenDirect(fd_, O_RDONLY, &direct_alignment_);
      if (direct_fd_ < 0) direct_alignment_ = 0;
    });
    return direct_alignment_;
  }

  bool small_pages_shorten_requests() const override {
    std::call_once(limits_once_, [this] { limits_ = QueueLimitsOf(fd_); });
    return limits_.small_pages_shorten_requests();
  }

  Result<uint64_t> ReadDirectVAt(uint64_t offset,
                                 std::span<const MutableByteView> pieces) const override {
    const uint64_t a = direct_io_alignment();
    if (a == 0) return ReadableFile::ReadDirectVAt(offset, pieces);
    uint64_t at = offset;
    for (const MutableByteView& piece : pieces) {
      SP_RETURN_IF_ERROR(CheckAligned("read", path_, at, piece.size(), piece.data(), a));
      at += piece.size();
    }
    // One preadv per kMaxIovecs pieces; every transfer but the one at the end of the file moves
    // whole aligned blocks, so the next one resumes aligned, inside the piece it stopped in.
    uint64_t done = 0;
    ScatterCursor cursor(pieces);
    while (!cursor.done()) {
      const std::vector<iovec>& iov = cursor.Next();
      if (iov.empty()) break;  // only empty pieces remain
      ssize_t n = ::preadv(direct_fd_, iov.data(), static_cast<int>(iov.size()),
                           static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, OpAt("read", path_, offset + done) + " (direct I/O)");
      }
      done += static_cast<uint64_t>(n);
      // The end of the file: nothing more, or a tail shorter than the alignment.
      if (n == 0 || static_cast<uint64_t>(n) % a != 0) break;
      cursor.Advance(static_cast<size_t>(n));
    }
    return done;
  }

  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    const uint64_t start = offset;
    const size_t wanted = out.size();
    while (!out.empty()) {
      size_t want = std::min(out.size(), kMaxTransfer);
      ssize_t n = ::pread(fd_, out.data(), want, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, OpAt("read", path_, offset));
      }
      if (n == 0) return ShortRead(start, wanted);
      out = out.subspan(static_cast<size_t>(n));
      offset += static_cast<uint64_t>(n);
    }
    return OkStatus();
  }

  Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
    const uint64_t start = offset;
    uint64_t wanted = 0;
    for (const MutableByteView& piece : pieces) wanted += piece.size();
    // One preadv per kMaxIovecs pieces; a short transfer resumes inside the piece it stopped in.
    ScatterCursor cursor(pieces);
    while (!cursor.done()) {
      const std::vector<iovec>& iov = cursor.Next();
      if (iov.empty()) break;  // only empty pieces remain
      ssize_t n = ::preadv(fd_, iov.data(), static_cast<int>(iov.size()), static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, OpAt("read", path_, offset));
      }
      if (n == 0) return ShortRead(start, wanted);
      offset += static_cast<uint64_t>(n);
      cursor.Advance(static_cast<size_t>(n));
    }
    return OkStatus();
  }

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }

  // Within what Linux starts at once for one WILLNEED call (the read-ahead window, and at least
  // the device's largest request), so that no part of a hint is dropped.
  static constexpr uint64_t kHintBytes = uint64_t{2} << 20;

  void Prefetch(uint64_t offset, uint64_t length) const override {
    // Linux starts read-ahead for at most one read-ahead window (read_ahead_kb, at least the
    // device's largest request) per WILLNEED call and drops the rest of the range, so a long
    // range is hinted in pieces.
    const uint64_t end = offset + length;
    for (uint64_t at = offset; at < end; at += kHintBytes) {
      ::posix_fadvise(fd_, static_cast<off_t>(at), static_cast<off_t>(std::min(kHintBytes, end - at)),
                      POSIX_FADV_WILLNEED);
    }
  }

  // mincore() over a shared read-only mapping of the range (mapping touches no page): exact up to
  // kCachedFractionPages pages, beyond that as many pages in windows of 16 spread evenly.
  std::optional<double> CachedFraction(uint64_t offset, uint64_t length) const override {
    if (length == 0 || offset >= size_) return std::nullopt;
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t begin = offset / page * page;
    const uint64_t end = offset + std::min(length, size_ - offset);
    void* map = ::mmap(nullptr, end - begin, PROT_READ, MAP_SHARED, fd_, static_cast<off_t>(begin));
    if (map == MAP_FAILED) return std::nullopt;
    const uint64_t pages = (end - begin + page - 1) / page;
    constexpr uint64_t kWindow = 16;
    const uint64_t windows = pages <= kCachedFractionPages ? 1 : kCachedFractionPages / kWindow;
    const uint64_t window_pages = windows == 1 ? pages : kWindow;
    std::vector<unsigned char> resident(window_pages);
    uint64_t probed = 0, cached = 0;
    bool ok = true;
    for (uint64_t w = 0; w < windows && ok; ++w) {
      const uint64_t first = windows == 1 ? 0 : w * (pages - kWindow) / (windows - 1);
      const uint64_t count = std::min(window_pages, pages - first);
      ok = ::mincore(static_cast<char*>(map) + first * page, count * page, resident.data()) == 0;
      for (uint64_t i = 0; ok && i < count; ++i) cached += resident[i] & 1;
      probed += count;
    }
    ::munmap(map, end - begin);
    if (!ok || probed == 0) return std::nullopt;
    return static_cast<double>(cached) / static_cast<double>(probed);
  }

  Status DropCache() override {
    int error = ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
    if (error != 0) return ErrnoToStatus(error, OpOn("drop cache of", path_));
    return OkStatus();
  }

 private:
  Status ShortRead(uint64_t offset, size_t wanted) const {
    struct stat st;
    uint64_t now = ::fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : size_;
    return DataLossError(OpAt("read", path_, offset) + ": wanted " + std::to_string(wanted) +
                         " bytes but the file holds " + std::to_string(now) + " bytes");
  }

  int fd_;
  std::string path_;
  uint64_t size_;
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
  mutable uint64_t direct_alignment_ = 0;
  mutable std::once_flag limits_once_;
  mutable BlockQueueLimits limits_;
};

// mkdir of one component; OK when a directory is already there.
Status MakeOneDir(const std::string& dir, std::string_view full_path) {
  if (::mkdir(dir.c_str(), 0755) == 0) return OkStatus();
  int error = errno;
  if (error != EEXIST) return ErrnoToStatus(error, OpOn("create directory", dir));
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoToStatus(errno, OpOn("create directory", dir));
  if (!S_ISDIR(st.st_mode)) {
    return FailedPreconditionError(OpOn("create directory", full_path) + ": " + dir +
                                   " exists and is not a directory");
  }
  return OkStatus();
}

// What a file that is not a regular file is, for messages.
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

Status NotRegularError(std::string_view path, mode_t mode) {
  return DataLossError(OpOn("open", path) + ": it is " + FileKind(mode) +
                       ", not a regular file; checkpoint files must be regular files");
}

// realpath(3) of `path` ("" is the working directory).
Result<std::string> RealPath(std::string_view path) {
  std::string p(path.empty() ? "." : path);
  char* resolved = ::realpath(p.c_str(), nullptr);
  if (resolved == nullptr) return ErrnoToStatus(errno, OpOn("resolve", path));
  std::string out(resolved);
  std::free(resolved);
  return out;
}

bool IsInside(const std::string& root, const std::string& target) {
  if (root == "/") return target.size() > 1 && target.front() == '/';
  return target.size() > root.size() && target.compare(0, root.size(), root) == 0 &&
         target[root.size()] == '/';
}

}  // namespace

BlockQueueLimits ReadBlockQueueLimits(const std::string& dir) {
  for (const char* queue : {"/queue/", "/../queue/"}) {
    BlockQueueLimits limits;
    limits.max_segments = ReadNumberFile(dir + queue + "max_segments");
    limits.max_request_bytes = ReadNumberFile(dir + queue + "max_sectors_kb") * 1024;
    if (limits.max_segments > 0 || limits.max_request_bytes > 0) return limits;
  }
  return {};
}

Result<std::unique_ptr<WritableFile>> PosixStore::NewWritableFile(std::string_view path) {
  std::string p(path);
  int fd;
  do {
    fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoToStatus(errno, OpOn("create", path));
  return std::unique_ptr<WritableFile>(std::make_unique<PosixWritableFile>(fd, std::move(p)));
}

Result<std::unique_ptr<ReadableFile>> PosixStore::OpenReadable(std::string_view path) {
  std::string p(path);
  int fd;
  do {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
    fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int error = errno;
    struct stat st;
    if (error == ENXIO && ::stat(p.c_str(), &st) == 0) return NotRegularError(path, st.st_mode);
    return ErrnoToStatus(error, OpOn("open", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int error = errno;
    ::close(fd);
    return ErrnoToStatus(error, OpOn("stat", path));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return ErrnoToStatus(EISDIR, OpOn("open", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return NotRegularError(path, st.st_mode);
  }
  // Regular files ignore O_NONBLOCK; it is cleared so that reads are plainly blocking.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int error = errno;
    ::close(fd);
    return ErrnoToStatus(error, OpOn("open", path));
  }
  return std::unique_ptr<ReadableFile>(
      std::make_unique<PosixReadableFile>(fd, std::move(p), static_cast<uint64_t>(st.st_size)));
}

Result<std::unique_ptr<ReadableFile>> PosixStore::OpenInDirectory(std::string_view dir,
                                                                  std::string_view name) {
  const std::string path = JoinPath(dir, name);
  if (!name.empty() && !options_.allow_external_links) {
    SP_ASSIGN_OR_RETURN(LinkInfo link, FindLink(dir, name));
    if (!link.inside) {
      return FailedPreconditionError(
          OpOn("open", path) + ": it is a symbolic link (or lies below one) to " + link.target +
          ", outside the checkpoint directory " + std::string(dir) +
          "; links out of a checkpoint are refused unless external links are allowed "
          "(allow_external_links=True, --allow-external-links)");
    }
  }
  return OpenReadable(path);
}

Result<LinkInfo> PosixStore::FindLink(std::string_view dir, std::string_view name) {
  LinkInfo info;
  if (name.empty()) return info;
  size_t pos = 0;
  while (pos <= name.size() && !info.through_link) {
    size_t end = name.find('/', pos);
    if (end == std::string_view::npos) end = name.size();
    const std::string prefix = JoinPath(dir, name.substr(0, end));
    struct stat st;
    if (::lstat(prefix.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return info;  // missing: the open reports it
      return ErrnoToStatus(errno, OpOn("stat", prefix));
    }
    info.through_link = S_ISLNK(st.st_mode);
    pos = end + 1;
  }
  if (!info.through_link) return info;
  SP_ASSIGN_OR_RETURN(std::string root, RealPath(dir));
  Result<std::string> target = RealPath(JoinPath(dir, name));
  if (!target.ok()) {
    // A dangling link: name where it points; the open reports the missing file.
    char buffer[PATH_MAX];
    const std::string path = JoinPath(dir, name);
    const ssize_t n = ::readlink(path.c_str(), buffer, sizeof(buffer));
    info.target = n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string("?");
    return info;
  }
  info.target = *target;
  info.inside = IsInside(root, info.target);
  return info;
}

Result<bool> PosixStore::SameFile(std::string_view a, std::string_view b) {
  std::string pa(a.empty() ? "." : a), pb(b.empty() ? "." : b);
  struct stat sa, sb;
  if (::stat(pa.c_str(), &sa) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoToStatus(errno, OpOn("stat", a));
  }
  if (::stat(pb.c_str(), &sb) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoToStatus(errno, OpOn("stat", b));
  }
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

Status PosixStore::CreateDirs(std::string_view path) {
  std::string normal = NormalizePath(path);
  size_t pos = (!normal.empty() && normal.front() == '/') ? 1 : 0;
  while (pos < normal.size()) {
    size_t end = normal.find('/', pos);
    if (end == std::string::npos) end = normal.size();
    SP_RETURN_IF_ERROR(MakeOneDir(normal.substr(0, end), path));
    pos = end + 1;
  }
  return OkStatus();
}

Status PosixStore::Rename(std::string_view from, std::string_view to) {
  std::string f(from), t(to);
  if (::rename(f.c_str(), t.c_str()) != 0) {
    return ErrnoToStatus(errno, "rename " + f + " to " + t);
  }
  return OkStatus();
}

// kAbsent only: the bytes go to a unique temporary beside `path`, synced, then link(2) gives it
// the name, which fails (EEXIST) when anything is there, atomically on every POSIX file system.
Status PosixStore::WriteFileIf(std::string_view path, std::string_view bytes,
                               const FileCondition& condition) {
  if (condition.kind != FileCondition::Kind::kAbsent) {
    return UnimplementedError(OpOn("conditional write", path) +
                              ": files have no version to match on a POSIX file system");
  }
  static std::atomic<uint64_t> next{0};
  const std::string target(path);
  const std::string temp = target + ".tmp-link-" + std::to_string(::getpid()) + "-" +
                           std::to_string(next.fetch_add(1));
  SP_RETURN_IF_ERROR(WriteSyncedFile(*this, temp, bytes));
  const int linked = ::link(temp.c_str(), target.c_str());
  const int error = errno;
  RemoveFile(temp).IgnoreError();
  if (linked == 0) return OkStatus();
  if (error == EPERM || error == EOPNOTSUPP || error == ENOSYS || error == EMLINK) {
    // A file system without hard links (FAT, some FUSE and network file systems).
    return UnimplementedError(OpOn("conditional write", path) +
                              ": the file system does not link files (" + std::strerror(error) +
                              ")");
  }
  if (error == EEXIST) {
    Result<std::string> held = ReadFile(target);
    if (held.ok() && *held == bytes) return OkStatus();
    return AlreadyExistsError(OpOn("write", path) +
                              ": a file is already there (another writer created it first)");
  }
  return ErrnoToStatus(error, "link " + temp + " to " + target);
}

Status PosixStore::SyncDir(std::string_view path) {
  std::string p(path.empty() ? "." : path);
  int fd;
  do {
    fd = ::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoToStatus(errno, OpOn("sync directory", path));
  Status status;
  while (::fsync(fd) != 0) {
    if (errno != EINTR) {
      status = ErrnoToStatus(errno, OpOn("sync directory", path));
      break;
    }
  }
  ::close(fd);
  return status;
}

Status PosixStore::RemoveFile(std::string_view path) {
  std::string p(path);
  if (::unlink(p.c_str()) != 0) return ErrnoToStatus(errno, OpOn("remove", path));
  return OkStatus();
}

Status PosixStore::RemoveDir(std::string_view path) {
  std::string p(path);
  if (::rmdir(p.c_str()) == 0) return OkStatus();
  int error = errno;
  Status status = ErrnoToStatus(error, OpOn("remove directory", path));
  if (error == ENOTEMPTY || error == EEXIST) {
    return FailedPreconditionError(status.message());
  }
  return status;
}

Result<bool> PosixStore::IsDirectory(std::string_view path) {
  std::string p(path);
  struct stat st;
  if (::stat(p.c_str(), &st) != 0) return ErrnoToStatus(errno, OpOn("stat", path));
  return S_ISDIR(st.st_mode);
}

Result<bool> PosixStore::Exists(std::string_view path) {
  std::string p(path);
  struct stat st;
  if (::stat(p.c_str(), &st) == 0) return true;
  if (errno == ENOENT || errno == ENOTDIR) return false;
  return ErrnoToStatus(errno, OpOn("stat", path));
}

Result<std::vector<DirEntry>> PosixStore::ListDir(std::string_view path) {
  std::string p(path.empty() ? "." : path);
  DIR* dir = ::opendir(p.c_str());  // glibc opens the descriptor with O_CLOEXEC
  if (dir == nullptr) return ErrnoToStatus(errno, OpOn("list directory", path));
  std::vector<DirEntry> entries;
  Status status;
  while (true) {
    errno = 0;
    struct dirent* ent = ::readdir(dir);
    if (ent == nullptr) {
      if (errno != 0) status = ErrnoToStatus(errno, OpOn("list directory", path));
      break;
    }
    std::string_view name(ent->d_name);
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(::dirfd(dir), ent->d_name, &st, 0) != 0) {
      if (errno == ENOENT) continue;  // removed while listing
      status = ErrnoToStatus(errno, OpOn("stat", JoinPath(path, name)));
      break;
    }
    DirEntry entry;
    entry.name = std::string(name);
    entry.is_directory = S_ISDIR(st.st_mode);
    entry.size = entry.is_directory ? 0 : static_cast<uint64_t>(st.st_size);
    entries.push_back(std::move(entry));
  }
  ::closedir(dir);
  SP_RETURN_IF_ERROR(status);
  std::sort(entries.begin(), entries.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return entries;
}

}  // namespace sp
