#include "shardpoint/store/fault_store.h"

#include <algorithm>
#include <map>
#include <cstring>
#include <utility>

namespace sp {

// A file. Guarded by mu_.
struct FaultStore::Inode {
  // The durable content: what the file held at its last successful Sync; nullopt when never
  // synced (empty after a crash).
  std::optional<std::string> synced;
  // False for a file that existed before this store touched it and is still where the base store
  // has it, unchanged: its durable content is then read from there when first needed.
  bool captured = true;
};

// A directory. Guarded by mu_.
struct FaultStore::DirInode {
  bool loaded = false;  // entries listed from the base store
  std::map<std::string, Entry> live;
  std::map<std::string, Entry> durable;
};

namespace {

Status LostInCrash(std::string_view op, std::string_view path) {
  return FailedPreconditionError(OpOn(op, path) + ": the file was lost in a simulated crash");
}

std::vector<std::string> Components(const std::string& normal) {
  std::vector<std::string> parts;
  size_t pos = 0;
  while (pos < normal.size()) {
    size_t end = normal.find('/', pos);
    if (end == std::string::npos) end = normal.size();
    if (end > pos) parts.push_back(normal.substr(pos, end - pos));
    pos = end + 1;
  }
  return parts;
}

std::string RootPath(const std::string& normal) {
  return !normal.empty() && normal.front() == '/' ? "/" : "";
}

bool SameInode(const std::map<std::string, FaultStore::Entry>& entries, const std::string& name,
               const FaultStore::Entry& entry) {
  auto it = entries.find(name);
  return it != entries.end() && it->second.file == entry.file && it->second.dir == entry.dir;
}

}  // namespace

class FaultStore::WritableHandle : public WritableFile {
 public:
  WritableHandle(FaultStore* store, std::unique_ptr<WritableFile> base,
                 std::shared_ptr<Inode> inode)
      : store_(store), base_(std::move(base)), inode_(std::move(inode)), epoch_(store->epoch()) {}

  Status WriteAt(uint64_t offset, ByteView data) override { return Write(offset, data, false); }

  // Direct writes meet the same faults and, like any write, are lost in a crash until synced.
  uint64_t direct_io_alignment() const override { return base_->direct_io_alignment(); }
  Status WriteDirectAt(uint64_t offset, ByteView data) override {
    return Write(offset, data, true);
  }

  Status Sync() override {
    const std::string& p = path();
    if (store_->epoch() != epoch_) return LostInCrash("sync", p);
    SP_RETURN_IF_ERROR(store_->CheckFault(Op::kSync, p, {}, OpOn("sync", p)));
    SP_RETURN_IF_ERROR(base_->Sync());
    std::string content;
    {
      std::lock_guard<std::mutex> lock(mu_);
      content = shadow_;
    }
    store_->RecordSync(inode_, std::move(content));
    return OkStatus();
  }

  Status Close() override {
    const std::string& p = path();
    Status fault = store_->CheckFault(Op::kClose, p, {}, OpOn("close", p));
    Status closed = base_->Close();
    if (store_->epoch() != epoch_) return LostInCrash("close", p);
    return fault.ok() ? closed : fault;
  }

  Status Preallocate(uint64_t size) override {
    const std::string& p = path();
    if (store_->epoch() != epoch_) return LostInCrash("preallocate", p);
    SP_RETURN_IF_ERROR(store_->CheckFault(Op::kWrite, p, {}, OpOn("preallocate", p)));
    SP_RETURN_IF_ERROR(base_->Preallocate(size));
    std::lock_guard<std::mutex> lock(mu_);
    if (size > shadow_.size()) shadow_.resize(size);
    return OkStatus();
  }

  void StartWriteback(uint64_t offset, uint64_t length) override {
    if (store_->epoch() == epoch_) base_->StartWriteback(offset, length);
  }

  const std::string& path() const override { return base_->path(); }

 private:
  Status Write(uint64_t offset, ByteView data, bool direct) {
    const std::string& p = path();
    if (store_->epoch() != epoch_) return LostInCrash("write", p);
    SP_RETURN_IF_ERROR(store_->CheckFault(Op::kWrite, p, {}, OpAt("write", p, offset)));
    SP_RETURN_IF_ERROR(direct ? base_->WriteDirectAt(offset, data) : base_->WriteAt(offset, data));
    std::lock_guard<std::mutex> lock(mu_);
    if (offset + data.size() > shadow_.size()) shadow_.resize(offset + data.size());
    if (!data.empty()) std::memcpy(shadow_.data() + offset, data.data(), data.size());
    return OkStatus();
  }

