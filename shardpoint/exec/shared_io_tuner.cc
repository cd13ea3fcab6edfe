#include "shardpoint/exec/shared_io_tuner.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <thread>
#include <type_traits>

#ifdef __linux__
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#endif

namespace sp {

#ifdef __linux__

namespace {

constexpr uint64_t kMagic = 0x7370696f67617465;  // "spiogate"
constexpr uint32_t kLayout = 3;                   // bump when SharedGateState changes
// Futex words waiters sleep on, one per ticket modulo this: a grant wakes the threads waiting
// for that ticket (and any other ticket of the same slot, which sleep again), not every waiter.
constexpr uint64_t kTurnSlots = 1024;
// A waiter first in line checks this often whether members holding slots have died; the others
// sleep until their turn comes, checking at least this often in case a wake-up was lost.
constexpr double kHeadWaitSeconds = 0.05;
constexpr double kQueuedWaitSeconds = 1.0;

enum MemberState : int32_t { kFree = 0, kAttached = 1, kDetached = 2, kDead = 3 };

struct Member {
  int32_t pid = 0;
  uint64_t started = 0;  // the process's start time (/proc/<pid>/stat), 0 where unknown
  int32_t state = kFree;
  uint64_t taken = 0;  // tickets this member took
  uint64_t begun = 0;  // of those, reads begun
  uint64_t ended = 0;  // reads ended
};

}  // namespace

// The shared object: this header, then `members` Member records.
struct SharedGateState {
  std::atomic<uint64_t> magic;  // kMagic once the creator has initialized the rest
  uint32_t layout;
  int32_t members;
  uint64_t bytes;  // of the whole object
  uint64_t pid_namespace;  // the creator's (PidNamespace); every member must share it
  pthread_mutex_t mu;
  // turns[t % kTurnSlots]: the futex word the waiters for ticket t sleep on, bumped when it is
  // granted.
  std::atomic<uint32_t> turns[kTurnSlots];
  int32_t attached;
  int32_t joined;
  int32_t unlinked;  // the name has been removed
  uint64_t reclaimed;
  uint64_t futile_wakeups;  // waiters that woke and found their ticket not yet granted
  double last_reclaim_check;  // SteadySeconds of the last check for dead members
  char name[224];
  TunerCore core;

