#include "shardpoint/exec/shared_io_tuner.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/base/random_id.h"
#include "shardpoint/exec/process_test_util.h"

namespace sp {
namespace {

std::string FreshName() { return "/sp-gate-test-" + RandomHexId(12); }

bool NameExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

IoTunerConfig Fixed(int depth) {
  IoTunerConfig config;
  config.max_depth = depth;
  config.fixed = true;
  return config;
}

// Counters in memory shared with forked children (mapped before the fork).
struct Shared {
  std::atomic<int> running{0};
  std::atomic<int> most{0};
  std::atomic<int> reads{0};
};

Shared* MapShared() {
  void* at = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                  -1, 0);
  return new (at) Shared();
}

TEST(SharedIoTunerTest, ProcessesReadThroughOneGate) {
  // Four processes of three threads each, one gate of depth 2: never more than 2 reads at once
  // among all twelve threads.
  const std::string name = FreshName();
  Shared* shared = MapShared();
  std::vector<pid_t> children;
  for (int member = 0; member < 4; ++member) {
    children.push_back(Fork([&, member] {
      Result<std::unique_ptr<SharedIoTuner>> gate = SharedIoTuner::Attach(name, 4, member, Fixed(2));
      if (!gate.ok()) return false;
      std::vector<std::thread> threads;
      for (int t = 0; t < 3; ++t) {
        threads.emplace_back([&] {
          for (int i = 0; i < 100; ++i) {
            (*gate)->Acquire();
            const int now = ++shared->running;
            int seen = shared->most.load();
            while (now > seen && !shared->most.compare_exchange_weak(seen, now)) {
            }
            std::this_thread::sleep_for(std::chrono::microseconds(50));
            --shared->running;
            ++shared->reads;
            (*gate)->Release(1 << 20);
          }
        });
      }
      for (std::thread& t : threads) t.join();
      return (*gate)->depth() == 2 && (*gate)->joined() == 4;
    }));
  }
  for (pid_t pid : children) EXPECT_EQ(ExitCode(pid), 0);
  EXPECT_EQ(shared->reads.load(), 4 * 3 * 100);
  EXPECT_EQ(shared->most.load(), 2);
  EXPECT_FALSE(NameExists(name));
}

TEST(SharedIoTunerTest, AReadThatEndsWakesOnlyTheReadItLetsIn) {
  // 32 threads on a gate of depth 1, each reading 30 times: every Release lets one waiter in.
  // Woken by ticket, waiters rarely wake for nothing; woken all at once (one futex word for the
  // whole gate, as before), each Release woke the other waiters, about 30 futile wake-ups per
  // read here and minutes of them for 192 processes on two cores.
  const std::string name = FreshName();
  auto gate = SharedIoTuner::Attach(name, 1, 0, Fixed(1));
  ASSERT_TRUE(gate.ok()) << gate.status();
  constexpr int kThreads = 32, kReads = 30;
  std::atomic<int> running{0}, most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kReads; ++i) {
        (*gate)->Acquire();
        most = std::max(most.load(), ++running);
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        --running;
        (*gate)->Release(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most.load(), 1);
  EXPECT_LT((*gate)->futile_wakeups(), uint64_t{kThreads} * kReads / 4);
}

TEST(SharedIoTunerTest, TheNameIsRemovedOnceEveryMemberAttachedOrTheLastLeft) {
  const std::string name = FreshName();
  {
    auto a = SharedIoTuner::Attach(name, 2, 0, Fixed(1));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(NameExists(name));
    auto b = SharedIoTuner::Attach(name, 2, 1, Fixed(1));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_FALSE(NameExists(name));  // both have it mapped
    EXPECT_EQ((*b)->attached(), 2);
    (*a)->Acquire();
    (*a)->Release(1);
  }
  // A member that never comes: the last one to leave removes the name.
  {
    auto a = SharedIoTuner::Attach(name, 3, 1, Fixed(1));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(NameExists(name));
  }
  EXPECT_FALSE(NameExists(name));
}

TEST(SharedIoTunerTest, TheSlotsOfADeadMemberReturnToTheOthers) {
  const std::string name = FreshName();
  auto me = SharedIoTuner::Attach(name, 3, 0, Fixed(1));
  ASSERT_TRUE(me.ok()) << me.status();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  // Member 1 dies holding the only slot.
  const pid_t holder = Fork([&] {
    auto gate = SharedIoTuner::Attach(name, 3, 1, Fixed(1));
    if (!gate.ok()) return false;
    (*gate)->Acquire();
    const char c = 'x';
    if (write(ready[1], &c, 1) != 1) return false;
    pause();  // killed here
    return true;
  });
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  // Member 2 dies waiting behind it: its ticket would come up, and nobody would use it.
  const pid_t waiter = Fork([&] {
    auto gate = SharedIoTuner::Attach(name, 3, 2, Fixed(1));
    if (!gate.ok()) return false;
    const char c = 'y';
    if (write(ready[1], &c, 1) != 1) return false;
    (*gate)->Acquire();
    return true;
  });
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // its Acquire takes a ticket
  kill(holder, SIGKILL);
  kill(waiter, SIGKILL);
  EXPECT_EQ(ExitCode(holder), 128 + SIGKILL);
  EXPECT_EQ(ExitCode(waiter), 128 + SIGKILL);
  Within(10, [&] {
    (*me)->Acquire();
    (*me)->Release(1);
    (*me)->Acquire();  // after the two phantom tickets, the line moves on
    (*me)->Release(1);
  });
  EXPECT_GE((*me)->reclaimed(), 1u);
  EXPECT_LE((*me)->reclaimed(), 2u);  // the waiter's ticket, if it had taken one
  EXPECT_EQ((*me)->attached(), 1);
  close(ready[0]);
  close(ready[1]);
}

TEST(SharedIoTunerTest, AttachRefusesBadArgumentsAndForeignObjects) {
  const std::string name = FreshName();
  auto bad = SharedIoTuner::Attach("no-slash", 2, 0, Fixed(1));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected '/'"), std::string::npos) << bad.status();
  bad = SharedIoTuner::Attach(name, 2, 2, Fixed(1));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("member 2 of 2"), std::string::npos) << bad.status();