  FaultStore* store_;
  std::unique_ptr<WritableFile> base_;
  std::shared_ptr<Inode> inode_;
  const uint64_t epoch_;
  std::mutex mu_;
  std::string shadow_;  // every byte written through this handle (it starts from an empty file)
};

class FaultStore::ReadableHandle : public ReadableFile {
 public:
  ReadableHandle(FaultStore* store, std::unique_ptr<ReadableFile> base)
      : store_(store), base_(std::move(base)), epoch_(store->epoch()) {}

  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    const std::string& p = path();
    if (store_->epoch() != epoch_) return LostInCrash("read", p);
    SP_RETURN_IF_ERROR(store_->CheckFault(Op::kRead, p, {}, OpAt("read", p, offset)));
    return base_->ReadAt(offset, out);
  }
  uint64_t size() const override { return base_->size(); }
  const std::string& path() const override { return base_->path(); }
  Status DropCache() override { return base_->DropCache(); }
  std::optional<double> CachedFraction(uint64_t offset, uint64_t length) const override {
    return base_->CachedFraction(offset, length);
  }
  void Prefetch(uint64_t offset, uint64_t length) const override {
    if (store_->epoch() == epoch_) base_->Prefetch(offset, length);
  }
  uint64_t direct_io_alignment() const override { return base_->direct_io_alignment(); }
  bool small_pages_shorten_requests() const override {
    return base_->small_pages_shorten_requests();
  }
  // A read like any other: it fails with the read faults, and after a crash.
  Result<uint64_t> ReadDirectVAt(uint64_t offset,
                                 std::span<const MutableByteView> pieces) const override {
    const std::string& p = path();
    if (store_->epoch() != epoch_) return LostInCrash("read", p);
    store_->direct_reads_.fetch_add(1);
    SP_RETURN_IF_ERROR(store_->CheckFault(Op::kRead, p, {}, OpAt("read", p, offset)));
    return base_->ReadDirectVAt(offset, pieces);
  }

 private:
  FaultStore* store_;
  std::unique_ptr<ReadableFile> base_;
  const uint64_t epoch_;
};

std::string_view FaultStore::OpName(Op op) {
  switch (op) {
    case Op::kCreate: return "create";
    case Op::kWrite: return "write";
    case Op::kSync: return "sync";
    case Op::kClose: return "close";
    case Op::kRename: return "rename";
    case Op::kSyncDir: return "sync directory";
    case Op::kRead: return "read";
    case Op::kOpen: return "open";
    case Op::kRemove: return "remove";
    case Op::kCreateDirs: return "create directories";
    case Op::kList: return "list directory";
  }
  return "unknown";
}

FaultStore::FaultStore(Store* base)
    : base_(base),
      absolute_root_(std::make_shared<DirInode>()),
      relative_root_(std::make_shared<DirInode>()) {}
FaultStore::~FaultStore() = default;

std::string FaultStore::name() const { return "fault(" + base_->name() + ")"; }

// ---------------------------------------------------------------------------------------------
// Faults and counters.

void FaultStore::FailNext(Op op, Status error, int count) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  next_faults_[static_cast<int>(op)] = {std::move(error), count};
}

void FaultStore::FailMatching(Op op, std::string path_substring, Status error) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  matching_faults_.push_back(MatchFault{op, std::move(path_substring), std::move(error)});
}

void FaultStore::ClearFaults() {
  std::lock_guard<std::mutex> lock(fault_mu_);
  for (auto& fault : next_faults_) fault = {Status(), 0};
  matching_faults_.clear();
}

