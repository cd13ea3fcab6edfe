#include "shardpoint/exec/round_board.h"

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/exec/process_test_util.h"

namespace sp {
namespace {

// Zeroed memory that a forked child shares with this process, as a new shared-memory object is.
class SharedBytes {
 public:
  explicit SharedBytes(size_t bytes) : bytes_(bytes) {
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(at, MAP_FAILED);
    data_ = static_cast<std::byte*>(at);
  }
  ~SharedBytes() { munmap(data_, bytes_); }
  std::byte* data() const { return data_; }

 private:
  std::byte* data_;
  size_t bytes_;
};

bool HasText(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Two processes hand rounds back and forth through the board: the child (rank 1) writes round k's
// value into a slot of three, publishes it, and writes round k+3 into the same slot only once the
// parent (rank 0) has copied round k out; the parent sees every value, in order, intact.
TEST(RoundBoardTest, ProcessesHandRoundsOverWithoutACollective) {
  constexpr int kRounds = 300;
  constexpr int kSlots = 3;
  const size_t board_bytes = RoundBoard::BytesFor(2);
  SharedBytes memory(board_bytes + kSlots * 4096);
  auto slot = [&](int k) {
    return reinterpret_cast<uint64_t*>(memory.data() + board_bytes + (k % kSlots) * 4096);
  };
  const pid_t child = fork();
  if (child == 0) {
    RoundBoard board(memory.data(), 2, 1);
    board.Copied(kRounds);  // it copies nothing out itself
    for (int k = 0; k < kRounds; ++k) {
      if (k >= kSlots && !board.WaitAllCopied(k - kSlots + 1).ok()) _exit(2);
      for (int i = 0; i < 512; ++i) slot(k)[i] = static_cast<uint64_t>(k) * 1000 + i;
      board.Published(k + 1);
    }
    _exit(board.WaitAllCopied(kRounds).ok() ? 0 : 3);
  }
  RoundBoard board(memory.data(), 2, 0);
  int wrong = 0;
  for (int k = 0; k < kRounds; ++k) {
    ASSERT_TRUE(board.WaitPublished(1, k + 1).ok());
    for (int i = 0; i < 512; ++i) wrong += slot(k)[i] != static_cast<uint64_t>(k) * 1000 + i;
    board.Copied(k + 1);
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(ExitCode(child), 0);
  EXPECT_FALSE(board.stopped());
}

TEST(RoundBoardTest, ARankThatStopsReleasesEveryWaiter) {
  SharedBytes memory(RoundBoard::BytesFor(3));
  RoundBoard r0(memory.data(), 3, 0), r1(memory.data(), 3, 1), r2(memory.data(), 3, 2);
  r1.Published(2);
  EXPECT_TRUE(r0.WaitPublished(1, 2).ok());
  r0.Copied(4);
  r1.Copied(4);
  // Rank 2 has copied nothing out: waiting for every rank blocks, until rank 2 stops.
  std::atomic<bool> waiting{true};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_TRUE(waiting.load());
    r2.Stop();
  });
  Status all;
  Status published;
  ASSERT_TRUE(Within(10, [&] {
    std::thread other([&] { published = r1.WaitPublished(0, 1); });
    all = r0.WaitAllCopied(1);
    waiting = false;
    other.join();
  }));
  stopper.join();
  EXPECT_EQ(all, AbortedError("rank 2 stopped the load"));
  EXPECT_EQ(published, AbortedError("rank 2 stopped the load"));
  EXPECT_TRUE(r0.stopped());
  // From now on every wait that is not yet satisfied returns at once; the first rank to stop is
  // the one named.
  r0.Stop();
  EXPECT_EQ(r1.WaitPublished(2, 1), AbortedError("rank 2 stopped the load"));
  EXPECT_TRUE(r1.WaitPublished(1, 2).ok());  // already there
}

TEST(RoundBoardTest, ARankWhoseProcessExitedIsNamed) {
  SharedBytes memory(RoundBoard::BytesFor(2));
  RoundBoard board(memory.data(), 2, 0);
  const pid_t child = fork();
  if (child == 0) {
    RoundBoard gone(memory.data(), 2, 1);
    gone.Published(1);
    _exit(0);  // before publishing round 2, and without stopping
  }
  EXPECT_EQ(ExitCode(child), 0);  // reaped: a zombie would still count as alive
  EXPECT_TRUE(board.WaitPublished(1, 1).ok());
  Status status;
  ASSERT_TRUE(Within(10, [&] { status = board.WaitPublished(1, 2); }));
  EXPECT_EQ(status, UnavailableError("rank 1 (process " + std::to_string(child) +
                                     ") exited during the load"));
  board.Copied(1);
  ASSERT_TRUE(Within(10, [&] { status = board.WaitAllCopied(1); }));
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
}

TEST(RoundBoardTest, AWaitWithoutProgressEndsAtTheStallLimit) {
  SharedBytes memory(RoundBoard::BytesFor(2));
  RoundBoard board(memory.data(), 2, 0, 0.3);
  RoundBoard alive(memory.data(), 2, 1, 0.3);
  alive.Copied(1);
  const auto start = std::chrono::steady_clock::now();
  Status status;
  ASSERT_TRUE(Within(10, [&] { status = board.WaitAllCopied(2); }));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(HasText(status.message(), "rank 0 has copied out 0 rounds, not 2")) << status;
  EXPECT_GE(waited, 0.3);
  // Progress restarts the clock: a rank that keeps publishing is waited for past the limit.
  std::thread publisher([&] {
    for (uint32_t k = 1; k <= 8; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      alive.Published(k);
    }
  });
  EXPECT_TRUE(board.WaitPublished(1, 8).ok());
  publisher.join();
}

}  // namespace
}  // namespace sp
