#include "shardpoint/store/memory_store.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

namespace sp {

struct MemoryStore::FileData {
  std::mutex mu;
  std::string bytes;
};

namespace {

using FileData = MemoryStore::FileData;

std::string Key(std::string_view path) {
  std::string normal = NormalizePath(path);
  if (!normal.empty() && normal.front() == '/') normal.erase(0, 1);
  return normal;
}

Status ClosedError(std::string_view op, std::string_view path) {
  return FailedPreconditionError(OpOn(op, path) + ": the file is already closed");
}

class MemoryWritableFile : public WritableFile {
 public:
  MemoryWritableFile(std::shared_ptr<FileData> data, std::string path)
      : data_(std::move(data)), path_(std::move(path)) {}

  Status WriteAt(uint64_t offset, ByteView data) override {
    if (closed_.load()) return ClosedError("write", path_);
    if (offset > std::numeric_limits<uint64_t>::max() - data.size()) {
      return InvalidArgumentError(OpOn("write", path_) + " at offset " + std::to_string(offset) +
                                  ": the range overflows 64 bits");
    }
    std::lock_guard<std::mutex> lock(data_->mu);
    if (offset + data.size() > data_->bytes.size()) data_->bytes.resize(offset + data.size());
    if (!data.empty()) std::memcpy(data_->bytes.data() + offset, data.data(), data.size());
    return OkStatus();
  }

  Status Sync() override {
    if (closed_.load()) return ClosedError("sync", path_);
    return OkStatus();
  }

  Status Close() override {
    if (closed_.exchange(true)) return ClosedError("close", path_);
    return OkStatus();
  }

  Status Preallocate(uint64_t size) override {
    if (closed_.load()) return ClosedError("preallocate", path_);
    std::lock_guard<std::mutex> lock(data_->mu);
    if (size > data_->bytes.size()) data_->bytes.resize(size);
    return OkStatus();
  }

  const std::string& path() const override { return path_; }

 private:
  std::shared_ptr<FileData> data_;
  std::string path_;
  std::atomic<bool> closed_{false};
};

class MemoryReadableFile : public ReadableFile {
 public:
  MemoryReadableFile(std::shared_ptr<FileData> data, std::string path, uint64_t size)
      : data_(std::move(data)), path_(std::move(path)), size_(size) {}

  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    std::lock_guard<std::mutex> lock(data_->mu);
    const uint64_t held = data_->bytes.size();
    if (offset > held || out.size() > held - offset) {
      return DataLossError(OpOn("read", path_) + " at offset " + std::to_string(offset) +
                           ": wanted " + std::to_string(out.size()) +
                           " bytes but the file holds " + std::to_string(held) + " bytes");
    }
    if (!out.empty()) std::memcpy(out.data(), data_->bytes.data() + offset, out.size());
    return OkStatus();
  }

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }

 private:
  std::shared_ptr<FileData> data_;
  std::string path_;
  uint64_t size_;
};

}  // namespace

MemoryStore::~MemoryStore() = default;

const MemoryStore::Node* MemoryStore::Find(const std::string& key) const {
  static const Node kRoot{true, nullptr};
  if (key.empty()) return &kRoot;
  auto it = nodes_.find(key);
  return it == nodes_.end() ? nullptr : &it->second;
}

int MemoryStore::ParentError(const std::string& key) const {
  // Walk from the top so that a file in the middle gives ENOTDIR, as the kernel reports it.
  size_t pos = 0;
  while (true) {
    size_t slash = key.find('/', pos);
    if (slash == std::string::npos) return 0;
    const Node* node = Find(key.substr(0, slash));
    if (node == nullptr) return ENOENT;
    if (!node->is_directory) return ENOTDIR;
    pos = slash + 1;
  }
}

bool MemoryStore::HasChildren(const std::string& key) const {
  if (key.empty()) return !nodes_.empty();
  auto it = nodes_.lower_bound(key + "/");
  return it != nodes_.end() && it->first.compare(0, key.size() + 1, key + "/") == 0;
}

Result<std::unique_ptr<WritableFile>> MemoryStore::NewWritableFile(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node != nullptr && node->is_directory) return ErrnoToStatus(EISDIR, OpOn("create", path));
  std::shared_ptr<FileData> data;
  if (node != nullptr) {
    data = node->file;
    std::lock_guard<std::mutex> data_lock(data->mu);
    data->bytes.clear();
  } else {
    if (int error = ParentError(key); error != 0) return ErrnoToStatus(error, OpOn("create", path));
    data = std::make_shared<FileData>();
    nodes_[key] = Node{false, data};
  }
  return std::unique_ptr<WritableFile>(
      std::make_unique<MemoryWritableFile>(std::move(data), std::string(path)));
}

Result<std::unique_ptr<ReadableFile>> MemoryStore::OpenReadable(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("open", path));
  if (node->is_directory) return ErrnoToStatus(EISDIR, OpOn("open", path));
  uint64_t size;
  {
    std::lock_guard<std::mutex> data_lock(node->file->mu);
    size = node->file->bytes.size();
  }
  return std::unique_ptr<ReadableFile>(
      std::make_unique<MemoryReadableFile>(node->file, std::string(path), size));
}

