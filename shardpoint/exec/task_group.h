// TaskGroup: fan work out to a ThreadPool and collect the first error.
//
// Run() schedules a task returning Status; Wait() blocks until every scheduled task has finished
// and returns the first non-OK status (in completion order), or OK. After the first failure,
// cancelled() turns true so long tasks can stop early; tasks not yet started still run but may
// check cancelled(). With a null pool, or when called from a worker of the same pool (to avoid
// deadlock), tasks run inline. Run() and cancelled() are thread-safe; Wait() is called once by
// the owner. The destructor waits. A task that throws std::bad_alloc or std::length_error (an
// allocation that failed) counts as failing with kResourceExhausted.
#ifndef SHARDPOINT_EXEC_TASK_GROUP_H_
#define SHARDPOINT_EXEC_TASK_GROUP_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>

#include "shardpoint/base/status.h"
#include "shardpoint/exec/thread_pool.h"

namespace sp {

class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool* pool) : pool_(pool) {}
  ~TaskGroup();

  TaskGroup(const TaskGroup&) = delete;
  TaskGroup& operator=(const TaskGroup&) = delete;

  void Run(std::function<Status()> task);
  // As Run, through ThreadPool::ScheduleOrdered (inline in submission order where Run is inline).
  void RunOrdered(std::function<Status()> task, double order);
  Status Wait();
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  void Submit(std::function<Status()> task, std::optional<double> order);
  void Finish(Status status);

  ThreadPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_ = 0;
  Status first_error_;
  std::atomic<bool> cancelled_{false};
};

// Runs body(i) for i in [0, n) on the pool, in up to pool->size() contiguous blocks.
// Returns the first error.
Status ParallelFor(ThreadPool* pool, int64_t n, const std::function<Status(int64_t)>& body);

// As ParallelFor, but the error returned is that of the lowest index that fails, the one a loop
// over [0, n) on one thread would return, whatever the order the blocks run in: a parallel pass
// reports the same first bad record, tensor or rank as a sequential one. Indexes above a failed
// one may be skipped. An allocation failure inside body(i) counts as body(i) failing with
// kResourceExhausted.
Status ParallelForInOrder(ThreadPool* pool, int64_t n,
                          const std::function<Status(int64_t)>& body);

// As ParallelForInOrder, for work a caller must not wait behind the pool's queue for: the calling
// thread runs the indexes one after another, and up to n - 1 of the pool's workers help as they
// come free. It returns once every index has run, without waiting for a worker that is still busy
// with other callers' tasks (one that starts after the last index was taken finds none and does
// nothing). A load's reads of its data files' headers use it: while other ranks' reads hold every
// worker of a shared pool, the rank reads its headers itself instead of waiting for a worker.
Status ParallelForHelped(ThreadPool* pool, int64_t n, const std::function<Status(int64_t)>& body);

}  // namespace sp

#endif  // SHARDPOINT_EXEC_TASK_GROUP_H_