Status FaultStore::CheckFault(Op op, std::string_view path, std::string_view other_path,
                              const std::string& what) {
  counts_[static_cast<int>(op)].fetch_add(1);
  std::lock_guard<std::mutex> lock(fault_mu_);
  auto& [next_error, calls_left] = next_faults_[static_cast<int>(op)];
  if (calls_left > 0 && !next_error.ok()) {
    --calls_left;
    return Status(next_error.code(), what + ": " + next_error.message());
  }
  for (const MatchFault& fault : matching_faults_) {
    if (fault.op != op || fault.error.ok()) continue;
    if (path.find(fault.substring) != std::string_view::npos ||
        (!other_path.empty() && other_path.find(fault.substring) != std::string_view::npos)) {
      return Status(fault.error.code(), what + ": " + fault.error.message());
    }
  }
  return OkStatus();
}

int64_t FaultStore::count(Op op) const { return counts_[static_cast<int>(op)].load(); }

void FaultStore::ResetCounts() {
  for (auto& count : counts_) count.store(0);
  direct_reads_.store(0);
}

// ---------------------------------------------------------------------------------------------
// The model.

Status FaultStore::Load(DirInode* dir, const std::string& path) {
  if (dir->loaded) return OkStatus();
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, base_->ListDir(path));
  for (const DirEntry& entry : entries) {
    Entry& live = dir->live[entry.name];
    if (entry.is_directory) {
      live.dir = std::make_shared<DirInode>();
    } else {
      live.file = std::make_shared<Inode>();
      live.file->captured = false;
    }
  }
  dir->durable = dir->live;
  dir->loaded = true;
  return OkStatus();
}

Result<FaultStore::DirInode*> FaultStore::FindDir(const std::string& normal) {
  DirInode* dir = RootPath(normal).empty() ? relative_root_.get() : absolute_root_.get();
  std::string path = RootPath(normal);
  for (const std::string& part : Components(normal)) {
    SP_RETURN_IF_ERROR(Load(dir, path));
    auto it = dir->live.find(part);
    if (it == dir->live.end() || it->second.dir == nullptr) return nullptr;
    dir = it->second.dir.get();
    path = JoinPath(path, part);
  }
  SP_RETURN_IF_ERROR(Load(dir, path));
  return dir;
}

Result<std::optional<FaultStore::Located>> FaultStore::Locate(const std::string& normal) {
  std::vector<std::string> parts = Components(normal);
  if (parts.empty()) return std::optional<Located>();
  SP_ASSIGN_OR_RETURN(DirInode* parent, FindDir(ParentPath(normal)));
  if (parent == nullptr) return std::optional<Located>();
  return std::optional<Located>(Located{parent, parts.back()});
}

Status FaultStore::Capture(Inode* file, const std::string& path) {
  if (file->captured) return OkStatus();
  SP_ASSIGN_OR_RETURN(std::string content, base_->ReadFile(path));
  file->synced = std::move(content);
  file->captured = true;
  return OkStatus();
}

Status FaultStore::CaptureTree(DirInode* dir, const std::string& path) {
  SP_RETURN_IF_ERROR(Load(dir, path));
  for (const auto& [name, entry] : dir->live) {
    std::string child = JoinPath(path, name);
    SP_RETURN_IF_ERROR(entry.dir ? CaptureTree(entry.dir.get(), child)
                                 : Capture(entry.file.get(), child));
  }
  return OkStatus();
}

// After CreateDirs: records every level that now exists as a (new, empty) directory.
Status FaultStore::RecordCreatedDirs(const std::string& normal) {
  DirInode* dir = RootPath(normal).empty() ? relative_root_.get() : absolute_root_.get();
  std::string path = RootPath(normal);
  for (const std::string& part : Components(normal)) {
    SP_RETURN_IF_ERROR(Load(dir, path));
    std::string child = JoinPath(path, part);
    auto it = dir->live.find(part);
    if (it == dir->live.end()) {
      Result<bool> is_dir = base_->IsDirectory(child);
      if (!is_dir.ok() || !*is_dir) return OkStatus();
      auto created = std::make_shared<DirInode>();
      created->loaded = true;
      it = dir->live.emplace(part, Entry{nullptr, std::move(created)}).first;
    }
    if (it->second.dir == nullptr) return OkStatus();
    dir = it->second.dir.get();
    path = std::move(child);
  }
  return OkStatus();
}

void FaultStore::RecordSync(const std::shared_ptr<Inode>& file, std::string content) {
  std::lock_guard<std::mutex> lock(mu_);
  file->synced = std::move(content);
  file->captured = true;
}

// ---------------------------------------------------------------------------------------------
// Store operations.

