// Store: the file-system operations a checkpoint needs, behind one interface.
//
// Implementations: PosixStore (local and network file systems), MemoryStore (tests, tools),
// FaultStore (wraps another store; injects errors and drops unsynced data to simulate a crash).
// Paths are '/'-separated strings; a store interprets them as it likes (PosixStore: file system
// paths; MemoryStore: keys). All methods are thread-safe. Files returned by a store are used by
// one owner, but WriteAt / ReadAt on disjoint ranges may be called from several threads at once.
//
// Every error names the path and the operation ("write /ckpt/d-0.safetensors at offset 4096:
// No space left on device (errno 28)").
#ifndef SHARDPOINT_STORE_STORE_H_
#define SHARDPOINT_STORE_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"

namespace sp {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all of `data` at `offset`. Thread-safe for disjoint ranges.
  virtual Status WriteAt(uint64_t offset, ByteView data) = 0;
  // Makes every byte written so far durable (fdatasync).
  virtual Status Sync() = 0;
  // Releases the handle. Further calls fail. Destruction without Close closes silently.
  virtual Status Close() = 0;
  virtual const std::string& path() const = 0;
  // Reserves storage for the first `size` bytes so that later writes in that range do not fail for
  // lack of space. The file may grow to `size` bytes at once (unwritten bytes read as zeros); it
  // never shrinks. Out of space gives kResourceExhausted. The default does nothing and returns OK,
  // for stores that cannot reserve space.
  virtual Status Preallocate(uint64_t size) { return OkStatus(); }
  // A hint: start writing bytes [offset, offset + length) to the device now, without waiting, so
  // that the final Sync has less to flush and device writes overlap the caller's work. Durability
  // still comes only from Sync. The default does nothing.
  virtual void StartWriteback(uint64_t offset, uint64_t length) {}

  // Direct I/O: writes that bypass the page cache (Linux O_DIRECT), for large writes that will not
  // be read back soon. The alignment that the offset, the length and the buffer address of
  // WriteDirectAt must have, or 0 when this file cannot be written that way (decided on the first
  // call). The default: 0. Thread-safe.
  virtual uint64_t direct_io_alignment() const { return 0; }
  // Writes all of `data` at `offset` bypassing the page cache, where offset, data.size() and
  // data.data() are multiples of direct_io_alignment() (> 0); durable, like WriteAt, only after
  // Sync. Errors name the path and the offset; kFailedPrecondition when the file cannot be written
  // directly or the request is not aligned. Thread-safe for disjoint ranges, beside WriteAt.
  virtual Status WriteDirectAt(uint64_t offset, ByteView data);
};

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads exactly out.size() bytes at `offset`; a short file gives kDataLoss naming the path,
  // the offset, the bytes wanted and the file size. Thread-safe.
  virtual Status ReadAt(uint64_t offset, MutableByteView out) const = 0;
  // A scatter read: the consecutive bytes from `offset` fill `pieces` in order, as one ReadAt of
  // their total size would. Errors as ReadAt. The default calls ReadAt once per piece; a store
  // that can read them with one request (PosixStore: preadv) should, so that the device sees one
  // large read. Thread-safe.
  virtual Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const;
  // The file size when it was opened.
  virtual uint64_t size() const = 0;
  virtual const std::string& path() const = 0;
  // Asks the store to forget any cached copy of this file, so that the next reads come from the
  // device (honest cold-read benchmarks). Only clean (already synced) data can be dropped. The
  // default does nothing and returns OK.
  virtual Status DropCache() { return OkStatus(); }
  // A hint: bytes [offset, offset + length) will be read soon; start fetching them in the
  // background. The default does nothing.
  virtual void Prefetch(uint64_t offset, uint64_t length) const {}
  // The fraction (0 to 1) of bytes [offset, offset + length) that the store holds in memory
  // (the page cache), so that reading them costs no device access; nullopt when it cannot tell
  // (the default) or the range is empty. Ranges of more than 16 MiB may be sampled. Loads use it
  // to read cold files with direct I/O and warm ones through the cache (LoadOptions::direct_io).
  // Thread-safe.
  virtual std::optional<double> CachedFraction(uint64_t offset, uint64_t length) const {
    return std::nullopt;
  }

  // Direct I/O: reads that bypass the page cache (Linux O_DIRECT), for large cold reads whose
  // bytes are not read again. The alignment that the offset, the length and the buffer address of
  // ReadDirectAt must have, or 0 when this file cannot be read that way (the store or the file
  // system does not support it; decided on the first call). The default: 0. Thread-safe.
  virtual uint64_t direct_io_alignment() const { return 0; }
  // Whether a direct read into 4 KiB pages that lie apart in physical memory reaches the device
  // in shorter requests than one into contiguous memory: the device takes fewer segments (pages)
  // per request than its largest request holds pages. Then readers land direct reads meant for
  // such pages (shared memory) in their staging buffers, which are huge pages, and copy them
  // (ReadExecutorOptions::staged_from). The default: false. Thread-safe.
  virtual bool small_pages_shorten_requests() const { return false; }
  // Reads up to out.size() bytes at `offset` bypassing the page cache, where offset, out.size()
  // and out.data() are multiples of direct_io_alignment() (> 0). Returns the bytes read: all of
  // them, or fewer only where the file ends (the tail past the end is left as it was). Errors name
  // the path and the offset; kFailedPrecondition when the file cannot be read directly or the
  // request is not aligned. Thread-safe; may run beside ReadAt on the same file.
  Result<uint64_t> ReadDirectAt(uint64_t offset, MutableByteView out) const {
    return ReadDirectVAt(offset, std::span<const MutableByteView>(&out, 1));
  }
  // The same as a scatter read: the consecutive bytes from `offset` fill `pieces` in order, each
  // piece's address and size a multiple of direct_io_alignment(), so that bytes land straight in
  // several buffers (a destination and the staging around it) with one request. The default:
  // kFailedPrecondition.
  virtual Result<uint64_t> ReadDirectVAt(uint64_t offset,
                                         std::span<const MutableByteView> pieces) const;
};

