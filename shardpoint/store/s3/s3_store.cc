#include "shardpoint/store/s3/s3_store.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace sp {
namespace {

constexpr uint64_t kMinPartBytes = uint64_t{5} << 20;

// The key prefix of a directory: its key and '/', or "" for the root.
std::string DirPrefix(const std::string& key) { return key.empty() ? "" : key + "/"; }

std::string ParentKey(const std::string& key) {
  const size_t slash = key.rfind('/');
  return slash == std::string::npos ? "" : key.substr(0, slash);
}

// The message of a failed request, behind the store's own words.
Status Failed(std::string_view op, std::string_view path, const Status& status) {
  return Status(status.code(), OpOn(op, path) + ": " + std::string(status.message()));
}

// Disjoint, sorted [begin, end) ranges; `covered` is their total length.
struct Ranges {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t covered = 0;

  void Add(uint64_t begin, uint64_t end) {
    auto it = std::lower_bound(ranges.begin(), ranges.end(), std::make_pair(begin, begin));
    if (it != ranges.begin() && std::prev(it)->second >= begin) --it;
    while (it != ranges.end() && it->first <= end) {
      begin = std::min(begin, it->first);
      end = std::max(end, it->second);
      covered -= it->second - it->first;
      it = ranges.erase(it);
    }
    ranges.insert(it, {begin, end});
    covered += end - begin;
  }
};

class S3WritableFile : public WritableFile {
 public:
  // `condition`: the object is made (the PUT, or the multipart upload's completion) only where it
  // holds.
  S3WritableFile(S3Client& client, std::string bucket, std::string key, std::string path,
                 uint64_t part_bytes, S3Condition condition = {})
      : client_(client), bucket_(std::move(bucket)), key_(std::move(key)), path_(std::move(path)),
        part_bytes_(part_bytes), condition_(std::move(condition)) {}

  ~S3WritableFile() override {
    if (!closed_ && !upload_id_.empty()) {
      client_.AbortMultipartUpload(bucket_, key_, upload_id_).IgnoreError();
    }
  }