Result<std::unique_ptr<WritableFile>> FaultStore::NewWritableFile(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kCreate, path, {}, OpOn("create", path)));
  std::string normal = NormalizePath(path);
  std::lock_guard<std::mutex> lock(mu_);
  SP_ASSIGN_OR_RETURN(std::optional<Located> place, Locate(normal));
  std::shared_ptr<Inode> inode;
  if (place.has_value()) {
    auto it = place->parent->live.find(place->name);
    if (it != place->parent->live.end() && it->second.file != nullptr) {
      inode = it->second.file;
      SP_RETURN_IF_ERROR(Capture(inode.get(), normal));  // before the truncation
    }
  }
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewWritableFile(path));
  if (inode == nullptr) {
    inode = std::make_shared<Inode>();
    if (place.has_value()) place->parent->live[place->name] = Entry{inode, nullptr};
  }
  return std::unique_ptr<WritableFile>(
      std::make_unique<WritableHandle>(this, std::move(file), std::move(inode)));
}

Result<std::unique_ptr<ReadableFile>> FaultStore::OpenReadable(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kOpen, path, {}, OpOn("open", path)));
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base_->OpenReadable(path));
  return std::unique_ptr<ReadableFile>(std::make_unique<ReadableHandle>(this, std::move(file)));
}

Status FaultStore::CreateDirs(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kCreateDirs, path, {}, OpOn("create directory", path)));
  std::string normal = NormalizePath(path);
  std::lock_guard<std::mutex> lock(mu_);
  SP_RETURN_IF_ERROR(FindDir(ParentPath(normal)).status());  // list the levels that exist now
  Status status = base_->CreateDirs(path);
  // Even a failed call may have made some levels.
  SP_RETURN_IF_ERROR(RecordCreatedDirs(normal));
  return status;
}

Status FaultStore::Rename(std::string_view from, std::string_view to) {
  std::string what = "rename " + std::string(from) + " to " + std::string(to);
  SP_RETURN_IF_ERROR(CheckFault(Op::kRename, from, to, what));
  std::string from_normal = NormalizePath(from), to_normal = NormalizePath(to);
  std::lock_guard<std::mutex> lock(mu_);
  SP_ASSIGN_OR_RETURN(std::optional<Located> source, Locate(from_normal));
  SP_ASSIGN_OR_RETURN(std::optional<Located> target, Locate(to_normal));
  std::optional<Entry> moved;
  if (source.has_value()) {
    auto it = source->parent->live.find(source->name);
    if (it != source->parent->live.end()) moved = it->second;
  }
  // What moves, and a file it replaces, leave the place the base store has them: read them now.
  if (moved.has_value()) {
    SP_RETURN_IF_ERROR(moved->dir ? CaptureTree(moved->dir.get(), from_normal)
                                  : Capture(moved->file.get(), from_normal));
  }
  if (target.has_value()) {
    auto it = target->parent->live.find(target->name);
    if (it != target->parent->live.end() && it->second.file != nullptr) {
      SP_RETURN_IF_ERROR(Capture(it->second.file.get(), to_normal));
    }
  }
  SP_RETURN_IF_ERROR(base_->Rename(from, to));
  if (from_normal == to_normal || !moved.has_value()) return OkStatus();
  source->parent->live.erase(source->name);
  if (target.has_value()) target->parent->live[target->name] = *moved;
  return OkStatus();
}

Status FaultStore::SyncDir(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kSyncDir, path, {}, OpOn("sync directory", path)));
  std::string normal = NormalizePath(path);
  std::lock_guard<std::mutex> lock(mu_);
  SP_RETURN_IF_ERROR(base_->SyncDir(path));
  SP_ASSIGN_OR_RETURN(DirInode* dir, FindDir(normal));
  if (dir != nullptr) dir->durable = dir->live;
  return OkStatus();
}

Status FaultStore::RemoveFile(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kRemove, path, {}, OpOn("remove", path)));
  std::string normal = NormalizePath(path);
  std::lock_guard<std::mutex> lock(mu_);
  SP_ASSIGN_OR_RETURN(std::optional<Located> place, Locate(normal));
  if (place.has_value()) {
    auto it = place->parent->live.find(place->name);
    if (it != place->parent->live.end() && it->second.file != nullptr) {
      SP_RETURN_IF_ERROR(Capture(it->second.file.get(), normal));
    }
  }
  SP_RETURN_IF_ERROR(base_->RemoveFile(path));
  if (place.has_value()) place->parent->live.erase(place->name);
  return OkStatus();
}

