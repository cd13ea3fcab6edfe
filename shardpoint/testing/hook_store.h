// Test stores that wrap another: ForwardingStore forwards every call (the conditional writes, file
// versions and unfinished writes too); HookStore runs a hook before the first file is created, so
// that a test can make something happen in the middle of a save (another save to the same path,
// the server killed) at a point it chooses.
#ifndef SHARDPOINT_TESTING_HOOK_STORE_H_
#define SHARDPOINT_TESTING_HOOK_STORE_H_

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/store/store.h"

namespace sp::testing {

// Forwards every call to a base store (borrowed; it must outlive this one): a base for test
// stores that change one or two calls.
class ForwardingStore : public Store {
 public:
  explicit ForwardingStore(Store* base) : base_(base) {}
  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    return base_->NewWritableFile(path);
  }
  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override {
    return base_->OpenReadable(path);
  }
  Status CreateDirs(std::string_view path) override { return base_->CreateDirs(path); }
  Status Rename(std::string_view from, std::string_view to) override {
    return base_->Rename(from, to);
  }
  Status SyncDir(std::string_view path) override { return base_->SyncDir(path); }
  Status RemoveFile(std::string_view path) override { return base_->RemoveFile(path); }
  Status RemoveDir(std::string_view path) override { return base_->RemoveDir(path); }
  Result<bool> IsDirectory(std::string_view path) override { return base_->IsDirectory(path); }
  Result<bool> Exists(std::string_view path) override { return base_->Exists(path); }
  Result<std::vector<DirEntry>> ListDir(std::string_view path) override {
    return base_->ListDir(path);
  }
  std::string name() const override { return "forward(" + base_->name() + ")"; }
  bool files_appear_when_closed() const override { return base_->files_appear_when_closed(); }
  bool reads_cross_the_network() const override { return base_->reads_cross_the_network(); }
  Result<std::string> FileVersion(std::string_view path) override {
    return base_->FileVersion(path);
  }
  Status WriteFileIf(std::string_view path, std::string_view bytes,
                     const FileCondition& condition) override {
    return base_->WriteFileIf(path, bytes, condition);
  }
  Result<int> DropUnfinishedWrites(std::string_view dir) override {
    return base_->DropUnfinishedWrites(dir);
  }

 protected:
  Store* base() const { return base_; }

 private:
  Store* base_;
};

// Runs `hook` once, before the first file is created. The ranks of a save create their files from
// threads of their own: the first runs the hook, and the others wait until it has returned.
class HookStore : public ForwardingStore {
 public:
  HookStore(Store* base, std::function<void()> hook)
      : ForwardingStore(base), hook_(std::move(hook)) {}
  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    std::call_once(once_, hook_);
    return base()->NewWritableFile(path);
  }
  std::string name() const override { return "hook(" + base()->name() + ")"; }

 private:
  std::function<void()> hook_;
  std::once_flag once_;
};

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_HOOK_STORE_H_
