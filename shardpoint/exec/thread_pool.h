// ThreadPool: a fixed set of worker threads owned by the caller.
//
// There is no global pool: whoever needs parallelism receives a ThreadPool* through its options.
// Schedule() and ScheduleOrdered() are thread-safe. The destructor runs every task already
// scheduled, then joins.
// Tasks must not throw.
#ifndef SHARDPOINT_EXEC_THREAD_POOL_H_
#define SHARDPOINT_EXEC_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shardpoint/exec/buffer_pool.h"
#include "shardpoint/exec/io_tuner.h"

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
  // Schedules `task` among the ordered tasks. A free worker takes the oldest plain task first;
  // when there is none, the ordered task with the lowest `order` (ties: the earliest scheduled),
  // whoever scheduled it. Readers use it so that several callers' reads of the same files run
  // in file order together.
  void ScheduleOrdered(std::function<void()> task, double order);
  int size() const { return static_cast<int>(workers_.size()); }

  // True when called from one of this pool's workers (nested fan-out runs inline there).
  bool InWorkerThread() const;

  // How many reads this pool's callers run at once, learned as they run (up to size()): every
  // caller of the pool shares it, as they share its threads and the devices they read.
  IoTuner& io_tuner() { return *io_tuner_; }
  // Staging buffers for this pool's callers' reads (at most one per thread is in use at once).
  BufferPool& staging() { return *staging_; }

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::multimap<double, std::function<void()>> ordered_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::unique_ptr<IoTuner> io_tuner_;
  std::unique_ptr<BufferPool> staging_;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_THREAD_POOL_H_
