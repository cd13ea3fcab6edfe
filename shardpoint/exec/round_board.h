// RoundBoard: how far each rank of a load on one machine has come, in memory those ranks share.
//
// The ranks of a shared load on one machine (engine/load_internal.h, LoadSharedOnMachine) go
// through the same rounds: each reads its part of round k into a slot of a shared-memory object,
// publishes where it put what, and copies its regions out of the others' slots. Instead of a
// collective of the communicator per round (a round trip through every process, which on a busy
// machine costs more than the round's copies), each rank posts two counters here: the rounds it
// has published, and the rounds it has copied out. A rank waits only for what it needs: the
// readers of round k to have published it before copying out of their slots, and every rank to
// have copied round k out before it reads round k + slots into the same slot.
//
// Waits sleep on the counter's futex word. A rank that gives up (an error) says so with Stop(),
// which wakes every waiter: waits then return kAborted, so that no rank waits for one that will
// not come. Waiters also check, about every 50 ms, that the processes of the ranks they wait for
// are alive (pid and start time, when they share this process's PID namespace): a rank that died
// is kUnavailable, naming it. A wait that sees no progress for `stall_seconds` is
// kDeadlineExceeded.
//
// The board lies in BytesFor(ranks) bytes of shared memory, zeroed before any rank uses it (a
// new shared-memory object is). Every rank constructs a RoundBoard over the same bytes, with its
// own index. Thread-safe.
#ifndef SHARDPOINT_EXEC_ROUND_BOARD_H_
#define SHARDPOINT_EXEC_ROUND_BOARD_H_

#include <cstddef>
#include <cstdint>

#include "shardpoint/base/status.h"

namespace sp {

struct RoundBoardHeader;
struct RoundBoardEntry;

class RoundBoard {
 public:
  static size_t BytesFor(int ranks);

  // Registers this process (pid, start time, PID namespace) as rank `me` of `ranks`.
  RoundBoard(void* memory, int ranks, int me, double stall_seconds = 1800);

  RoundBoard(const RoundBoard&) = delete;
  RoundBoard& operator=(const RoundBoard&) = delete;

  // This rank has published its first `rounds` rounds / copied them out (counts only grow).
  void Published(uint32_t rounds);
  void Copied(uint32_t rounds);
  // This rank stops: every wait of every rank returns kAborted from now on.
  void Stop();
  // Whether some rank stopped.
  bool stopped() const;

  // Waits until rank `rank` has published at least `rounds` rounds.
  Status WaitPublished(int rank, uint32_t rounds) const;
  // Waits until every rank has copied out at least `rounds` rounds.
  Status WaitAllCopied(uint32_t rounds) const;

 private:
  // Waits until entry(rank)'s counter (published or copied) reaches `rounds`.
  Status Wait(int rank, bool published, uint32_t rounds) const;
  RoundBoardEntry* entry(int rank) const;

  RoundBoardHeader* header_;
  int ranks_;
  int me_;
  double stall_seconds_;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_ROUND_BOARD_H_
