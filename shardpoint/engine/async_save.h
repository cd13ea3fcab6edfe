// AsyncSaver: a save whose caller is blocked only while the state is copied into host memory.
//
// Start() copies every piece of a SaveState into staging memory owned by the saver (in parallel),
// then runs Save() on that copy on a background thread and returns. The caller may modify or free
// its tensors as soon as Start returns: the checkpoint holds their values at the moment of the
// call. Staging memory is kept and reused by the next save (it grows only when a save needs more
// than any before it) and is bounded by a byte budget.
//
// One save runs at a time: Start waits for the previous save to finish first. The error of a
// previous save that nobody took with Wait() is not lost: Start returns it (prefixed "previous
// async save to <path>: ") and starts nothing; the next Start proceeds. A failed save leaves no
// committed checkpoint (Save's commit protocol), and a collective save fails on every rank alike.
//
// Collectives: Start makes none, so the caller is blocked only for the copy; the background save
// makes Save's collectives on its thread. A rank that cannot stage its state (over the budget, a
// bad piece) or that failed before it could call Start (StartFailed) still joins the save its
// peers have started, carrying its error: Start / StartFailed return the error on that rank at
// once, and every other rank's Wait returns it; nothing is written. That failure is not returned
// again by the next Start on the failing rank (Wait still returns it). The communicator, store
// and pool in the options must outlive the save (until Wait returns or the next Start returns).
//
// Thread-safety: Start, Wait and the destructor are called by one owner thread at a time; Done
// may be called from any thread.
#ifndef SHARDPOINT_ENGINE_ASYNC_SAVE_H_
#define SHARDPOINT_ENGINE_ASYNC_SAVE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "shardpoint/base/bytes.h"
#include "shardpoint/engine/save.h"
#include "shardpoint/exec/thread_pool.h"

namespace sp {

// How Start takes the pieces' bytes.
enum class AsyncStaging {
  kCopy,    // copied into the saver's staging memory (the caller may change its memory at once)
  kBorrow,  // the pieces are already a copy the caller owns (pinned host memory that device
            // tensors were copied into, say) and leaves unchanged until the save is over (Wait
            // returns or the next Start returns): used as they are, no staging is taken
};

class AsyncSaver {
 public:
  // staging_budget_bytes: the most staging memory one save may use; 0 means no limit.
  explicit AsyncSaver(uint64_t staging_budget_bytes = 0);
  ~AsyncSaver();  // waits for a running save; its result is dropped

  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Waits for the previous save, copies `state` into staging (in parallel on options.pool, or on
  // a pool of options.threads threads that the saver keeps), then starts
  // Save(staged_state, path, options) on a background thread and returns OK.
  // Pieces with null data are allowed when options.fills(): the background save gets their
  // bytes from fill_piece or fill_range (the caller keeps what it reads valid until the save is
  // over). `staging`: see AsyncStaging; with kBorrow nothing is copied and the budget does not
  // apply.
  // Errors: the previous save's unreported error (see above; nothing started);
  // kResourceExhausted "async save to <path> needs N bytes of staging memory, over the budget of
  // M bytes", kInvalidArgument for a piece with a null pointer or a negative size (with a comm,
  // the failing rank's peers get these from Wait; see Collectives above).
  Status Start(const SaveState& state, std::string path, SaveOptions options,
               AsyncStaging staging = AsyncStaging::kCopy);

  // For a rank that failed before it could call Start (in a collective save): waits for the
  // previous save, then joins this save's collectives with `failure` in the background so that
  // every rank's Wait returns it, and returns `failure`. Without options.comm it only returns it.
  Status StartFailed(Status failure, std::string path, SaveOptions options);

  // Blocks until the running save (if any) finishes; returns its result, or OK when no save has
  // run since the last Wait.
  Status Wait();

  // True when no save is running.
  bool Done() const;

  // Bytes of staging memory held now (for tests and reporting).
  uint64_t staging_capacity_bytes() const;

 private:
  // Joins the background thread and returns the pending result (OK if none), clearing it.
  Status JoinAndTakeResult();
  // Start's first step: the previous save's unreported error, with context, or OK.
  Status TakePrevious();
  // Runs SaveWithLocalStatus(staged_, path, options, local_failure) on the worker thread.
  void Launch(std::string path, SaveOptions options, Status local_failure);
  Status StartFailedLocked(Status failure, std::string path, SaveOptions options);
  // Sizes staging for `state`, checks the budget, copies every piece, and fills staged_.
  Status Stage(const SaveState& state, const std::string& path, ThreadPool* pool, bool fill,
               AsyncStaging staging);
  ThreadPool* PoolFor(const SaveOptions& options);

  const uint64_t budget_bytes_;
  AlignedBuffer staging_;
  SaveState staged_;               // views into staging_; read by the background save
  std::unique_ptr<ThreadPool> owned_pool_;
  int owned_pool_threads_ = -1;    // the `threads` the owned pool was made for

  std::thread worker_;
  std::atomic<bool> running_{false};
  mutable std::mutex mu_;          // guards result_ and path_
  Status result_;                  // of the last save not yet taken by Wait or Start
  bool failure_reported_ = false;  // result_ is a failure Start already returned
  std::string path_;               // of the running or last save
};

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_ASYNC_SAVE_H_