  // Each part is sent as soon as its last byte is written, by the thread that wrote it, before
  // that thread copies anything more: a file holds at most one unfinished part per writer and
  // one part in flight per writer, however large the writes. A write that covers a whole part
  // nothing was written to yet is sent straight from the caller's bytes.
  Status WriteAt(uint64_t offset, ByteView data) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      return FailedPreconditionError(OpAt("write", path_, offset) + ": file is closed");
    }
    SP_RETURN_IF_ERROR(failure_);
    size_ = std::max(size_, offset + data.size());
    uint64_t at = offset;
    size_t from = 0;
    while (from < data.size()) {
      const uint64_t index = at / part_bytes_;
      const uint64_t in_part = at - index * part_bytes_;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(data.size() - from,
                                                              part_bytes_ - in_part));
      Part& part = parts_[index];
      if (part.sent) {
        return FailedPreconditionError(OpAt("write", path_, at) +
                                       ": that part of the object was already sent");
      }
      std::vector<std::byte> full;  // a part whose last byte this write brought
      ByteView send;
      if (n == part_bytes_ && part.written.covered == 0) {
        part.sent = true;
        send = ByteView(data.data() + from, n);
      } else {
        if (part.bytes.size() < in_part + n) part.bytes.resize(in_part + n, std::byte{0});
        std::memcpy(part.bytes.data() + in_part, data.data() + from, n);
        part.written.Add(in_part, in_part + n);
        if (part.written.covered == part_bytes_) {
          part.sent = true;
          part.bytes.resize(part_bytes_);
          full = std::move(part.bytes);
          part.bytes = {};
          send = ByteView(full.data(), full.size());
        }
      }
      if (!send.empty()) {
        lock.unlock();
        Status sent = SendPart(index, send);
        lock.lock();
        if (!sent.ok()) {
          if (failure_.ok()) failure_ = sent;
          return sent;
        }
      }
      at += n;
      from += n;
    }
    return OkStatus();
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return FailedPreconditionError(OpOn("sync", path_) + ": file is closed");
    return failure_;
  }

  Status Preallocate(uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return FailedPreconditionError(OpOn("preallocate", path_) + ": file is closed");
    size_ = std::max(size_, size);
    return OkStatus();
  }

  Status Close() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return FailedPreconditionError(OpOn("close", path_) + ": file is closed");
    closed_ = true;
    Status status = failure_;
    if (status.ok()) status = Finish(lock);
    if (!status.ok() && !upload_id_.empty()) {
      client_.AbortMultipartUpload(bucket_, key_, upload_id_).IgnoreError();
    }
    return status;
  }

  const std::string& path() const override { return path_; }

 private:
  struct Part {
    std::vector<std::byte> bytes;  // part_bytes_ long while held
    Ranges written;
    bool sent = false;
  };

  // Sends part `index` (part number index + 1), starting the upload on the first.
  Status SendPart(uint64_t index, ByteView bytes) {
    SP_ASSIGN_OR_RETURN(std::string upload_id, UploadId());
    Result<std::string> etag =
        client_.UploadPart(bucket_, key_, upload_id, static_cast<int>(index + 1), bytes);
    if (!etag.ok()) return Failed("write", path_, etag.status());
    std::lock_guard<std::mutex> lock(mu_);
    etags_[static_cast<int>(index + 1)] = *etag;
    return OkStatus();
  }

  Result<std::string> UploadId() {
    std::lock_guard<std::mutex> lock(upload_mu_);
    if (upload_id_.empty()) {
      Result<std::string> id = client_.CreateMultipartUpload(bucket_, key_);
      if (!id.ok()) return Failed("create", path_, id.status());
      upload_id_ = *id;
    }
    return upload_id_;
  }

  // With mu_ held: sends what is left and makes the object.
  Status Finish(std::unique_lock<std::mutex>& lock) {
    const uint64_t parts = (size_ + part_bytes_ - 1) / part_bytes_;
    const bool any_sent = !etags_.empty() || !upload_id_.empty();
    if (!any_sent && parts <= 1) {  // one PUT of the whole object
      auto it = parts_.find(0);
      std::vector<std::byte> whole =
          it != parts_.end() ? std::move(it->second.bytes) : std::vector<std::byte>();
      whole.resize(size_, std::byte{0});  // never-written bytes (Preallocate) read as zeros
      parts_.clear();
      lock.unlock();
      Status put =
          client_.PutObject(bucket_, key_, ByteView(whole.data(), whole.size()), condition_);
      return put.ok() ? put : Failed("close", path_, put);
    }
    // The parts not sent yet: every one up to the end, the last cut to the size.
    std::vector<std::pair<uint64_t, std::vector<std::byte>>> rest;
    for (uint64_t index = 0; index < parts; ++index) {
      Part& part = parts_[index];
      if (part.sent) continue;
      std::vector<std::byte> bytes = std::move(part.bytes);
      const uint64_t length = std::min(part_bytes_, size_ - index * part_bytes_);
      bytes.resize(length, std::byte{0});
      rest.emplace_back(index, std::move(bytes));
      part.sent = true;
    }
    parts_.clear();
    lock.unlock();
    for (auto& [index, bytes] : rest) {
      SP_RETURN_IF_ERROR(SendPart(index, ByteView(bytes.data(), bytes.size())));
    }
    lock.lock();
    S3Parts list(etags_.begin(), etags_.end());
    if (list.size() != parts) {
      return InternalError(OpOn("close", path_) + ": " + std::to_string(list.size()) +
                           " parts sent for an object of " + std::to_string(parts));
    }
    const std::string upload_id = upload_id_;
    lock.unlock();
    Status completed = client_.CompleteMultipartUpload(bucket_, key_, upload_id, list, condition_);
    if (!completed.ok() && !CompletedBefore(completed)) return Failed("close", path_, completed);
    std::lock_guard<std::mutex> upload_lock(upload_mu_);
    upload_id_.clear();  // complete: nothing to abort
    return OkStatus();
  }

  // A completion retried after its first attempt landed (the answer lost to a reset) finds its
  // upload gone (NoSuchUpload): an upload id that no longer exists was completed or aborted, and
  // nothing aborts it before its completion returns, so an object of the file's size at the key
  // is this one.
  bool CompletedBefore(const Status& completion) {
    if (completion.code() != StatusCode::kNotFound ||
        completion.message().find("NoSuchUpload") == std::string_view::npos) {
      return false;
    }
    Result<uint64_t> size = client_.HeadObject(bucket_, key_);
    return size.ok() && *size == size_;
  }

  S3Client& client_;
  const std::string bucket_;
  const std::string key_;
  const std::string path_;
  const uint64_t part_bytes_;
  const S3Condition condition_;
  std::mutex mu_;
  std::map<uint64_t, Part> parts_;
  std::map<int, std::string> etags_;
  uint64_t size_ = 0;
  bool closed_ = false;
  Status failure_;
  std::mutex upload_mu_;
  std::string upload_id_;
};