// Where a path below a checkpoint directory leads when symbolic links are followed (FindLink).
struct LinkInfo {
  bool through_link = false;  // some component from the directory down to the file is a link
  bool inside = true;         // the file resolves inside the directory (resolved), or no link
  std::string target;         // the resolved path, when through_link
};

struct DirEntry {
  std::string name;  // not a path: the last component only
  bool is_directory = false;
  uint64_t size = 0;  // bytes, for files
};

// The condition of a conditional write (Store::WriteFileIf): no file at the path (kAbsent), or
// the file there still the one whose Store::FileVersion was `version` (kVersion).
struct FileCondition {
  enum class Kind { kAbsent, kVersion };
  Kind kind = Kind::kAbsent;
  std::string version;
};

class Store {
 public:
  virtual ~Store() = default;

  // Creates (or truncates) a file. The parent directory must exist (kNotFound otherwise).
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) = 0;
  // Opens an existing file (kNotFound when absent).
  virtual Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) = 0;
  // Reads a whole file (convenience over OpenReadable).
  virtual Result<std::string> ReadFile(std::string_view path);
  // Creates a directory and its missing parents; OK when it exists.
  virtual Status CreateDirs(std::string_view path) = 0;
  // Atomically renames `from` to `to`, replacing a file at `to`.
  virtual Status Rename(std::string_view from, std::string_view to) = 0;
  // Makes the directory's entries (creations, renames, removals) durable.
  virtual Status SyncDir(std::string_view path) = 0;
  // Removes one file (kNotFound when absent).
  virtual Status RemoveFile(std::string_view path) = 0;
  // Removes an empty directory.
  virtual Status RemoveDir(std::string_view path) = 0;
  // kNotFound when nothing is there.
  virtual Result<bool> IsDirectory(std::string_view path) = 0;
  virtual Result<bool> Exists(std::string_view path) = 0;
  // Entries of a directory, sorted by name (kNotFound when absent).
  virtual Result<std::vector<DirEntry>> ListDir(std::string_view path) = 0;
  // Opens the file `name`, a '/'-separated path relative to the checkpoint directory `dir`, as
  // OpenReadable(JoinPath(dir, name)) does. Every read of a file that a checkpoint names goes
  // through here, so that a store with symbolic links can refuse a file that leads out of the
  // checkpoint: PosixStore gives kFailedPrecondition naming the link and its target when a link
  // on the way from `dir` to the file resolves outside `dir` (itself resolved), unless the store
  // was made with allow_external_links. An empty `name` opens `dir` itself (the one file of a
  // single-file checkpoint), which may be a link. The default opens JoinPath(dir, name).
  virtual Result<std::unique_ptr<ReadableFile>> OpenInDirectory(std::string_view dir,
                                                                std::string_view name);
  // Whether the file `name` below `dir` is reached through a symbolic link, and where it leads.
  // A missing file is no link (OpenInDirectory reports it). The default: no links.
  virtual Result<LinkInfo> FindLink(std::string_view dir, std::string_view name);
  // Whether OpenInDirectory opens files that links lead out of their checkpoint directory.
  virtual bool allows_external_links() const { return false; }
  // Whether `a` and `b` name the same existing file or directory, however spelled (PosixStore:
  // the same device and inode, so absolute paths, "..", links and bind mounts all compare equal).
  // false when either is missing. The default compares NormalizePath of both.
  virtual Result<bool> SameFile(std::string_view a, std::string_view b);
  // A short name for messages: "posix", "memory", "fault(posix)".
  virtual std::string name() const = 0;
  // True when a file written through NewWritableFile exists only once closed, whole (object
  // storage: S3Store), so that writing it under its final name is as safe as writing a temporary
  // one and renaming it; a rename there copies the data. False (the default): a file exists from
  // its creation and grows as it is written.
  virtual bool files_appear_when_closed() const { return false; }
  // True when every read fetches its bytes from another machine (object storage: S3Store), with
  // no page cache that the ranks of one machine share: a load then lets one rank read each stored
  // chunk that several need and send the others their regions (LoadOptions::share_reads unset),
  // even when all its ranks run on one machine. False (the default): a local file system.
  virtual bool reads_cross_the_network() const { return false; }
  // An opaque token that changes whenever the file at `path` is replaced (S3Store: its ETag), for
  // FileCondition::kVersion; kNotFound when there is no file. The default: kUnimplemented.
  virtual Result<std::string> FileVersion(std::string_view path);
  // Writes `bytes` as the whole file `path` in one step, only if `condition` holds when the file
  // lands (checked by the store atomically with the write, so that of two writers racing for the
  // same condition at most one succeeds): kAlreadyExists naming the path when it does not hold,
  // and the file is left as it was; but where the file then holds exactly `bytes` (a retried
  // write whose first attempt landed), the write succeeded. The commit of a save goes through
  // here (WriteFileDurably). The default: kUnimplemented (a store that cannot check a condition
  // atomically).
  virtual Status WriteFileIf(std::string_view path, std::string_view bytes,
                             const FileCondition& condition);
  // Drops what writers left unfinished in the directory `dir` that no reader can see (S3Store:
  // multipart uploads begun by a process that died before completing or aborting them, which
  // the bucket keeps, and bills, until aborted). Returns how many. Called once a save has
  // committed at `dir` (no other save can commit there after it, so their writes are garbage)
  // and when a checkpoint is deleted. The default: nothing to drop.
  virtual Result<int> DropUnfinishedWrites(std::string_view dir) { return 0; }
};

