#include "shardpoint/exec/thread_pool.h"

#include <algorithm>

namespace sp {
namespace {
thread_local const ThreadPool* current_pool = nullptr;
}  // namespace

int DefaultIoThreads() {
  return std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
}

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  IoTuner::Config tuning;
  tuning.max_depth = num_threads;
  io_tuner_ = std::make_unique<IoTuner>(std::move(tuning));
  // Kept buffers: one per thread, none over 64 MiB (larger ones are rare: decoded chunks, slabs
  // of a large memory budget).
  staging_ = std::make_unique<BufferPool>(static_cast<size_t>(num_threads), size_t{64} << 20);
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Schedule(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::ScheduleOrdered(std::function<void()> task, double order) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ordered_.emplace(order, std::move(task));
  }
  cv_.notify_one();
}

bool ThreadPool::InWorkerThread() const { return current_pool == this; }

void ThreadPool::WorkerLoop() {
  current_pool = this;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty() || !ordered_.empty(); });
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      } else if (!ordered_.empty()) {
        task = std::move(ordered_.begin()->second);
        ordered_.erase(ordered_.begin());
      } else {
        return;  // stopping and drained
      }
    }
    task();
  }
}

}  // namespace sp
