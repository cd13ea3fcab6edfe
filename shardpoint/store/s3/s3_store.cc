#include "shardpoint/store/s3/s3_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace sp {

// The bytes of parts in flight over every file of a store (S3StoreOptions::part_budget_bytes):
// Acquire waits while taking `bytes` would go over the limit, unless nothing is held (a part
// larger than the limit still goes, alone). Parts in flight end on their own, so a wait always
// ends.
class S3PartBudget {
 public:
  explicit S3PartBudget(uint64_t limit) : limit_(limit) {}

  void Acquire(uint64_t bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    freed_.wait(lock, [&] { return held_ == 0 || held_ + bytes <= limit_; });
    held_ += bytes;
    peak_ = std::max(peak_, held_);
  }
  void Release(uint64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ -= bytes;
    }
    freed_.notify_all();
  }
  uint64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

 private:
  const uint64_t limit_;
  std::mutex mu_;
  std::condition_variable freed_;
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
};

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
  S3WritableFile(S3Client& client, std::shared_ptr<S3PartBudget> budget, std::string bucket,
                 std::string key, std::string path, uint64_t part_bytes,
                 S3Condition condition = {})
      : client_(client), budget_(std::move(budget)), bucket_(std::move(bucket)),
        key_(std::move(key)), path_(std::move(path)), part_bytes_(part_bytes),
        condition_(std::move(condition)) {}

  // Waits for the parts in flight (they write into this file's state), then aborts an upload
  // that was never completed.
  ~S3WritableFile() override {
    std::unique_lock<std::mutex> lock(mu_);
    part_ended_.wait(lock, [&] { return in_flight_ == 0; });
    lock.unlock();
    if (!closed_ && !upload_id_.empty()) {
      client_.AbortMultipartUpload(bucket_, key_, upload_id_).IgnoreError();
    }
  }

  // A part is sent as soon as its last byte is written, while the writer goes on. A part
  // assembled in the file's memory is sent once the store's part budget has room for it (the
  // writer waits for that room), so a file holds at most one unfinished part per writer, and the
  // store's parts in flight stay within the budget (docs/DESIGN.md, object storage). A write that
  // covers whole parts nothing was written to yet sends them straight from the caller's bytes,
  // all at once, and returns when they have been sent.
  Status WriteAt(uint64_t offset, ByteView data) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      return FailedPreconditionError(OpAt("write", path_, offset) + ": file is closed");
    }
    SP_RETURN_IF_ERROR(failure_);
    size_ = std::max(size_, offset + data.size());
    uint64_t at = offset;
    size_t from = 0;
    int borrowed = 0;  // parts of this call sent from the caller's bytes, not yet ended
    while (from < data.size() && failure_.ok()) {  // a part that failed fails the file
      const uint64_t index = at / part_bytes_;
      const uint64_t in_part = at - index * part_bytes_;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(data.size() - from,
                                                              part_bytes_ - in_part));
      if (sent_.count(index) > 0) {
        lock.unlock();
        Wait(borrowed);
        return FailedPreconditionError(OpAt("write", path_, at) +
                                       ": that part of the object was already sent");
      }
      Part& part = parts_[index];
      if (n == part_bytes_ && part.written.covered == 0) {
        parts_.erase(index);
        sent_.insert(index);
        StartPart(lock, index, ByteView(data.data() + from, n), nullptr, &borrowed);
      } else {
        if (part.bytes.size() < in_part + n) part.bytes.resize(in_part + n, std::byte{0});
        std::memcpy(part.bytes.data() + in_part, data.data() + from, n);
        part.written.Add(in_part, in_part + n);
        if (part.written.covered == part_bytes_) {
          auto full = std::make_shared<std::vector<std::byte>>(std::move(part.bytes));
          full->resize(part_bytes_);
          parts_.erase(index);
          sent_.insert(index);
          const ByteView bytes(full->data(), full->size());
          StartPart(lock, index, bytes, std::move(full), nullptr);
        }
      }
      at += n;
      from += n;
    }
    lock.unlock();
    Wait(borrowed);
    lock.lock();
    return failure_;
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
    Status status = Finish(lock);
    if (!status.ok()) {
      if (!lock.owns_lock()) lock.lock();
      part_ended_.wait(lock, [&] { return in_flight_ == 0; });
      lock.unlock();
      if (!upload_id_.empty()) {
        client_.AbortMultipartUpload(bucket_, key_, upload_id_).IgnoreError();
      }
    }
    return status;
  }

  const std::string& path() const override { return path_; }

 private:
  struct Part {
    std::vector<std::byte> bytes;  // as long as the part's bytes written so far reach
    Ranges written;
  };

  // With `lock` held (released meanwhile): starts sending part `index` (part number index + 1)
  // from `bytes`, which `owned` holds (counted against the store's budget), or else the caller's
  // memory (counted in *borrowed until the part has ended). Starts the upload on the first part.
  void StartPart(std::unique_lock<std::mutex>& lock, uint64_t index, ByteView bytes,
                 std::shared_ptr<std::vector<std::byte>> owned, int* borrowed) {
    ++in_flight_;
    if (borrowed != nullptr) ++*borrowed;
    lock.unlock();
    const uint64_t counted = owned != nullptr ? bytes.size() : 0;
    if (counted > 0) budget_->Acquire(counted);
    Result<std::string> upload_id = UploadId();
    // `phrased`: the failure already names the file's operation.
    auto ended = [this, index, counted, borrowed, owned](Result<std::string> etag, bool phrased) {
      if (counted > 0) budget_->Release(counted);
      std::lock_guard<std::mutex> guard(mu_);
      if (etag.ok()) {
        etags_[static_cast<int>(index + 1)] = *etag;
      } else if (failure_.ok()) {
        failure_ = phrased ? etag.status() : Failed("write", path_, etag.status());
      }
      --in_flight_;
      if (borrowed != nullptr) --*borrowed;
      part_ended_.notify_all();
    };
    bool failed = false;  // an earlier part failed: the file fails with that, nothing more is sent
    {
      std::lock_guard<std::mutex> guard(mu_);
      failed = !failure_.ok();
    }
    if (!upload_id.ok()) {
      ended(upload_id.status(), true);
    } else if (failed) {
      ended(AbortedError(OpOn("write", path_) + ": an earlier part failed"), true);
    } else {
      client_.UploadPartAsync(bucket_, key_, *upload_id, static_cast<int>(index + 1), bytes,
                              [ended](Result<std::string> etag) { ended(std::move(etag), false); });
    }
    lock.lock();
  }

  // Until the parts counted in `borrowed` have ended.
  void Wait(int& borrowed) {
    std::unique_lock<std::mutex> lock(mu_);
    part_ended_.wait(lock, [&] { return borrowed == 0; });
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

  // With mu_ held: sends what is left and makes the object. Returns with the lock released or
  // held.
  Status Finish(std::unique_lock<std::mutex>& lock) {
    part_ended_.wait(lock, [&] { return in_flight_ == 0; });
    SP_RETURN_IF_ERROR(failure_);
    const uint64_t parts = (size_ + part_bytes_ - 1) / part_bytes_;
    const bool any_sent = !sent_.empty() || !upload_id_.empty();
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
    // The parts not sent yet, all at once: every one up to the end, the last cut to the size.
    for (uint64_t index = 0; index < parts; ++index) {
      if (!sent_.insert(index).second) continue;
      auto it = parts_.find(index);
      auto bytes = std::make_shared<std::vector<std::byte>>(
          it != parts_.end() ? std::move(it->second.bytes) : std::vector<std::byte>());
      if (it != parts_.end()) parts_.erase(it);
      const uint64_t length = std::min(part_bytes_, size_ - index * part_bytes_);
      bytes->resize(length, std::byte{0});
      StartPart(lock, index, ByteView(bytes->data(), bytes->size()), bytes, nullptr);
    }
    part_ended_.wait(lock, [&] { return in_flight_ == 0; });
    SP_RETURN_IF_ERROR(failure_);
    S3Parts list(etags_.begin(), etags_.end());
    if (list.size() != parts) {
      return InternalError(OpOn("close", path_) + ": " + std::to_string(list.size()) +
                           " parts sent for an object of " + std::to_string(parts));
    }
    lock.unlock();
    const std::string upload_id = upload_id_;
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
  const std::shared_ptr<S3PartBudget> budget_;
  const std::string bucket_;
  const std::string key_;
  const std::string path_;
  const uint64_t part_bytes_;
  const S3Condition condition_;
  std::mutex mu_;
  std::condition_variable part_ended_;
  std::map<uint64_t, Part> parts_;   // parts written to and not sent
  std::set<uint64_t> sent_;          // parts sent or being sent
  std::map<int, std::string> etags_;
  int in_flight_ = 0;                // parts being sent
  uint64_t size_ = 0;
  bool closed_ = false;
  Status failure_;
  std::mutex upload_mu_;
  std::string upload_id_;
};

// The ranged GETs of `held` bytes from `offset` scattered into `pieces`, cut into GETs of at most
// `most` bytes (the pieces cut where a GET ends).
std::vector<S3RangeRead> CutRange(uint64_t offset, uint64_t held,
                                  std::span<const MutableByteView> pieces, uint64_t most) {
  std::vector<S3RangeRead> reads;
  uint64_t at = 0;  // bytes placed so far
  for (const MutableByteView& p : pieces) {
    uint64_t used = 0;
    while (used < p.size() && at < held) {
      if (reads.empty() || at % most == 0) reads.push_back(S3RangeRead{offset + at, {}});
      const uint64_t room = most - at % most;
      const uint64_t n = std::min({p.size() - used, room, held - at});
      reads.back().pieces.push_back(MutableByteView(p.data() + used, n));
      used += n;
      at += n;
    }
    if (at >= held) break;
  }
  return reads;
}

class S3ReadableFile : public ReadableFile {
 public:
  S3ReadableFile(S3Client& client, std::string bucket, std::string key, std::string path,
                 uint64_t size, uint64_t read_part_bytes)
      : client_(client), bucket_(std::move(bucket)), key_(std::move(key)), path_(std::move(path)),
        size_(size), read_part_bytes_(read_part_bytes) {}

  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    return ReadVAt(offset, std::span<const MutableByteView>(&out, 1));
  }
  // Ranged GETs of at most S3StoreOptions::read_part_bytes, all in flight at once, each byte
  // written into its piece as it arrives.
  Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
    uint64_t total = 0;
    for (const MutableByteView& p : pieces) total += p.size();
    // What the file holds of the range is read and delivered even when the range runs past its
    // end (then kDataLoss).
    const uint64_t held = offset >= size_ ? 0 : std::min(total, size_ - offset);
    if (held > 0) {
      const std::vector<S3RangeRead> reads = CutRange(offset, held, pieces, read_part_bytes_);
      Status read = client_.GetRanges(bucket_, key_, reads);
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
  const uint64_t read_part_bytes_;
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
  options_.read_part_bytes = std::max<uint64_t>(options_.read_part_bytes, 1);
  budget_ = std::make_shared<S3PartBudget>(options_.part_budget_bytes);
}

uint64_t S3Store::peak_part_bytes_in_flight() const { return budget_->peak(); }

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
      *client_, budget_, bucket_, key, std::string(path), options_.part_bytes));
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
    S3WritableFile file(*client_, budget_, bucket_, key, std::string(path), options_.part_bytes,
                        c);
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
      std::make_unique<S3ReadableFile>(*client_, bucket_, key, std::string(path), *size,
                                       options_.read_part_bytes));
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