// The words every store's error messages start with: "write /ckpt/d-0.safetensors" and, with
// an offset, "write /ckpt/d-0.safetensors at offset 4096".
std::string OpOn(std::string_view op, std::string_view path);
std::string OpAt(std::string_view op, std::string_view path, uint64_t offset);

// The whole of a small file (a metadata or config file): kDataLoss naming the file when it is
// larger than `limit` bytes (nothing is read then), else the store's open and read errors. The
// file is opened with OpenInDirectory(ParentPath(path), its last component): checkpoints keep
// their metadata and config files at the top of their directory.
Result<std::string> ReadSmallFile(Store& store, const std::string& path, uint64_t limit);

// Creates the file `path` holding `bytes`, synced and closed; on failure removes it (best effort).
Status WriteSyncedFile(Store& store, const std::string& path, std::string_view bytes);

// Writes `bytes` as the file `name` of directory `dir` so that readers find either what was there
// before or all of `bytes`: they go to the file `temp_name` of `dir`, which is synced, closed and
// renamed over `name`; on a store whose files appear only when closed (object storage), straight
// to `name`. With a `condition`, the store writes `name` through WriteFileIf where it can
// (kAlreadyExists when the condition fails) and as without one where it cannot (kUnimplemented).
// On failure `name` is as it was; the temporary is removed (best effort) when writing it failed,
// and left when the rename failed (a failed rename may have happened on some file systems; the
// next commit's cleanup removes such leftovers by their name).
// The rename is durable once the caller syncs `dir` (Store::SyncDir), which is left to the caller:
// a commit may rename several files under one SyncDir, and must sync the directory before the
// rename when the files the new one names have to be durable first. Used for every small file a
// checkpoint commits (metadata, index, Megatron's files).
Status WriteFileDurably(Store& store, std::string_view dir, std::string_view name,
                        std::string_view temp_name, std::string_view bytes,
                        const FileCondition* condition = nullptr);

// "a" + "b" -> "a/b" (no doubled slash); "a" + "" -> "a" (the directory itself, or the one
// file of a single-file checkpoint).
std::string JoinPath(std::string_view dir, std::string_view name);
// "a/b/c" -> "a/b"; "c" -> "".
std::string ParentPath(std::string_view path);
// Collapses repeated '/', drops "." components and a trailing '/', keeps a leading '/':
// "/a//b/./c/" -> "/a/b/c"; "a/" -> "a"; "/" -> "/"; "" -> "". ".." is kept as a component.
std::string NormalizePath(std::string_view path);

}  // namespace sp

#endif  // SHARDPOINT_STORE_STORE_H_
