// Waiting across the processes of one machine: futex words in shared memory, and whether the
// process behind a pid is still the one that registered (exec/shared_io_tuner.h,
// exec/round_board.h).
#ifndef SHARDPOINT_EXEC_PROCESS_SYNC_H_
#define SHARDPOINT_EXEC_PROCESS_SYNC_H_

#include <atomic>
#include <cstdint>

namespace sp {

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "a futex word must be a plain 32-bit word");

// Sleeps while *word == expected, at most `seconds` (or until woken; spurious returns happen).
// `word` may lie in memory that several processes map (not a private futex). Elsewhere than
// Linux: sleeps a millisecond.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double seconds);

// Wakes every thread of every process sleeping on `word`.
void FutexWake(std::atomic<uint32_t>* word);

// This process's PID namespace (the inode of /proc/self/ns/pid), 0 where it cannot be read.
// Processes must share one for their liveness checks (kill, /proc/<pid>) to look at the right
// processes: containers of one pod share the host name and /dev/shm but not their PIDs.
uint64_t PidNamespace();

// When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); 0 when it
// cannot be read (no such process, no /proc). With the pid it names one process even after the
// pid is reused.
uint64_t ProcessStartTime(int pid);

// Whether the process registered as (`pid`, `started`: its ProcessStartTime, 0 when unknown) has
// exited: no process with that pid, or one that started at another time (the pid was reused). A
// zombie not yet reaped still counts as alive; a pid <= 0 (not registered yet) never has exited.
bool ProcessExited(int pid, uint64_t started);

}  // namespace sp

#endif  // SHARDPOINT_EXEC_PROCESS_SYNC_H_