Status FaultStore::RemoveDir(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kRemove, path, {}, OpOn("remove directory", path)));
  std::string normal = NormalizePath(path);
  std::lock_guard<std::mutex> lock(mu_);
  SP_ASSIGN_OR_RETURN(std::optional<Located> place, Locate(normal));
  if (place.has_value()) {
    auto it = place->parent->live.find(place->name);
    if (it != place->parent->live.end() && it->second.dir != nullptr) {
      SP_RETURN_IF_ERROR(Load(it->second.dir.get(), normal));  // so a crash can bring it back
    }
  }
  SP_RETURN_IF_ERROR(base_->RemoveDir(path));
  if (place.has_value()) place->parent->live.erase(place->name);
  return OkStatus();
}

Result<bool> FaultStore::IsDirectory(std::string_view path) { return base_->IsDirectory(path); }

Result<bool> FaultStore::Exists(std::string_view path) { return base_->Exists(path); }

Result<std::vector<DirEntry>> FaultStore::ListDir(std::string_view path) {
  SP_RETURN_IF_ERROR(CheckFault(Op::kList, path, {}, OpOn("list directory", path)));
  return base_->ListDir(path);
}

// ---------------------------------------------------------------------------------------------
// Crash simulation. An entry is kept in place when the same inode is both live and durable under
// the same name of the same directory, and (for a file) was never changed through this store;
// everything else is removed, then the durable tree is written back.

Status FaultStore::RemoveLive(DirInode* dir, const std::string& path, bool whole) {
  if (!dir->loaded && !whole) return OkStatus();  // never touched
  SP_RETURN_IF_ERROR(Load(dir, path));
  for (const auto& [name, entry] : dir->live) {
    const std::string child = JoinPath(path, name);
    const bool stable = !whole && SameInode(dir->durable, name, entry);
    if (entry.file != nullptr) {
      if (stable && !entry.file->captured) continue;
      SP_RETURN_IF_ERROR(Capture(entry.file.get(), child));
      SP_RETURN_IF_ERROR(base_->RemoveFile(child).WithContext("simulated crash"));
      continue;
    }
    SP_RETURN_IF_ERROR(RemoveLive(entry.dir.get(), child, !stable));
    if (!stable) SP_RETURN_IF_ERROR(base_->RemoveDir(child).WithContext("simulated crash"));
  }
  return OkStatus();
}

Status FaultStore::BuildDurable(DirInode* dir, const std::string& path, bool fresh) {
  if (!dir->loaded) return OkStatus();  // never touched: still in place (or fresh and empty)
  for (const auto& [name, entry] : dir->durable) {
    const std::string child = JoinPath(path, name);
    const bool stable = !fresh && SameInode(dir->live, name, entry);
    if (entry.dir != nullptr) {
      if (!stable) SP_RETURN_IF_ERROR(base_->CreateDirs(child).WithContext("simulated crash"));
      SP_RETURN_IF_ERROR(BuildDurable(entry.dir.get(), child, !stable));
      continue;
    }
    if (stable && !entry.file->captured) continue;
    const std::string content = entry.file->synced.value_or(std::string());
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewWritableFile(child));
    SP_RETURN_IF_ERROR(file->WriteAt(0, AsBytes(content)).WithContext("simulated crash"));
    SP_RETURN_IF_ERROR(file->Sync().WithContext("simulated crash"));
    SP_RETURN_IF_ERROR(file->Close().WithContext("simulated crash"));
  }
  return OkStatus();
}

Status FaultStore::SimulateCrash() {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_.fetch_add(1);
  for (auto* root : {&absolute_root_, &relative_root_}) {
    const std::string path = root == &absolute_root_ ? "/" : "";
    SP_RETURN_IF_ERROR(RemoveLive(root->get(), path, /*whole=*/false));
    SP_RETURN_IF_ERROR(BuildDurable(root->get(), path, /*fresh=*/false));
    *root = std::make_shared<DirInode>();
  }
  return OkStatus();
}

}  // namespace sp
