// EngineContext: the store, thread pool and communicator of one Save / Load / Verify call.
//
// Options may leave any of them null; the context then owns a default (the POSIX store for the
// path, a pool of `threads` threads, a one-rank communicator) for the duration of the call.
#ifndef SHARDPOINT_ENGINE_CONTEXT_H_
#define SHARDPOINT_ENGINE_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/store/store.h"

namespace sp {

class EngineContext {
 public:
  // Borrowed pointers stay owned by the caller; null ones are replaced by owned defaults.
  // kInvalidArgument when `coordinator` is not a rank of the communicator.
  static Result<std::unique_ptr<EngineContext>> Make(std::string_view path, Communicator* comm,
                                                     Store* store, ThreadPool* pool, int threads,
                                                     int coordinator = 0);

  Store& store() { return *store_; }
  ThreadPool& pool() { return *pool_; }
  Communicator& comm() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // The steady clock's nanoseconds when this call's first read began, 0 before
  // (ReadExecutorOptions::reads_begin_ns).
  std::atomic<int64_t>& reads_begin_ns() { return reads_begin_ns_; }

 private:
  std::unique_ptr<Store> owned_store_;
  std::unique_ptr<ThreadPool> owned_pool_;
  std::unique_ptr<ThreadCommGroup> owned_group_;
  Store* store_ = nullptr;
  ThreadPool* pool_ = nullptr;
  Communicator* comm_ = nullptr;
  std::atomic<int64_t> reads_begin_ns_{0};
};

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_CONTEXT_H_