class S3ReadableFile : public ReadableFile {
 public:
  S3ReadableFile(S3Client& client, std::string bucket, std::string key, std::string path,
                 uint64_t size)
      : client_(client), bucket_(std::move(bucket)), key_(std::move(key)), path_(std::move(path)),
        size_(size) {}

  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    if (offset > size_ || out.size() > size_ - offset) return ShortRead(offset, out.size());
    Status read = client_.GetRange(bucket_, key_, offset, out);
    return read.ok() ? read : Failed("read", path_, read);
  }
  // One ranged GET for all the pieces, each byte written into its piece as it arrives.
  Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
    uint64_t total = 0;
    for (const MutableByteView& p : pieces) total += p.size();
    // What the file holds of the range is read and delivered even when the range runs past its
    // end (then kDataLoss, as ReadAt reports it).
    const uint64_t held = offset >= size_ ? 0 : std::min(total, size_ - offset);
    std::vector<MutableByteView> within;
    uint64_t at = 0;
    for (const MutableByteView& p : pieces) {
      if (at >= held) break;
      within.push_back(MutableByteView(p.data(), std::min<uint64_t>(p.size(), held - at)));
      at += p.size();
    }
    if (held > 0) {
      Status read = client_.GetRangeV(bucket_, key_, offset, within);
      if (!read.ok()) return Failed("read", path_, read);
    }
    if (held < total) return ShortRead(offset, total);
    return OkStatus();
  }
  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }

 private:
  Status ShortRead(uint64_t offset, uint64_t wanted) const {
    return DataLossError(OpAt("read", path_, offset) + ": wanted " + std::to_string(wanted) +
                         " bytes but the file holds " + std::to_string(size_) + " bytes");
  }

  S3Client& client_;
  const std::string bucket_;
  const std::string key_;
  const std::string path_;
  const uint64_t size_;
};

}  // namespace

std::string S3KeyOf(std::string_view path) {
  // "s3://bucket/a", or "s3:/bucket/a" as path normalization leaves it.
  if (path.size() > 3 && (path.substr(0, 4) == "s3:/" || path.substr(0, 4) == "S3:/")) {
    path.remove_prefix(3);
    while (!path.empty() && path.front() == '/') path.remove_prefix(1);
    const size_t slash = path.find('/');
    path = slash == std::string_view::npos ? std::string_view() : path.substr(slash);
  }
  std::string key;
  size_t at = 0;
  while (at <= path.size()) {
    size_t slash = path.find('/', at);
    if (slash == std::string_view::npos) slash = path.size();
    const std::string_view part = path.substr(at, slash - at);
    if (!part.empty() && part != ".") {
      if (!key.empty()) key += '/';
      key += part;
    }
    at = slash + 1;
  }
  return key;
}

S3Store::S3Store(std::shared_ptr<S3Client> client, std::string bucket, S3StoreOptions options)
    : client_(std::move(client)), bucket_(std::move(bucket)), options_(options) {
  options_.part_bytes = std::max(options_.part_bytes, kMinPartBytes);
}