  auto first = SharedIoTuner::Attach(name, 3, 0, Fixed(1));
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = SharedIoTuner::Attach(name, 3, 0, Fixed(1));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(again.status().message().find("member 0 is already attached"), std::string::npos)
      << again.status();
  // Another member count means another object layout.
  auto other = SharedIoTuner::Attach(name, 5, 1, Fixed(1));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("expected"), std::string::npos) << other.status();
  first->reset();
  EXPECT_FALSE(NameExists(name));

  // An object of that name that is not a gate, never initialized: refused after the wait.
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  close(fd);
  auto foreign = SharedIoTuner::Attach(name, 2, 0, Fixed(1), 0.05);
  shm_unlink(name.c_str());
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(foreign.status().message().find("holds 100 bytes"), std::string::npos)
      << foreign.status();

  // An object of a gate's size whose pages are not reserved (as when the creator found /dev/shm
  // full): never touched, refused after the wait.
  struct stat real;
  {
    auto gate = SharedIoTuner::Attach(name, 2, 0, Fixed(1));
    ASSERT_TRUE(gate.ok()) << gate.status();
    ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &real), 0);
    EXPECT_GE(static_cast<uint64_t>(real.st_blocks) * 512, static_cast<uint64_t>(real.st_size));
  }
  const int sparse = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(sparse, 0);
  ASSERT_EQ(ftruncate(sparse, real.st_size), 0);
  close(sparse);
  auto unreserved = SharedIoTuner::Attach(name, 2, 0, Fixed(1), 0.05);
  shm_unlink(name.c_str());
  ASSERT_FALSE(unreserved.ok());
  EXPECT_EQ(unreserved.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(unreserved.status().message().find("was not sized within"), std::string::npos)
      << unreserved.status();
}

