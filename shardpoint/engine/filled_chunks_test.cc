// Tests of RangeBuffers (filled_chunks.h): the buffers of filled ranges stay within their budget
// under concurrent takers, are reused rather than mapped again, and a range over the budget waits
// until it is alone.
#include "shardpoint/engine/filled_chunks.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace sp {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(RangeBuffersTest, ConcurrentTakersStayWithinTheBudgetAndReuseBuffers) {
  RangeBuffers buffers(4 * kMiB);
  std::atomic<uint64_t> most_mapped{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        // Full ranges and the short tails of pieces, as the write tasks ask for them.
        const uint64_t size = (i + t) % 3 == 0 ? kMiB / 3 : kMiB;
        Result<RangeBuffers::Buffer> b = buffers.Take(size);
        if (!b.ok() || b->size < size) {
          ++failures;
          continue;
        }
        std::memset(b->data, t, size);  // the whole range is writable memory
        uint64_t mapped = buffers.mapped_bytes();
        uint64_t seen = most_mapped.load();
        while (mapped > seen && !most_mapped.compare_exchange_weak(seen, mapped)) {
        }
        buffers.Give(*b);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(most_mapped.load(), 4 * kMiB);
  EXPECT_GT(most_mapped.load(), 0u);
  // 400 ranges through at most four buffers of 1 MiB: the buffers were reused.
  EXPECT_LE(buffers.mapped_bytes(), 4 * kMiB);
}

TEST(RangeBuffersTest, ARangeOverTheBudgetWaitsUntilItIsAlone) {
  RangeBuffers buffers(2 * kMiB);
  Result<RangeBuffers::Buffer> small = buffers.Take(kMiB);
  ASSERT_TRUE(small.ok());
  std::atomic<bool> taken{false};
  std::thread big([&] {
    Result<RangeBuffers::Buffer> b = buffers.Take(5 * kMiB);
    ASSERT_TRUE(b.ok());
    EXPECT_GE(b->size, 5 * kMiB);
    taken = true;
    std::memset(b->data, 1, 5 * kMiB);
    buffers.Give(*b);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(taken.load()) << "a range over the budget was mapped beside another";
  buffers.Give(*small);
  big.join();
  EXPECT_TRUE(taken.load());
  // The kept buffer of 1 MiB gave way; the big one is kept alone.
  EXPECT_EQ(buffers.mapped_bytes(), 5 * kMiB);
}

}  // namespace
}  // namespace sp