Result<S3Store::Kind> S3Store::What(std::string_view path) {
  const std::string key = S3KeyOf(path);
  if (key.empty()) return Kind::kDirectory;
  Result<uint64_t> size = client_->HeadObject(bucket_, key);
  if (size.ok()) return Kind::kFile;
  if (size.status().code() != StatusCode::kNotFound) return size.status();
  Result<S3Listing> below = client_->ListObjects(bucket_, DirPrefix(key), "/", "");
  // Nothing is in a bucket that does not exist (writing there fails with the server's word).
  if (!below.ok() && below.status().code() == StatusCode::kNotFound) return Kind::kNothing;
  if (!below.ok()) return below.status();
  return below->objects.empty() && below->prefixes.empty() ? Kind::kNothing : Kind::kDirectory;
}

Result<std::vector<S3Object>> S3Store::ListAll(const std::string& prefix) {
  std::vector<S3Object> all;
  std::string token;
  do {
    SP_ASSIGN_OR_RETURN(S3Listing page, client_->ListObjects(bucket_, prefix, "", token));
    for (S3Object& o : page.objects) all.push_back(std::move(o));
    token = page.next_continuation_token;
  } while (!token.empty());
  return all;
}

Result<std::unique_ptr<WritableFile>> S3Store::NewWritableFile(std::string_view path) {
  const std::string key = S3KeyOf(path);
  Result<Kind> parent = What(ParentKey(key));
  if (!parent.ok()) return Failed("create", path, parent.status());
  if (*parent != Kind::kDirectory) {
    return NotFoundError(OpOn("create", path) + ": its directory does not exist");
  }
  Result<Kind> here = What(key);
  if (!here.ok()) return Failed("create", path, here.status());
  if (*here == Kind::kDirectory) {
    return InvalidArgumentError(OpOn("create", path) + ": it is a directory");
  }
  return std::unique_ptr<WritableFile>(std::make_unique<S3WritableFile>(
      *client_, bucket_, key, std::string(path), options_.part_bytes));
}

Result<std::string> S3Store::FileVersion(std::string_view path) {
  const std::string key = S3KeyOf(path);
  Result<S3ObjectInfo> info =
      key.empty() ? NotFoundError("the bucket's root") : client_->StatObject(bucket_, key);
  if (!info.ok()) return Failed("version of", path, info.status());
  if (info->etag.empty()) {
    return UnimplementedError(OpOn("version of", path) + ": the server sent no ETag");
  }
  return info->etag;
}

// A condition that fails after a retry may have failed against this very write (an attempt that
// landed but whose answer was lost): the object then holds `bytes`, which name the save that
// wrote them, and the write succeeded.
Status S3Store::WriteFileIf(std::string_view path, std::string_view bytes,
                            const FileCondition& condition) {
  const std::string key = S3KeyOf(path);
  if (key.empty()) return InvalidArgumentError(OpOn("write", path) + ": not a file");
  if (condition.kind == FileCondition::Kind::kVersion && condition.version.empty()) {
    return InvalidArgumentError(OpOn("write", path) + ": an empty version to match");
  }
  S3Condition c;
  if (condition.kind == FileCondition::Kind::kAbsent) {
    c.if_none_match = true;
  } else {
    c.if_match = condition.version;
  }
  Status written = [&] {
    S3WritableFile file(*client_, bucket_, key, std::string(path), options_.part_bytes, c);
    SP_RETURN_IF_ERROR(file.WriteAt(0, AsBytes(bytes)));
    return file.Close();
  }();
  if (written.code() != StatusCode::kAlreadyExists) return written;
  Result<S3ObjectInfo> now = client_->StatObject(bucket_, key);
  if (now.ok() && now->size == bytes.size()) {
    Result<std::string> held = client_->GetObject(bucket_, key);
    if (held.ok() && *held == bytes) return OkStatus();
  }
  return Status(StatusCode::kAlreadyExists,
                std::string(written.message()) +
                    (condition.kind == FileCondition::Kind::kAbsent
                         ? " (another writer created the file first)"
                         : " (another writer replaced the file since its version was read)"));
}

