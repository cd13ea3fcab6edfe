// ThreadComm: a Communicator whose ranks are threads of one process.
//
// A ThreadCommGroup owns the shared state of `size` ranks; comm(r) is the Communicator that the
// thread playing rank r uses. It serves tests, offline tools (consolidation, conversion) and
// single-process saves.
//
// Semantics, shared by every collective:
//  - Collectives are matched by position: the k-th collective call of every rank forms one round
//    (generation k), so any number of collectives may be called in sequence.
//  - Payloads move: Gather, Scatter and AllToAll hand each buffer over without copying it; Broadcast and
//    AllGather copy only what each receiving rank must own (root's own buffer moves back to it).
//  - A round fails identically on every rank that takes part in it, with one of:
//      kInternal  "collective mismatch: rank 0 called Gather, rank 1 called Broadcast"
//                 (ranks that disagree on the operation or on the root);
//      kInvalidArgument  when the ranks agree but the call is malformed (root out of range,
//                 Scatter or AllToAll given the wrong number of payloads);
//      kAborted   "rank R left the communicator group during <op>" when a rank that has not
//                 arrived has left (see Leave);
//      kDeadlineExceeded  when a rank waited longer than the timeout; the message names the
//                 operation and the ranks that never arrived.
//    A rank that arrives at a round that has already failed returns the same error at once.
//  - A rank that has left gets kFailedPrecondition from any collective it calls afterwards.
//
// Thread-safety: each comm(r) is used by one thread at a time (its rank), as for any
// Communicator. Leave() may be called from any thread. The group must outlive every call on its
// communicators.
#ifndef SHARDPOINT_COMM_THREAD_COMM_H_
#define SHARDPOINT_COMM_THREAD_COMM_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"

namespace sp {

struct ThreadCommOptions {
  // How long a rank waits in one collective for the other ranks to arrive.
  std::chrono::milliseconds timeout{600000};
};

class ThreadCommGroup {
 public:
  // `size` must be at least 1.
  explicit ThreadCommGroup(int size, ThreadCommOptions options = {});
  ~ThreadCommGroup();

  ThreadCommGroup(const ThreadCommGroup&) = delete;
  ThreadCommGroup& operator=(const ThreadCommGroup&) = delete;

  int size() const { return size_; }

  // The communicator of `rank` (0 <= rank < size()); owned by the group.
  Communicator& comm(int rank);

  // Marks `rank` as gone: every collective that waits for it (now or later) fails on every other
  // rank with kAborted "rank R left the communicator group during <op>". Idempotent.
  void Leave(int rank);

 private:
  enum class Op { kGather, kScatter, kBroadcast, kAllGather, kBarrier, kAllToAll };
  // One rank's arguments to a collective: pointers into the caller's frame, valid until the call
  // returns, so that payloads can be moved rather than copied.
  struct Call {
    Op op = Op::kBarrier;
    int root = 0;
    std::string* payload = nullptr;                // Gather, Broadcast, AllGather
    std::vector<std::string>* payloads = nullptr;  // Scatter (read on root only), AllToAll
  };
  // Per-rank outputs of a collective.
  struct Outputs {
    std::vector<std::string>* gathered = nullptr;  // Gather (root), AllGather, AllToAll
    std::string* single = nullptr;                 // Scatter, Broadcast
  };
  struct Round;
  class Comm;

  static const char* OpName(Op op);
  // Runs `call` as rank `rank`'s next collective and fills `out` for that rank.
  Status Run(int rank, const Call& call, const Outputs& out);

  // The helpers below run with mu_ held, except Extract.
  Round& Arrive(int rank, const Call& call, uint64_t generation);
  Status AwaitArrivals(std::unique_lock<std::mutex>& lock, Round& round, uint64_t generation);
  // Takes this rank's outputs from the other ranks' buffers (no lock: buffers stay put until
  // every rank has departed).
  static void Extract(int rank, const Round& round, const Outputs& out);
  // Takes back this rank's own buffer once no other rank reads it.
  static void Finalize(int rank, const Round& round, const Outputs& out);
  void Exit(int rank, uint64_t generation, Round& round);
  bool Finished(const Round& round) const;
  void FailRound(Round& round, Status status);
  Status Validate(const Round& round) const;
  Op FirstArrivedOp(const Round& round) const;
  Status LeftError(const Round& round) const;
  Status TimeoutError(const Round& round, uint64_t generation) const;

  const int size_;
  const ThreadCommOptions options_;
  std::vector<std::unique_ptr<Comm>> comms_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> left_;                             // guarded by mu_
  std::vector<uint64_t> next_generation_;              // per rank; guarded by mu_
  std::map<uint64_t, std::unique_ptr<Round>> rounds_;  // guarded by mu_
};

// Runs fn(comm) for ranks 0..n-1 on n threads of a fresh ThreadCommGroup and returns each rank's
// Status, indexed by rank. When a rank's fn returns (success or failure) the rank leaves the
// group, so a rank that exits early can never make the others hang. An exception thrown by fn
// becomes kInternal "rank R threw an exception: <what>".
std::vector<Status> RunRanks(int n, const std::function<Status(Communicator&)>& fn,
                             ThreadCommOptions options = {});

}  // namespace sp

#endif  // SHARDPOINT_COMM_THREAD_COMM_H_