TEST(SharedIoTunerTest, MeasuresTheReadsOfEveryMemberTogether) {
  // Depth 2, intervals of 6 MiB: only the bytes of both members' reads, completed while reads
  // were asked for at the shared gate, add up to one interval. Each member's own 4 MiB would not.
  const std::string name = FreshName();
  IoTunerConfig config;
  config.max_depth = 4;
  config.start_depth = 2;
  config.interval_bytes = 6 << 20;
  config.interval_seconds = 0.001;
  auto mine = SharedIoTuner::Attach(name, 2, 0, config);
  ASSERT_TRUE(mine.ok()) << mine.status();
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t other = Fork([&] {
    auto gate = SharedIoTuner::Attach(name, 2, 1, config);
    if (!gate.ok()) return false;
    char c = 'a';
    (*gate)->Acquire();
    if (write(to_parent[1], &c, 1) != 1 || read(to_child[0], &c, 1) != 1) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    (*gate)->Release(4 << 20);  // reads were asked for: counted, and the interval closes
    return (*gate)->intervals() == 1;
  });
  char c = 0;
  ASSERT_EQ(read(to_parent[0], &c, 1), 1);
  (*mine)->Acquire();  // two reads running: full
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  (*mine)->Release(4 << 20);
  EXPECT_EQ((*mine)->intervals(), 0);  // 4 MiB so far
  (*mine)->Acquire();  // full again
  ASSERT_EQ(write(to_child[1], &c, 1), 1);
  EXPECT_EQ(ExitCode(other), 0);
  (*mine)->Release(1 << 20);
  EXPECT_EQ((*mine)->intervals(), 1);
  // 8 MiB over the >= 20 ms reads were asked for.
  EXPECT_GT((*mine)->throughput(2), 0);
  EXPECT_LT((*mine)->throughput(2), 8.0 * (1 << 20) / 0.02);
  EXPECT_EQ((*mine)->depth(), 2);  // one reading: no probe before the scatter is known
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
}

TEST(SharedIoTunerTest, AProcessOfAnotherPidNamespaceIsRefused) {
  // Its kill() and /proc/<pid> would look at other processes than the members': refused, it
  // reads through a gate of its own.
  const std::string name = FreshName();
  auto mine = SharedIoTuner::Attach(name, 2, 0, Fixed(1));
  ASSERT_TRUE(mine.ok()) << mine.status();
  const pid_t outer = fork();
  if (outer == 0) {
    if (unshare(CLONE_NEWPID) != 0) _exit(77);
    const pid_t inner = Fork([&] {  // the first process of the new namespace
      auto gate = SharedIoTuner::Attach(name, 2, 1, Fixed(1), 1.0);
      return !gate.ok() && gate.status().code() == StatusCode::kFailedPrecondition &&
             gate.status().message().find("another PID namespace") != std::string::npos;
    });
    _exit(ExitCode(inner));
  }
  const int code = ExitCode(outer);
  if (code == 77) GTEST_SKIP() << "unshare(CLONE_NEWPID) is not allowed here";
  EXPECT_EQ(code, 0);
  EXPECT_EQ((*mine)->joined(), 1);
}

TEST(SharedIoTunerTest, ProcessStartTimeNamesAProcess) {
  const uint64_t mine = ProcessStartTime(getpid());
  ASSERT_GT(mine, 0u);
  EXPECT_EQ(ProcessStartTime(getpid()), mine);
  const pid_t child = Fork([&] {
    pause();
    return true;
  });
  // The child started after this process; once reaped, its pid names nothing.
  uint64_t started = 0;
  for (int i = 0; i < 100 && started == 0; ++i) started = ProcessStartTime(child);
  EXPECT_GE(started, mine);
  kill(child, SIGKILL);
  EXPECT_EQ(ExitCode(child), 128 + SIGKILL);
  EXPECT_EQ(ProcessStartTime(child), 0u);
}

}  // namespace
}  // namespace sp