Result<int> S3Store::DropUnfinishedWrites(std::string_view dir) {
  std::string prefix = S3KeyOf(dir);
  if (!prefix.empty()) prefix += '/';
  Result<std::vector<S3Upload>> uploads = client_->ListMultipartUploads(bucket_, prefix);
  if (!uploads.ok()) return Failed("list the unfinished uploads of", dir, uploads.status());
  int dropped = 0;
  for (const S3Upload& upload : *uploads) {
    // The directory's own files only: not those of a directory below it.
    if (upload.key.find('/', prefix.size()) != std::string::npos) continue;
    Status aborted = client_->AbortMultipartUpload(bucket_, upload.key, upload.upload_id);
    if (!aborted.ok()) return Failed("abort the unfinished upload of", upload.key, aborted);
    ++dropped;
  }
  return dropped;
}

Result<std::unique_ptr<ReadableFile>> S3Store::OpenReadable(std::string_view path) {
  const std::string key = S3KeyOf(path);
  Result<uint64_t> size = key.empty() ? NotFoundError("the bucket's root")
                                      : client_->HeadObject(bucket_, key);
  if (!size.ok()) {
    if (size.status().code() == StatusCode::kNotFound) {
      Result<Kind> what = What(path);
      if (what.ok() && *what == Kind::kDirectory) {
        return InvalidArgumentError(OpOn("open", path) + ": it is a directory");
      }
    }
    return Failed("open", path, size.status());
  }
  return std::unique_ptr<ReadableFile>(
      std::make_unique<S3ReadableFile>(*client_, bucket_, key, std::string(path), *size));
}

Status S3Store::CreateDirs(std::string_view path) {
  const std::string key = S3KeyOf(path);
  std::string at;
  size_t from = 0;
  while (from <= key.size() && !key.empty()) {
    size_t slash = key.find('/', from);
    if (slash == std::string::npos) slash = key.size();
    at = key.substr(0, slash);
    Result<uint64_t> file = client_->HeadObject(bucket_, at);
    if (file.ok()) {
      return FailedPreconditionError(OpOn("create directory", path) + ": /" + at +
                                     " is a file");
    }
    if (file.status().code() != StatusCode::kNotFound) {
      return Failed("create directory", path, file.status());
    }
    Status marked = client_->PutObject(bucket_, at + "/", ByteView());
    if (!marked.ok()) return Failed("create directory", path, marked);
    from = slash + 1;
  }
  return OkStatus();
}

Status S3Store::Rename(std::string_view from, std::string_view to) {
  const std::string what = "rename " + std::string(from) + " to " + std::string(to);
  const std::string from_key = S3KeyOf(from);
  const std::string to_key = S3KeyOf(to);
  SP_ASSIGN_OR_RETURN(Kind source, What(from));
  if (source == Kind::kNothing) return NotFoundError(what + ": the source does not exist");
  SP_ASSIGN_OR_RETURN(Kind parent, What(ParentKey(to_key)));
  if (parent != Kind::kDirectory) {
    return NotFoundError(what + ": the destination's directory does not exist");
  }
  SP_ASSIGN_OR_RETURN(Kind target, What(to));
  if (source == Kind::kFile) {
    if (target == Kind::kDirectory) {
      return FailedPreconditionError(what + ": the destination is a directory");
    }
    Status copied = client_->CopyObject(bucket_, from_key, to_key);
    if (!copied.ok()) return Status(copied.code(), what + ": " + std::string(copied.message()));
    Status removed = client_->DeleteObject(bucket_, from_key);
    return removed.ok() ? removed
                        : Status(removed.code(), what + ": " + std::string(removed.message()));
  }
  if (target == Kind::kFile) return FailedPreconditionError(what + ": the destination is a file");
  // A directory, object by object (markers included), each copied before any is deleted.
  SP_ASSIGN_OR_RETURN(std::vector<S3Object> objects, ListAll(DirPrefix(from_key)));
  for (const S3Object& o : objects) {
    const std::string moved = DirPrefix(to_key) + o.key.substr(from_key.size() + 1);
    // A directory marker is made again (servers that treat such keys as folders cannot copy one).
    Status copied = o.key.back() == '/' ? client_->PutObject(bucket_, moved, ByteView())
                                        : client_->CopyObject(bucket_, o.key, moved);
    if (!copied.ok()) return Status(copied.code(), what + ": " + std::string(copied.message()));
  }
  // Deepest first, markers after the objects below them: a server that keeps folders removes a
  // folder only once it is empty.
  std::sort(objects.begin(), objects.end(), [](const S3Object& a, const S3Object& b) {
    const bool a_marker = a.key.back() == '/', b_marker = b.key.back() == '/';
    if (a_marker != b_marker) return b_marker;
    return a.key.size() > b.key.size();
  });
  for (const S3Object& o : objects) {
    Status removed = client_->DeleteObject(bucket_, o.key);
    if (!removed.ok()) return Status(removed.code(), what + ": " + std::string(removed.message()));
  }
  return OkStatus();
}

