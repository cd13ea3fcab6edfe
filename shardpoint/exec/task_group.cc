#include "shardpoint/exec/task_group.h"

#include <algorithm>
#include <memory>
#include <new>
#include <stdexcept>

namespace sp {
namespace {

// Runs `task`; an allocation that fails inside it (std::bad_alloc, or std::length_error for a
// size beyond what a container can hold) becomes kResourceExhausted instead of ending the
// process from a worker thread.
template <typename Task>
Status RunGuarded(const Task& task) {
  try {
    return task();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("out of memory: an allocation failed (std::bad_alloc)");
  } catch (const std::length_error& e) {
    return ResourceExhaustedError(std::string("out of memory: a size is too large (") +
                                  e.what() + ")");
  }
}

}  // namespace

TaskGroup::~TaskGroup() { Wait().IgnoreError(); }

void TaskGroup::Run(std::function<Status()> task) { Submit(std::move(task), std::nullopt); }

void TaskGroup::RunOrdered(std::function<Status()> task, double order) {
  Submit(std::move(task), order);
}

void TaskGroup::Submit(std::function<Status()> task, std::optional<double> order) {
  if (pool_ == nullptr || pool_->InWorkerThread()) {
    Status s = cancelled() ? OkStatus() : RunGuarded(task);
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok() && first_error_.ok()) {
      first_error_ = std::move(s);
      cancelled_ = true;
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
  }
  auto run = [this, task = std::move(task)] { Finish(cancelled() ? OkStatus() : RunGuarded(task)); };
  if (order.has_value()) {
    pool_->ScheduleOrdered(std::move(run), *order);
  } else {
    pool_->Schedule(std::move(run));
  }
}

void TaskGroup::Finish(Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.ok() && first_error_.ok()) {
    first_error_ = std::move(status);
    cancelled_ = true;
  }
  if (--pending_ == 0) cv_.notify_all();
}

Status TaskGroup::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
  return first_error_;
}

Status ParallelFor(ThreadPool* pool, int64_t n, const std::function<Status(int64_t)>& body) {
  if (n <= 0) return OkStatus();
  int64_t blocks = pool == nullptr ? 1 : std::min<int64_t>(n, pool->size());
  TaskGroup group(pool);
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t begin = n * b / blocks;
    int64_t end = n * (b + 1) / blocks;
    group.Run([&body, &group, begin, end]() -> Status {
      for (int64_t i = begin; i < end && !group.cancelled(); ++i) SP_RETURN_IF_ERROR(body(i));
      return OkStatus();
    });
  }
  return group.Wait();
}

Status ParallelForInOrder(ThreadPool* pool, int64_t n,
                          const std::function<Status(int64_t)>& body) {
  if (n <= 0) return OkStatus();
  const int64_t blocks = pool == nullptr ? 1 : std::min<int64_t>(n, pool->size());
  std::atomic<int64_t> lowest_failed{n};
  std::mutex mu;
  Status first_error;
  TaskGroup group(pool);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = n * b / blocks;
    const int64_t end = n * (b + 1) / blocks;
    group.Run([&, begin, end]() -> Status {
      // Every index below the lowest failed one runs, so the error kept is the one a loop on one
      // thread would stop at; an index above it cannot change that and is skipped.
      for (int64_t i = begin; i < end && i < lowest_failed.load(std::memory_order_relaxed); ++i) {
        Status s = RunGuarded([&body, i] { return body(i); });
        if (s.ok()) continue;
        std::lock_guard<std::mutex> lock(mu);
        if (i < lowest_failed.load(std::memory_order_relaxed)) {
          lowest_failed.store(i, std::memory_order_relaxed);
          first_error = std::move(s);
        }
        break;
      }
      return OkStatus();
    });
  }
  SP_RETURN_IF_ERROR(group.Wait());
  return first_error;
}

Status ParallelForHelped(ThreadPool* pool, int64_t n, const std::function<Status(int64_t)>& body) {
  if (n <= 0) return OkStatus();
  // Shared with the helpers, which may start after this call has returned: they then only look
  // at `next`. `body` is called only for an index taken before the last one finished, and this
  // call waits for that.
  struct Loop {
    const std::function<Status(int64_t)>* body;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> lowest_failed;
    std::mutex mu;
    std::condition_variable cv;
    int64_t finished = 0;  // under mu
    Status first_error;    // under mu

    void Work() {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        // Indexes above a failed one are skipped, as in ParallelForInOrder.
        Status s = i < lowest_failed.load(std::memory_order_relaxed)
                       ? RunGuarded([this, i] { return (*body)(i); })
                       : OkStatus();
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok() && i < lowest_failed.load(std::memory_order_relaxed)) {
          lowest_failed.store(i, std::memory_order_relaxed);
          first_error = std::move(s);
        }
        if (++finished == n) cv.notify_all();
      }
    }
  };
  auto loop = std::make_shared<Loop>();
  loop->body = &body;
  loop->n = n;
  loop->lowest_failed.store(n, std::memory_order_relaxed);
  if (pool != nullptr) {
    const int64_t helpers = std::min<int64_t>(n - 1, pool->size());
    for (int64_t h = 0; h < helpers; ++h) pool->Schedule([loop] { loop->Work(); });
  }
  loop->Work();
  std::unique_lock<std::mutex> lock(loop->mu);
  loop->cv.wait(lock, [&] { return loop->finished == n; });
  return std::move(loop->first_error);
}

}  // namespace sp