  Member* member(int i) {
    return reinterpret_cast<Member*>(reinterpret_cast<char*>(this) + sizeof(SharedGateState)) + i;
  }
};

static_assert(std::is_trivially_copyable_v<TunerCore>, "TunerCore lives in shared memory");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the magic word must be lock-free");

namespace {

size_t ObjectBytes(int members) {
  return sizeof(SharedGateState) + sizeof(Member) * static_cast<size_t>(members);
}

// Whether the member's process has exited (ProcessExited).
bool ProcessGone(const Member& m) { return ProcessExited(m.pid, m.started); }

// Creates and initializes the object, or returns kAlreadyExists when it is there. Its pages are
// reserved before anything touches them (exec/shared_memory.h): on a full /dev/shm that is an
// error, and the load reads through its own gate.
Result<SharedMemory> Create(const std::string& name, int members, const IoTunerConfig& config) {
  const size_t bytes = ObjectBytes(members);
  Result<SharedMemory> memory = SharedMemory::Create(name, bytes);
  if (!memory.ok()) return memory.status();
  // Created zero-filled: magic is 0 until the end.
  auto* state = reinterpret_cast<SharedGateState*>(memory->data());
  state->layout = kLayout;
  state->members = members;
  state->bytes = bytes;
  state->pid_namespace = PidNamespace();
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&state->mu, &attr);
  pthread_mutexattr_destroy(&attr);
  for (std::atomic<uint32_t>& turn : state->turns) new (&turn) std::atomic<uint32_t>(0);
  std::snprintf(state->name, sizeof(state->name), "%s", name.c_str());
  new (&state->core) TunerCore(config, SteadySeconds());
  for (int i = 0; i < members; ++i) new (state->member(i)) Member();
  state->magic.store(kMagic, std::memory_order_release);
  return memory;
}

// Opens an object another member created, once it is sized, reserved and initialized.
Result<SharedMemory> Open(const std::string& name, int members, double wait_seconds) {
  const size_t bytes = ObjectBytes(members);
  const double deadline = SteadySeconds() + wait_seconds;
  Result<SharedMemory> memory = SharedMemory::Open(name, bytes, wait_seconds);
  if (!memory.ok()) return memory.status();
  auto* state = reinterpret_cast<SharedGateState*>(memory->data());
  while (state->magic.load(std::memory_order_acquire) != kMagic) {
    if (SteadySeconds() > deadline) {
      return DeadlineExceededError("the shared read gate '" + name +
                                   "' was not initialized within " +
                                   std::to_string(wait_seconds) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (state->pid_namespace != PidNamespace()) {
    return FailedPreconditionError("the shared read gate '" + name +
                                   "' belongs to processes of another PID namespace");
  }
  if (state->layout != kLayout || state->members != members || state->bytes != bytes) {
    return FailedPreconditionError("the shared read gate '" + name + "' has layout " +
                                   std::to_string(state->layout) + " for " +
                                   std::to_string(state->members) + " members, expected layout " +
                                   std::to_string(kLayout) + " for " + std::to_string(members));
  }
  return memory;
}

}  // namespace

Result<std::unique_ptr<SharedIoTuner>> SharedIoTuner::Attach(const std::string& name, int members,
                                                             int member,
                                                             const IoTunerConfig& config,
                                                             double wait_seconds) {
  if (!SharedMemory::ValidName(name)) {
    return InvalidArgumentError("shared read gate name '" + name +
                                "': expected '/' then 1 to 200 of [A-Za-z0-9._-]");
  }
  if (members < 1 || member < 0 || member >= members) {
    return InvalidArgumentError("shared read gate '" + name + "': member " +
                                std::to_string(member) + " of " + std::to_string(members));
  }
  // Either side of a race may lose: the object appears between our create and open, or its last
  // member removes the name between them. A few rounds settle it.
  std::optional<SharedMemory> memory;
  for (int attempt = 0; !memory.has_value(); ++attempt) {
    Result<SharedMemory> created = Create(name, members, config);
    if (created.ok()) {
      memory = std::move(created).value();
      break;
    }
    if (created.status().code() != StatusCode::kAlreadyExists) return created.status();
    Result<SharedMemory> opened = Open(name, members, wait_seconds);
    if (opened.ok()) {
      memory = std::move(opened).value();
      break;
    }
    if (opened.status().code() != StatusCode::kNotFound || attempt >= 8) return opened.status();
  }
  auto tuner = std::unique_ptr<SharedIoTuner>(new SharedIoTuner(std::move(*memory), member));
  SharedGateState* state = tuner->state_;
  tuner->Lock();
  Member* me = state->member(member);
  if (me->state != kFree) {
    tuner->Unlock();
    tuner->member_ = -1;  // the destructor leaves the record alone
    return AlreadyExistsError("shared read gate '" + name + "': member " +
                              std::to_string(member) + " is already attached");
  }
  me->pid = static_cast<int32_t>(getpid());
  me->started = ProcessStartTime(me->pid);
  me->state = kAttached;
  ++state->attached;
  ++state->joined;
  if (state->joined == state->members && !state->unlinked) {
    // Everyone has it mapped: the name is no longer needed.
    SharedMemory::Unlink(state->name);
    state->unlinked = 1;
  }
  tuner->Unlock();
  return tuner;
}

SharedIoTuner::SharedIoTuner(SharedMemory memory, int member)
    : memory_(std::move(memory)),
      state_(reinterpret_cast<SharedGateState*>(memory_.data())),
      member_(member) {}

SharedIoTuner::~SharedIoTuner() {
  if (member_ >= 0) {
    Lock();
    const uint64_t limit = state_->core.grant_limit();
    Member* me = state_->member(member_);
    if (me->state == kAttached) {
      // Reads left outstanding (none after a load) would hold slots forever.
      if (me->taken != me->ended) {
        state_->core.Reclaim(me->begun - me->ended, me->taken - me->begun);
        me->begun = me->ended = me->taken;
      }
      me->state = kDetached;
      --state_->attached;
    }
    if (state_->attached == 0 && !state_->unlinked) {
      SharedMemory::Unlink(state_->name);
      state_->unlinked = 1;
    }
    const std::pair<uint64_t, uint64_t> granted = NewlyGranted(limit);
    Unlock();
    WakeTurns(granted);
  }
}

void SharedIoTuner::Lock() const {
  const int rc = pthread_mutex_lock(&state_->mu);
  // Its owner died holding it: the counters it guards are updated a field at a time, each
  // consistent, so the gate goes on.
  if (rc == EOWNERDEAD) pthread_mutex_consistent(&state_->mu);
}

void SharedIoTuner::Unlock() const { pthread_mutex_unlock(&state_->mu); }

std::pair<uint64_t, uint64_t> SharedIoTuner::NewlyGranted(uint64_t limit_before) const {
  const uint64_t limit = std::min(state_->core.grant_limit(), state_->core.taken());
  return {limit_before, std::max(limit_before, limit)};
}

void SharedIoTuner::WakeTurns(std::pair<uint64_t, uint64_t> tickets) {
  const uint64_t end = std::min(tickets.second, tickets.first + kTurnSlots);
  for (uint64_t t = tickets.first; t < end; ++t) {
    std::atomic<uint32_t>& turn = state_->turns[t % kTurnSlots];
    turn.fetch_add(1, std::memory_order_release);
    FutexWake(&turn);
  }
}

bool SharedIoTuner::ReclaimDead() {
  bool any = false;
  for (int i = 0; i < state_->members; ++i) {
    Member* m = state_->member(i);
    if (i == member_ || m->state != kAttached || m->taken == m->ended) continue;
    if (!ProcessGone(*m)) continue;
    state_->core.Reclaim(m->begun - m->ended, m->taken - m->begun);
    state_->reclaimed += m->taken - m->ended;
    m->begun = m->ended = m->taken;
    m->state = kDead;
    --state_->attached;
    any = true;
  }
  return any;
}

void SharedIoTuner::Acquire() {
  Lock();
  const uint64_t ticket = state_->core.Take(SteadySeconds());
  Member* me = state_->member(member_);
  ++me->taken;
  while (!state_->core.Granted(ticket)) {
    // The first in line watches for dead members (their slots are what it waits for); the others
    // look less often, in case the first in line is a dead member's ticket.
    const bool head = ticket == state_->core.grant_limit();
    std::atomic<uint32_t>& turn = state_->turns[ticket % kTurnSlots];
    const uint32_t seen = turn.load(std::memory_order_acquire);
    Unlock();
    FutexWait(&turn, seen, head ? kHeadWaitSeconds : kQueuedWaitSeconds);
    Lock();
    if (!state_->core.Granted(ticket)) ++state_->futile_wakeups;
    const double now = SteadySeconds();
    if (now - state_->last_reclaim_check >= kHeadWaitSeconds) {
      state_->last_reclaim_check = now;
      const uint64_t limit = state_->core.grant_limit();
      if (ReclaimDead()) {
        const std::pair<uint64_t, uint64_t> granted = NewlyGranted(limit);
        Unlock();
        WakeTurns(granted);
        Lock();
      }
    }
  }
  state_->core.Begin(SteadySeconds());
  ++me->begun;
  Unlock();
}

void SharedIoTuner::Release(uint64_t bytes) {
  Lock();
  const uint64_t limit = state_->core.grant_limit();
  state_->core.End(SteadySeconds(), bytes);
  ++state_->member(member_)->ended;
  const std::pair<uint64_t, uint64_t> granted = NewlyGranted(limit);
  Unlock();
  WakeTurns(granted);
}

int SharedIoTuner::depth() const {
  return Locked([&] { return state_->core.depth(); });
}
int SharedIoTuner::attached() const {
  return Locked([&] { return state_->attached; });
}
int SharedIoTuner::joined() const {
  return Locked([&] { return state_->joined; });
}
double SharedIoTuner::throughput(int depth) const {
  return Locked([&] { return state_->core.throughput(depth); });
}
int64_t SharedIoTuner::intervals() const {
  return Locked([&] { return state_->core.intervals(); });
}
uint64_t SharedIoTuner::reclaimed() const {
  return Locked([&] { return state_->reclaimed; });
}
uint64_t SharedIoTuner::futile_wakeups() const {
  return Locked([&] { return state_->futile_wakeups; });
}

#else  // !__linux__

struct SharedGateState {};

Result<std::unique_ptr<SharedIoTuner>> SharedIoTuner::Attach(const std::string& name, int, int,
                                                             const IoTunerConfig&, double) {
  return UnimplementedError("shared read gate '" + name + "': needs Linux (shm_open, futex)");
}

SharedIoTuner::SharedIoTuner(SharedMemory memory, int member)
    : memory_(std::move(memory)),
      state_(reinterpret_cast<SharedGateState*>(memory_.data())),
      member_(member) {}
SharedIoTuner::~SharedIoTuner() = default;
void SharedIoTuner::Acquire() {}
void SharedIoTuner::Release(uint64_t) {}
int SharedIoTuner::depth() const { return 1; }
int SharedIoTuner::attached() const { return 0; }
int SharedIoTuner::joined() const { return 0; }
double SharedIoTuner::throughput(int) const { return 0; }
int64_t SharedIoTuner::intervals() const { return 0; }
uint64_t SharedIoTuner::reclaimed() const { return 0; }
uint64_t SharedIoTuner::futile_wakeups() const { return 0; }
void SharedIoTuner::Lock() const {}
void SharedIoTuner::Unlock() const {}
bool SharedIoTuner::ReclaimDead() { return false; }
std::pair<uint64_t, uint64_t> SharedIoTuner::NewlyGranted(uint64_t) const { return {0, 0}; }
void SharedIoTuner::WakeTurns(std::pair<uint64_t, uint64_t>) {}

#endif

}  // namespace sp