Status S3Store::SyncDir(std::string_view path) {
  SP_ASSIGN_OR_RETURN(Kind kind, What(path));
  if (kind != Kind::kDirectory) {
    return NotFoundError(OpOn("sync directory", path) + ": no directory");
  }
  return OkStatus();  // a written object is durable once its write returned
}

Status S3Store::RemoveFile(std::string_view path) {
  const std::string key = S3KeyOf(path);
  Result<uint64_t> size = client_->HeadObject(bucket_, key);
  if (!size.ok()) return Failed("remove", path, size.status());
  Status removed = client_->DeleteObject(bucket_, key);
  return removed.ok() ? removed : Failed("remove", path, removed);
}

Status S3Store::RemoveDir(std::string_view path) {
  const std::string key = S3KeyOf(path);
  SP_ASSIGN_OR_RETURN(Kind kind, What(path));
  if (kind != Kind::kDirectory) {
    return NotFoundError(OpOn("remove directory", path) + ": no directory");
  }
  SP_ASSIGN_OR_RETURN(S3Listing below, client_->ListObjects(bucket_, DirPrefix(key), "/", ""));
  const bool only_marker = below.prefixes.empty() &&
                           std::all_of(below.objects.begin(), below.objects.end(),
                                       [&](const S3Object& o) { return o.key == DirPrefix(key); });
  if (!only_marker) {
    return FailedPreconditionError(OpOn("remove directory", path) + ": it is not empty");
  }
  Status removed = client_->DeleteObject(bucket_, DirPrefix(key));
  return removed.ok() ? removed : Failed("remove directory", path, removed);
}

Result<bool> S3Store::IsDirectory(std::string_view path) {
  Result<Kind> kind = What(path);
  if (!kind.ok()) return Failed("stat", path, kind.status());
  if (*kind == Kind::kNothing) return NotFoundError(OpOn("stat", path) + ": nothing is there");
  return *kind == Kind::kDirectory;
}

Result<bool> S3Store::Exists(std::string_view path) {
  Result<Kind> kind = What(path);
  if (!kind.ok()) return Failed("stat", path, kind.status());
  return *kind != Kind::kNothing;
}

Result<std::vector<DirEntry>> S3Store::ListDir(std::string_view path) {
  const std::string key = S3KeyOf(path);
  Result<Kind> kind = What(path);
  if (!kind.ok()) return Failed("list", path, kind.status());
  if (*kind == Kind::kNothing) return NotFoundError(OpOn("list", path) + ": no directory");
  if (*kind == Kind::kFile) return NotFoundError(OpOn("list", path) + ": not a directory");
  const std::string prefix = DirPrefix(key);
  std::vector<DirEntry> entries;
  std::string token;
  do {
    Result<S3Listing> page = client_->ListObjects(bucket_, prefix, "/", token);
    if (!page.ok()) return Failed("list", path, page.status());
    for (const S3Object& o : page->objects) {
      if (o.key == prefix) continue;  // the directory's own marker
      entries.push_back(DirEntry{o.key.substr(prefix.size()), false, o.size});
    }
    for (const std::string& p : page->prefixes) {
      entries.push_back(DirEntry{p.substr(prefix.size(), p.size() - prefix.size() - 1), true, 0});
    }
    token = page->next_continuation_token;
  } while (!token.empty());
  std::sort(entries.begin(), entries.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return entries;
}

}  // namespace sp
