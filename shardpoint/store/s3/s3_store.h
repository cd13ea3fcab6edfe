// S3Store: a Store on an S3 bucket (s3_client.h), for checkpoints in object storage.
//
// Paths are keys: "/run/step-100/d-1.safetensors" (or without the leading '/') is the object of
// that key in the store's bucket. Object storage has no directories; a directory is a key prefix
// ending in '/', and CreateDirs writes an empty marker object for each level ("run/",
// "run/step-100/") so that an empty directory exists too. A directory exists when its marker or
// any key below it does.
//
// Writing. A WritableFile buffers what is written in parts of S3StoreOptions::part_bytes (at
// least 5 MiB, the S3 minimum). A part whose bytes have all been written is sent at once as a part
// of a multipart upload, in the background (the client's event loops, s3_client.h), while the
// writer goes on; the parts in flight over all the store's files hold at most
// S3StoreOptions::part_budget_bytes (a writer whose part would go over waits for room), and a
// file written front to back, or by many threads in disjoint pieces, holds at most about one
// unfinished part per writer besides. A write covering whole parts sends them straight from the
// caller's bytes, all at once, and returns once they are sent. Close is the
// commit point: a file of one part or less is sent with one PUT; otherwise the remaining parts
// (bytes never written read as zeros, as in a sparse file) are sent and the upload completed. Until
// then the object does not exist (or keeps its previous content): S3 makes an object appear whole
// or not at all. Sync does nothing but report an earlier failure; a failed or abandoned file
// aborts its multipart upload.
//
// Conditional writes (WriteFileIf, what a save's commit uses) send If-None-Match: * or If-Match:
// the ETag (FileVersion), which S3 checks atomically with the write (AWS since 2024, SeaweedFS,
// MinIO); a server that ignores them makes the commit unconditional.
//
// Reading. A read is cut into ranged GETs of at most S3StoreOptions::read_part_bytes, all in
// flight at once, each written into the caller's buffers as it arrives.
//
// Renames copy on the server and delete the source: the destination appears whole at once (which
// is what a commit needs); a directory is renamed object by object. Open readers of a renamed or
// replaced file fail (the object they read is gone), unlike POSIX handles.
//
// Thread-safe. Errors name the operation and the path as every store's do, with the S3 request's
// own message (bucket, key, HTTP status, the server's code).
#ifndef SHARDPOINT_STORE_S3_S3_STORE_H_
#define SHARDPOINT_STORE_S3_S3_STORE_H_

#include <memory>
#include <string>
#include <string_view>

#include "shardpoint/store/s3/s3_client.h"
#include "shardpoint/store/store.h"

namespace sp {

struct S3StoreOptions {
  uint64_t part_bytes = uint64_t{16} << 20;  // raised to 5 MiB when smaller
  // The bytes of parts in flight from the files' own buffers, over every file of the store: the
  // default memory budget of a call (docs/DESIGN.md decision 8). A part larger than this still
  // goes, alone.
  uint64_t part_budget_bytes = uint64_t{256} << 20;
  // The most bytes one ranged GET asks for; a longer read is cut into GETs sent at once. 16 MiB:
  // AWS advises ranged GETs of 8 to 16 MiB, and on a SeaweedFS server 8 MiB GETs made loads of
  // 16 MiB extents 25% slower than whole ones (docs/PERFORMANCE.md, "Object storage").
  uint64_t read_part_bytes = uint64_t{16} << 20;
};

class S3PartBudget;

class S3Store : public Store {
 public:
  S3Store(std::shared_ptr<S3Client> client, std::string bucket, S3StoreOptions options = {});

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
  std::string name() const override { return "s3"; }
  bool files_appear_when_closed() const override { return true; }
  bool reads_cross_the_network() const override { return true; }
  // The object's ETag.
  Result<std::string> FileVersion(std::string_view path) override;
  // A PUT (or a multipart upload's completion) with If-None-Match: * or If-Match: the version.
  Status WriteFileIf(std::string_view path, std::string_view bytes,
                     const FileCondition& condition) override;
  // Aborts the multipart uploads in progress of files in `dir` (not in its subdirectories).
  Result<int> DropUnfinishedWrites(std::string_view dir) override;

  const std::string& bucket() const { return bucket_; }
  S3Client& client() { return *client_; }
  // The most bytes the store's files have had in flight from their own buffers at once.
  uint64_t peak_part_bytes_in_flight() const;

 private:
  // What is at a path: a file (an object of that key), a directory, or nothing.
  enum class Kind { kNothing, kFile, kDirectory };
  Result<Kind> What(std::string_view path);
  // Every key at or below the directory prefix `prefix` (ending in '/'), all pages.
  Result<std::vector<S3Object>> ListAll(const std::string& prefix);

  std::shared_ptr<S3Client> client_;
  std::string bucket_;
  S3StoreOptions options_;
  std::shared_ptr<S3PartBudget> budget_;
};

// The key of a store path: without leading '/' and with "." and empty components removed. A URL
// "s3://bucket/a/b" (as the engine passes the paths it joins to the URL it was given) is the key
// "a/b" ("s3:/bucket/a/b" too, as path normalization leaves a URL): a store serves one bucket,
// the one of the URL it was opened for.
std::string S3KeyOf(std::string_view path);

}  // namespace sp

#endif  // SHARDPOINT_STORE_S3_S3_STORE_H_