Status MemoryStore::CreateDirs(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  size_t pos = 0;
  while (pos <= key.size() && !key.empty()) {
    size_t slash = key.find('/', pos);
    if (slash == std::string::npos) slash = key.size();
    std::string prefix = key.substr(0, slash);
    const Node* node = Find(prefix);
    if (node == nullptr) {
      nodes_[prefix] = Node{true, nullptr};
    } else if (!node->is_directory) {
      return FailedPreconditionError(OpOn("create directory", path) + ": " + prefix +
                                     " exists and is not a directory");
    }
    pos = slash + 1;
  }
  return OkStatus();
}

Status MemoryStore::RenameDirectory(const std::string& from, const std::string& to,
                                    std::string_view what) {
  if (to.size() > from.size() && to.compare(0, from.size() + 1, from + "/") == 0) {
    return ErrnoToStatus(EINVAL, what);  // into its own subtree
  }
  const Node* target = Find(to);
  if (target != nullptr && !target->is_directory) return ErrnoToStatus(ENOTDIR, what);
  if (target != nullptr && HasChildren(to)) return ErrnoToStatus(ENOTEMPTY, what);
  std::vector<std::pair<std::string, Node>> moved;
  const std::string prefix = from + "/";
  for (auto it = nodes_.lower_bound(prefix);
       it != nodes_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
    moved.emplace_back(to + "/" + it->first.substr(prefix.size()), std::move(it->second));
    it = nodes_.erase(it);
  }
  nodes_.erase(from);
  nodes_[to] = Node{true, nullptr};
  for (auto& [key, node] : moved) nodes_[key] = std::move(node);
  return OkStatus();
}

Status MemoryStore::Rename(std::string_view from, std::string_view to) {
  std::string from_key = Key(from), to_key = Key(to);
  std::string what = "rename " + std::string(from) + " to " + std::string(to);
  std::lock_guard<std::mutex> lock(mu_);
  if (int error = ParentError(from_key); error != 0) return ErrnoToStatus(error, what);
  const Node* source = Find(from_key);
  if (source == nullptr) return ErrnoToStatus(ENOENT, what);
  if (from_key.empty() || to_key.empty()) return ErrnoToStatus(EBUSY, what);
  if (int error = ParentError(to_key); error != 0) return ErrnoToStatus(error, what);
  if (from_key == to_key) return OkStatus();
  if (source->is_directory) return RenameDirectory(from_key, to_key, what);
  const Node* target = Find(to_key);
  if (target != nullptr && target->is_directory) return ErrnoToStatus(EISDIR, what);
  Node node = *source;
  nodes_.erase(from_key);
  nodes_[to_key] = std::move(node);
  return OkStatus();
}

Status MemoryStore::SyncDir(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("sync directory", path));
  if (!node->is_directory) return ErrnoToStatus(ENOTDIR, OpOn("sync directory", path));
  return OkStatus();
}

Status MemoryStore::RemoveFile(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("remove", path));
  if (node->is_directory) return ErrnoToStatus(EISDIR, OpOn("remove", path));
  nodes_.erase(key);
  return OkStatus();
}

Status MemoryStore::RemoveDir(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("remove directory", path));
  if (!node->is_directory) return ErrnoToStatus(ENOTDIR, OpOn("remove directory", path));
  if (key.empty()) return ErrnoToStatus(EBUSY, OpOn("remove directory", path));
  if (HasChildren(key)) {
    return FailedPreconditionError(ErrnoToStatus(ENOTEMPTY, OpOn("remove directory", path)).message());
  }
  nodes_.erase(key);
  return OkStatus();
}

Result<bool> MemoryStore::IsDirectory(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("stat", path));
  return node->is_directory;
}

Result<bool> MemoryStore::Exists(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  return Find(key) != nullptr;
}

Result<std::vector<DirEntry>> MemoryStore::ListDir(std::string_view path) {
  std::string key = Key(path);
  std::lock_guard<std::mutex> lock(mu_);
  const Node* node = Find(key);
  if (node == nullptr) return ErrnoToStatus(ENOENT, OpOn("list directory", path));
  if (!node->is_directory) return ErrnoToStatus(ENOTDIR, OpOn("list directory", path));
  const std::string prefix = key.empty() ? std::string() : key + "/";
  std::vector<DirEntry> entries;
  // Keys under one prefix are ordered by the rest of the key, so children come out sorted.
  for (auto it = nodes_.lower_bound(prefix);
       it != nodes_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    std::string_view name = std::string_view(it->first).substr(prefix.size());
    if (name.find('/') != std::string_view::npos) continue;  // deeper descendant
    DirEntry entry;
    entry.name = std::string(name);
    entry.is_directory = it->second.is_directory;
    if (!entry.is_directory) {
      std::lock_guard<std::mutex> data_lock(it->second.file->mu);
      entry.size = it->second.file->bytes.size();
    }
    entries.push_back(std::move(entry));
  }
  return entries;
}

uint64_t MemoryStore::TotalFileBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (const auto& [key, node] : nodes_) {
    if (node.is_directory) continue;
    std::lock_guard<std::mutex> data_lock(node.file->mu);
    total += node.file->bytes.size();
  }
  return total;
}

}  // namespace sp
