#include "shardpoint/exec/round_board.h"

#include <atomic>
#include <chrono>
#include <string>

#include <unistd.h>

#include "shardpoint/exec/process_sync.h"

namespace sp {

struct alignas(64) RoundBoardHeader {
  std::atomic<uint32_t> stopped;  // 0, or 1 + the first rank that stopped
};

struct alignas(64) RoundBoardEntry {
  std::atomic<uint32_t> published;  // futex word
  std::atomic<uint32_t> copied;     // futex word
  std::atomic<int32_t> pid;         // 0 until the rank registered
  std::atomic<uint64_t> started;    // ProcessStartTime
  std::atomic<uint64_t> pid_namespace;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "the board lives in shared memory");

namespace {

// How often a waiter checks that the process it waits for is alive.
constexpr double kLivenessSeconds = 0.05;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

size_t RoundBoard::BytesFor(int ranks) {
  return sizeof(RoundBoardHeader) + sizeof(RoundBoardEntry) * static_cast<size_t>(ranks);
}

RoundBoard::RoundBoard(void* memory, int ranks, int me, double stall_seconds)
    : header_(static_cast<RoundBoardHeader*>(memory)),
      ranks_(ranks),
      me_(me),
      stall_seconds_(stall_seconds) {
  RoundBoardEntry* mine = entry(me);
  const int pid = static_cast<int>(getpid());
  mine->started.store(ProcessStartTime(pid), std::memory_order_relaxed);
  mine->pid_namespace.store(PidNamespace(), std::memory_order_relaxed);
  mine->pid.store(pid, std::memory_order_release);
}

RoundBoardEntry* RoundBoard::entry(int rank) const {
  return reinterpret_cast<RoundBoardEntry*>(reinterpret_cast<char*>(header_) +
                                            sizeof(RoundBoardHeader)) +
         rank;
}

void RoundBoard::Published(uint32_t rounds) {
  entry(me_)->published.store(rounds, std::memory_order_release);
  FutexWake(&entry(me_)->published);
}

void RoundBoard::Copied(uint32_t rounds) {
  entry(me_)->copied.store(rounds, std::memory_order_release);
  FutexWake(&entry(me_)->copied);
}

void RoundBoard::Stop() {
  uint32_t none = 0;
  header_->stopped.compare_exchange_strong(none, static_cast<uint32_t>(me_) + 1,
                                           std::memory_order_acq_rel);
  for (int r = 0; r < ranks_; ++r) {
    FutexWake(&entry(r)->published);
    FutexWake(&entry(r)->copied);
  }
}

bool RoundBoard::stopped() const {
  return header_->stopped.load(std::memory_order_acquire) != 0;
}

Status RoundBoard::WaitPublished(int rank, uint32_t rounds) const {
  return Wait(rank, true, rounds);
}

Status RoundBoard::WaitAllCopied(uint32_t rounds) const {
  for (int r = 0; r < ranks_; ++r) SP_RETURN_IF_ERROR(Wait(r, false, rounds));
  return OkStatus();
}

Status RoundBoard::Wait(int rank, bool published, uint32_t rounds) const {
  RoundBoardEntry* e = entry(rank);
  std::atomic<uint32_t>* word = published ? &e->published : &e->copied;
  const std::string who = "rank " + std::to_string(rank);
  uint32_t seen = word->load(std::memory_order_acquire);
  double changed = Seconds(), checked = changed;
  const uint64_t my_namespace = PidNamespace();
  for (;;) {
    const uint32_t now = word->load(std::memory_order_acquire);
    if (now >= rounds) return OkStatus();
    if (const uint32_t stopper = header_->stopped.load(std::memory_order_acquire); stopper != 0) {
      return AbortedError("rank " + std::to_string(stopper - 1) + " stopped the load");
    }
    const double t = Seconds();
    if (now != seen) {
      seen = now;
      changed = t;
    }
    if (t - checked >= kLivenessSeconds) {
      checked = t;
      const int pid = e->pid.load(std::memory_order_acquire);
      if (pid > 0 && e->pid_namespace.load(std::memory_order_relaxed) == my_namespace &&
          ProcessExited(pid, e->started.load(std::memory_order_relaxed))) {
        return UnavailableError(who + " (process " + std::to_string(pid) +
                                ") exited during the load");
      }
    }
    if (t - changed > stall_seconds_) {
      return DeadlineExceededError(who + " has " + (published ? "published" : "copied out") +
                                   " " + std::to_string(now) + " rounds, not " +
                                   std::to_string(rounds) + ", and made no progress for " +
                                   std::to_string(static_cast<int>(stall_seconds_)) + " s");
    }
    FutexWait(word, now, kLivenessSeconds);
  }
}

}  // namespace sp
