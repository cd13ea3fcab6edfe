// Test helpers for the checkpoint tools (retention, prune, diff): small checkpoints saved from
// whole tensors by several in-process ranks, and a store that stops working after a given number
// of changes (for crash sweeps with FaultStore).
#ifndef SHARDPOINT_ENGINE_EDIT_TEST_UTIL_H_
#define SHARDPOINT_ENGINE_EDIT_TEST_UTIL_H_

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"

namespace sp::testing {

// A whole tensor and who holds it: `owner` >= 0 holds all of it; -1 splits dimension 0 into
// one slab per rank (rank-0 tensors and tensors with fewer rows than ranks go to rank 0).
struct WholeTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<std::byte> bytes;  // row-major, the whole tensor
  int owner = -1;
};

template <typename T>
WholeTensor MakeTensor(std::string name, DType dtype, Shape shape, const std::vector<T>& values,
                       int owner = -1) {
  WholeTensor t{std::move(name), dtype, std::move(shape), {}, owner};
  t.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

// Floats start, start + 1, ... of the given shape.
inline WholeTensor Iota(std::string name, Shape shape, float start = 0, int owner = -1) {
  std::vector<float> values(static_cast<size_t>(ShapeVolume(shape)));
  for (size_t i = 0; i < values.size(); ++i) values[i] = start + static_cast<float>(i);
  return MakeTensor(std::move(name), DType::kFloat32, std::move(shape), values, owner);
}

// The part of `t` that `rank` of `ranks` holds, as a box and a pointer into t.bytes.
inline std::vector<ConstPieceView> PiecesOf(const WholeTensor& t, int rank, int ranks) {
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const bool split = t.owner < 0 && !t.shape.empty() && rows >= ranks;
  const int owner = t.owner >= 0 ? t.owner : 0;
  if (!split) {
    if (rank != owner) return {};
    return {{Box{std::vector<int64_t>(t.shape.size(), 0), t.shape}, t.bytes.data()}};
  }
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(t.bytes.size()) / rows;
  const int64_t begin = rows * rank / ranks, end = rows * (rank + 1) / ranks;
  Box box{std::vector<int64_t>(t.shape.size(), 0), t.shape};
  box.offsets[0] = begin;
  box.sizes[0] = end - begin;
  return {{box, t.bytes.data() + begin * row_bytes}};
}

// Saves `tensors` and `objects` at `path` from `ranks` in-process ranks.
inline Status SaveWhole(Store* store, const std::string& path,
                        const std::vector<WholeTensor>& tensors,
                        const std::vector<ObjectEntry>& objects = {}, int ranks = 2,
                        SaveOptions options = {}) {
  std::vector<Status> statuses = RunRanks(ranks, [&](Communicator& comm) {
    SaveState state;
    for (const WholeTensor& t : tensors) {
      state.tensors.push_back({t.name, t.dtype, t.shape, PiecesOf(t, comm.rank(), ranks)});
    }
    if (comm.rank() == 0) state.objects = objects;
    SaveOptions mine = options;
    mine.comm = &comm;
    mine.store = store;
    mine.threads = 2;
    return Save(state, path, mine);
  });
  for (const Status& s : statuses) SP_RETURN_IF_ERROR(s);
  return OkStatus();
}

// Loads tensor `name` whole (dtype and shape from the metadata); one rank, with `options` (its
// store and threads set here).
inline Result<std::vector<std::byte>> LoadWhole(Store* store, const std::string& path,
                                                const std::string& name,
                                                LoadOptions options = {}) {
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, ReadCheckpointMetadata(path, store));
  const TensorMetadata* t = md.FindTensor(name);
  if (t == nullptr) return NotFoundError("no tensor " + name);
  std::vector<std::byte> out(t->total_bytes());
  LoadState state;
  state.tensors.push_back(
      {name,
       t->dtype,
       t->shape,
       {{Box{std::vector<int64_t>(t->shape.size(), 0), t->shape}, out.data()}}});
  options.store = store;
  options.threads = 2;
  SP_RETURN_IF_ERROR(Load(state, path, options).status());
  return out;
}

// Forwards to a base store until `budget` changes (file creations, writes, syncs, renames,
// removals, directory syncs) have been made; every call after that fails with kUnavailable, as if
// the process had died there. Reads keep working (they change nothing).
class StopAfterStore : public Store {
 public:
  StopAfterStore(Store* base, int64_t budget) : base_(base), budget_(budget) {}
  bool stopped() const { return stopped_.load(); }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    SP_RETURN_IF_ERROR(Spend("create", path));
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f, base_->NewWritableFile(path));
    return std::unique_ptr<WritableFile>(std::make_unique<File>(this, std::move(f)));
  }
  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override {
    return base_->OpenReadable(path);
  }
  Status CreateDirs(std::string_view p) override {
    SP_RETURN_IF_ERROR(Spend("mkdir", p));
    return base_->CreateDirs(p);
  }
  Status Rename(std::string_view from, std::string_view to) override {
    SP_RETURN_IF_ERROR(Spend("rename", from));
    return base_->Rename(from, to);
  }
  Status SyncDir(std::string_view p) override {
    SP_RETURN_IF_ERROR(Spend("syncdir", p));
    return base_->SyncDir(p);
  }
  Status RemoveFile(std::string_view p) override {
    SP_RETURN_IF_ERROR(Spend("remove", p));
    return base_->RemoveFile(p);
  }
  Status RemoveDir(std::string_view p) override {
    SP_RETURN_IF_ERROR(Spend("rmdir", p));
    return base_->RemoveDir(p);
  }
  Result<bool> IsDirectory(std::string_view p) override { return base_->IsDirectory(p); }
  Result<bool> Exists(std::string_view p) override { return base_->Exists(p); }
  Result<std::vector<DirEntry>> ListDir(std::string_view p) override { return base_->ListDir(p); }
  std::string name() const override { return "stop-after(" + base_->name() + ")"; }

 private:
  class File : public WritableFile {
   public:
    File(StopAfterStore* store, std::unique_ptr<WritableFile> base)
        : store_(store), base_(std::move(base)) {}
    Status WriteAt(uint64_t offset, ByteView data) override {
      SP_RETURN_IF_ERROR(store_->Spend("write", path()));
      return base_->WriteAt(offset, data);
    }
    Status Sync() override {
      SP_RETURN_IF_ERROR(store_->Spend("sync", path()));
      return base_->Sync();
    }
    Status Close() override {
      SP_RETURN_IF_ERROR(store_->Spend("close", path()));
      return base_->Close();
    }
    const std::string& path() const override { return base_->path(); }

   private:
    StopAfterStore* store_;
    std::unique_ptr<WritableFile> base_;
  };

  Status Spend(std::string_view what, std::string_view path) {
    if (budget_.fetch_sub(1) > 0) return OkStatus();
    stopped_ = true;
    return UnavailableError(std::string(what) + " " + std::string(path) + ": stopped");
  }

  Store* base_;
  std::atomic<int64_t> budget_;
  std::atomic<bool> stopped_{false};
};

}  // namespace sp::testing

#endif  // SHARDPOINT_ENGINE_EDIT_TEST_UTIL_H_
