// SharedIoTuner: one read gate for the processes of a machine.
//
// Ranks that run as separate processes on one machine (torchrun, mpirun) read the same device.
// With a gate each, every process tunes its depth against throughput the others disturb, and the
// device sees the sum of their depths in competing orders. A SharedIoTuner puts the gate of an
// IoTuner (exec/io_tuner.h: tickets served in order, intervals measured while reads are asked
// for, a hill climb over the depth) in a POSIX shared-memory object, so that every member's
// reads wait in one line and one depth is tuned from the throughput of all of them together.
//
// The members of one load agree on a name (the load passes a nonce its coordinator broadcast
// with the metadata) and on their count. The first to arrive creates the object; the others wait
// for it to be initialized (at most `wait_seconds`). The name is removed once every member has
// attached, or when the last attached member detaches, so nothing stays in /dev/shm after a load,
// even one that failed before all members arrived. A member that arrives after that creates a
// fresh gate and reads alone: sharing is an optimization, never needed for a correct load.
//
// Waiting: a read that is not yet let in sleeps on a futex word of its own ticket (one of 1,024,
// by ticket modulo 1,024), and a read that ends wakes only the tickets it lets in, so a gate of
// hundreds of members does not wake every waiter on every read (with one word for all, 192
// processes on two cores spent minutes waking each other).
//
// Members that die: the mutex is robust (a member that dies holding it does not block the
// others), and waiters check, at most every 50 ms for the whole gate, that the processes of
// members with reads outstanding are alive: kill(pid, 0), and the start time in /proc/<pid>/stat,
// so that a reused pid does not pass for the dead member. The waiter first in line wakes every
// 50 ms to check; the others every second, in case the first in line is a dead member's ticket.
// The reads of a dead member are forgotten, so that its slots return to the others. Those checks
// need one PID namespace: a process of another (a container of the same pod, sharing the host
// name and /dev/shm) is refused at Attach and reads through its own gate.
//
// Linux only (shm_open, futex); elsewhere Attach returns kUnimplemented and the caller keeps a
// gate of its own. Thread-safe: any thread of a member may Acquire and Release.
#ifndef SHARDPOINT_EXEC_SHARED_IO_TUNER_H_
#define SHARDPOINT_EXEC_SHARED_IO_TUNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "shardpoint/base/result.h"
#include "shardpoint/exec/io_tuner.h"
#include "shardpoint/exec/process_sync.h"
#include "shardpoint/exec/shared_memory.h"

namespace sp {

struct SharedGateState;

class SharedIoTuner final : public IoGate {
 public:
  // Attaches member `member` (0 <= member < members, each index attached once) to the gate
  // named `name` (a POSIX shared-memory name: one '/' then up to 200 of [A-Za-z0-9._-]),
  // creating it with `config` if it does not exist. Errors: kInvalidArgument for a bad name or
  // index, kAlreadyExists when the index is taken, kFailedPrecondition when an existing object
  // of that name is not such a gate (another layout, another member count) or was made in
  // another PID namespace, kDeadlineExceeded
  // when its creator does not initialize it within `wait_seconds`, kInternal for a failed system
  // call (its message names the call and the errno), kUnimplemented off Linux.
  static Result<std::unique_ptr<SharedIoTuner>> Attach(const std::string& name, int members,
                                                       int member, const IoTunerConfig& config,
                                                       double wait_seconds = 5.0);

  // Detaches: forgets this member's outstanding reads (there are none after a load), and removes
  // the name if this was the last member attached.
  ~SharedIoTuner() override;

  SharedIoTuner(const SharedIoTuner&) = delete;
  SharedIoTuner& operator=(const SharedIoTuner&) = delete;

  void Acquire() override;
  void Release(uint64_t bytes) override;
  int depth() const override;

  // Members attached now (dead ones found by a waiter no longer count).
  int attached() const;
  // Members that have attached since the gate was created (each once).
  int joined() const;
  double throughput(int depth) const;
  int64_t intervals() const;
  // Reads of dead members forgotten so far.
  uint64_t reclaimed() const;
  // Times a waiter woke and found its read not yet let in (a wake-up meant for another ticket, or
  // a periodic check).
  uint64_t futile_wakeups() const;

 private:
  SharedIoTuner(SharedMemory memory, int member);

  // Takes the gate's robust mutex (making it consistent if its owner died).
  void Lock() const;
  void Unlock() const;
  // `read()` under the lock.
  template <typename F>
  auto Locked(F read) const {
    Lock();
    auto value = read();
    Unlock();
    return value;
  }
  // Under the lock: forgets the reads of members whose process is gone; true if any.
  bool ReclaimDead();
  // Under the lock: the tickets granted since the grant limit was `limit_before` (that have been
  // taken), as [first, end).
  std::pair<uint64_t, uint64_t> NewlyGranted(uint64_t limit_before) const;
  // Outside the lock: wakes the waiters of those tickets (and of the tickets that share their
  // futex words, which sleep again).
  void WakeTurns(std::pair<uint64_t, uint64_t> tickets);

  SharedMemory memory_;      // the gate's object, mapped
  SharedGateState* state_;  // at memory_.data()
  int member_;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_SHARED_IO_TUNER_H_
