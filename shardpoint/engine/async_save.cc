#include "shardpoint/engine/async_save.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "shardpoint/engine/save_internal.h"
#include "shardpoint/exec/task_group.h"

namespace sp {
namespace {

// Each piece starts on a cache line of the staging buffer.
constexpr uint64_t kPieceAlignment = 64;
// Copies are split into tasks of at most this many bytes so one large tensor uses every thread.
constexpr uint64_t kCopyTaskBytes = uint64_t{8} << 20;

uint64_t AlignUp(uint64_t n, uint64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

// Where each piece goes in staging: offsets[t][p], and the total size.
struct StagingLayout {
  std::vector<std::vector<uint64_t>> offsets;
  uint64_t total_bytes = 0;
};

// Pieces without memory are allowed when `fill` is set (SaveOptions::fills(): the background
// save gets their bytes as it writes them); they take no staging.
Result<StagingLayout> LayOut(const SaveState& state, bool fill) {
  StagingLayout layout;
  for (const SaveTensor& t : state.tensors) {
    std::vector<uint64_t>& offsets = layout.offsets.emplace_back();
    for (const ConstPieceView& piece : t.pieces) {
      if (std::any_of(piece.box.sizes.begin(), piece.box.sizes.end(),
                      [](int64_t s) { return s < 0; })) {
        return InvalidArgumentError("tensor '" + t.name + "' piece " + piece.box.ToString() +
                                    " has a negative size");
      }
      const uint64_t bytes = static_cast<uint64_t>(piece.box.volume()) * DTypeSize(t.dtype);
      if (bytes > 0 && piece.data == nullptr && !fill) {
        return InvalidArgumentError("tensor '" + t.name + "' piece " + piece.box.ToString() +
                                    " has no data (null pointer for " + std::to_string(bytes) +
                                    " bytes)");
      }
      offsets.push_back(layout.total_bytes);
      if (piece.data != nullptr) layout.total_bytes += AlignUp(bytes, kPieceAlignment);
    }
  }
  return layout;
}

// One memcpy of at most kCopyTaskBytes.
struct CopyTask {
  const std::byte* from;
  std::byte* to;
  uint64_t bytes;
};

}  // namespace

AsyncSaver::AsyncSaver(uint64_t staging_budget_bytes) : budget_bytes_(staging_budget_bytes) {}

AsyncSaver::~AsyncSaver() { JoinAndTakeResult().IgnoreError(); }

ThreadPool* AsyncSaver::PoolFor(const SaveOptions& options) {
  if (options.pool != nullptr) return options.pool;
  if (owned_pool_ == nullptr || owned_pool_threads_ != options.threads) {
    owned_pool_.reset();
    owned_pool_ = std::make_unique<ThreadPool>(options.threads);
    owned_pool_threads_ = options.threads;
  }
  return owned_pool_.get();
}

Status AsyncSaver::Stage(const SaveState& state, const std::string& path, ThreadPool* pool,
                         bool fill, AsyncStaging staging) {
  SP_ASSIGN_OR_RETURN(StagingLayout layout, LayOut(state, fill));
  if (staging == AsyncStaging::kBorrow) {
    staged_ = state;  // the caller's staging, unchanged until the save is over
    return OkStatus();
  }
  if (budget_bytes_ != 0 && layout.total_bytes > budget_bytes_) {
    return ResourceExhaustedError("async save to " + path + " needs " +
                                  std::to_string(layout.total_bytes) +
                                  " bytes of staging memory, over the budget of " +
                                  std::to_string(budget_bytes_) + " bytes");
  }
  if (staging_.size() < layout.total_bytes) {
    staging_ = AlignedBuffer();  // free the old block before taking the larger one
    staging_ = AlignedBuffer(layout.total_bytes);
  }
  staged_ = SaveState{};
  staged_.objects = state.objects;
  std::vector<CopyTask> tasks;
  for (size_t t = 0; t < state.tensors.size(); ++t) {
    const SaveTensor& source = state.tensors[t];
    SaveTensor& staged = staged_.tensors.emplace_back();
    staged.name = source.name;
    staged.dtype = source.dtype;
    staged.shape = source.shape;
    for (size_t p = 0; p < source.pieces.size(); ++p) {
      const ConstPieceView& piece = source.pieces[p];
      if (piece.data == nullptr) {  // filled by the background save
        staged.pieces.push_back(piece);
        continue;
      }
      std::byte* to = staging_.data() + layout.offsets[t][p];
      staged.pieces.push_back(ConstPieceView{piece.box, to});
      const uint64_t bytes = static_cast<uint64_t>(piece.box.volume()) * DTypeSize(source.dtype);
      for (uint64_t done = 0; done < bytes; done += kCopyTaskBytes) {
        tasks.push_back({piece.data + done, to + done, std::min(kCopyTaskBytes, bytes - done)});
      }
    }
  }
  return ParallelFor(pool, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    std::memcpy(tasks[i].to, tasks[i].from, tasks[i].bytes);
    return OkStatus();
  });
}

Status AsyncSaver::Start(const SaveState& state, std::string path, SaveOptions options,
                         AsyncStaging staging) {
  SP_RETURN_IF_ERROR(TakePrevious());
  options.pool = PoolFor(options);
  Status staged = Stage(state, path, options.pool, options.fills(), staging);
  if (!staged.ok()) {
    staged_ = SaveState{};
    if (options.comm == nullptr) return staged;
    return StartFailedLocked(staged, std::move(path), std::move(options));
  }
  Launch(std::move(path), std::move(options), OkStatus());
  return OkStatus();
}

Status AsyncSaver::StartFailed(Status failure, std::string path, SaveOptions options) {
  SP_RETURN_IF_ERROR(TakePrevious());
  staged_ = SaveState{};
  if (options.comm == nullptr) return failure;
  options.pool = PoolFor(options);
  return StartFailedLocked(std::move(failure), std::move(path), std::move(options));
}

Status AsyncSaver::StartFailedLocked(Status failure, std::string path, SaveOptions options) {
  Launch(std::move(path), std::move(options), failure);
  std::lock_guard<std::mutex> lock(mu_);
  failure_reported_ = true;
  return failure;
}

Status AsyncSaver::TakePrevious() {
  const std::string previous_path = path_;
  const bool reported = failure_reported_;
  Status previous = JoinAndTakeResult();
  failure_reported_ = false;
  if (previous.ok() || reported) return OkStatus();
  return previous.WithContext("previous async save to " + previous_path);
}

void AsyncSaver::Launch(std::string path, SaveOptions options, Status local_failure) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    path_ = path;
  }
  running_.store(true);
  worker_ = std::thread([this, path = std::move(path), options = std::move(options),
                         local_failure = std::move(local_failure)] {
    Status status = SaveWithLocalStatus(staged_, path, options, local_failure);
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(status);
    }
    running_.store(false);
  });
}

Status AsyncSaver::JoinAndTakeResult() {
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lock(mu_);
  Status result = std::move(result_);
  result_ = OkStatus();
  return result;
}

Status AsyncSaver::Wait() { return JoinAndTakeResult(); }

bool AsyncSaver::Done() const { return !running_.load(); }

uint64_t AsyncSaver::staging_capacity_bytes() const { return staging_.size(); }

}  // namespace sp
