// HookStore: forwards every call to a base store, running a hook (once) before the first file is
// created, so that a test can make something happen in the middle of a save (another save to the
// same path, say) at a point it chooses. The conditional writes (Store::WriteFileIf) and the
// version of files are forwarded too.
#ifndef SHARDPOINT_TESTING_HOOK_STORE_H_
#define SHARDPOINT_TESTING_HOOK_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/store/store.h"

namespace sp::testing {

// `base` is borrowed and must outlive this store.
class HookStore : public Store {
 public:
  HookStore(Store* base, std::function<void()> hook) : base_(base), hook_(std::move(hook)) {}
  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    if (hook_) std::exchange(hook_, nullptr)();
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
  std::string name() const override { return "hook(" + base_->name() + ")"; }
  bool files_appear_when_closed() const override { return base_->files_appear_when_closed(); }
  Result<std::string> FileVersion(std::string_view path) override {
    return base_->FileVersion(path);
  }
  Status WriteFileIf(std::string_view path, std::string_view bytes,
                     const FileCondition& condition) override {
    return base_->WriteFileIf(path, bytes, condition);
  }

 private:
  Store* base_;
  std::function<void()> hook_;
};

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_HOOK_STORE_H_
