// ThreadPool: a fixed set of worker threads owned by the caller.
//
// There is no global pool: whoever needs parallelism receives a ThreadPool* through its options.
// Schedule() is thread-safe. The destructor runs every task already scheduled, then joins.
// Tasks must not throw.
#ifndef SHARDPOINT_EXEC_THREAD_POOL_H_
#define SHARDPOINT_EXEC_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sp {

// The default number of I/O threads: max(4, cores). Threads doing blocking reads and writes
// spend most of their time waiting on the device, so more of them than cores keeps it busy.
int DefaultIoThreads();

class ThreadPool {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency() (at least 1).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task);
  int size() const { return static_cast<int>(workers_.size()); }

  // True when called from one of this pool's workers (nested fan-out runs inline there).
  bool InWorkerThread() const;

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_THREAD_POOL_H_
