#include "shardpoint/exec/buffer_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace sp {
namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

bool Aligned(const AlignedBuffer& b, size_t alignment) {
  return reinterpret_cast<uintptr_t>(b.data()) % alignment == 0;
}

TEST(BufferPoolTest, ReusesTheSmallestKeptBufferThatFits) {
  BufferPool pool(4, 64 * kMiB);
  BufferPool::Stay stay(pool);
  AlignedBuffer big = pool.Acquire(4 * kMiB);
  AlignedBuffer small = pool.Acquire(1 * kMiB);
  const std::byte* small_at = small.data();
  const std::byte* big_at = big.data();
  pool.Release(std::move(big));
  pool.Release(std::move(small));
  EXPECT_EQ(pool.kept(), 2u);
  AlignedBuffer again = pool.Acquire(900 * kKiB);
  EXPECT_EQ(again.data(), small_at);  // the 1 MiB one, not the 4 MiB one
  AlignedBuffer larger = pool.Acquire(2 * kMiB);
  EXPECT_EQ(larger.data(), big_at);
  AlignedBuffer fresh = pool.Acquire(8 * kMiB);  // nothing kept fits
  EXPECT_EQ(pool.allocated(), 3u);
  EXPECT_GE(fresh.size(), 8 * kMiB);
}

TEST(BufferPoolTest, GivesOnlyBuffersWithTheAlignmentAskedFor) {
  BufferPool pool(4, 64 * kMiB);
  BufferPool::Stay stay(pool);
  pool.Release(pool.Acquire(64 * kKiB, 4096));
  for (size_t alignment : {size_t{512}, size_t{4096}, size_t{1} << 20, size_t{4} << 20}) {
    AlignedBuffer b = pool.Acquire(16 * kKiB, alignment);
    EXPECT_TRUE(Aligned(b, alignment)) << alignment;
    EXPECT_GE(b.size(), 16 * kKiB);
    pool.Release(std::move(b));
  }
}

TEST(BufferPoolTest, KeepsAtMostCapacityBuffersAndNoneTooLarge) {
  BufferPool pool(2, 8 * kMiB);
  BufferPool::Stay stay(pool);
  std::vector<AlignedBuffer> held;
  for (size_t mib : {1, 3, 2, 16}) held.push_back(pool.Acquire(mib * kMiB));
  for (AlignedBuffer& b : held) pool.Release(std::move(b));
  EXPECT_EQ(pool.kept(), 2u);  // 16 MiB is over max_keep_bytes; of 1, 3, 2 the larger two stay
  AlignedBuffer a = pool.Acquire(2 * kMiB + 1);
  EXPECT_GE(a.size(), 3 * kMiB);
  AlignedBuffer b = pool.Acquire(1);
  EXPECT_GE(b.size(), 2 * kMiB);
  EXPECT_EQ(pool.kept(), 0u);
}

TEST(BufferPoolTest, TheLastCallerOutFreesEverything) {
  BufferPool pool(4, 64 * kMiB);
  pool.Release(pool.Acquire(kMiB));  // no caller inside: not kept
  EXPECT_EQ(pool.kept(), 0u);
  pool.Enter();
  pool.Enter();
  pool.Release(pool.Acquire(kMiB));
  pool.Leave();
  EXPECT_EQ(pool.kept(), 1u);  // one caller still inside
  pool.Leave();
  EXPECT_EQ(pool.kept(), 0u);
}

TEST(BufferPoolTest, ThreadsNeverShareABufferAndAllocateNoMoreThanTheyHold) {
  constexpr int kThreads = 6;
  BufferPool pool(kThreads, 64 * kMiB);
  BufferPool::Stay stay(pool);
  std::atomic<bool> clash{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        AlignedBuffer b = pool.Acquire((1 + (i + t) % 4) * 64 * kKiB);
        std::memset(b.data(), t, b.size());
        std::this_thread::yield();
        for (size_t k = 0; k < b.size(); k += 4096) {
          if (b.data()[k] != static_cast<std::byte>(t)) clash = true;
        }
        pool.Release(std::move(b));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(clash.load());
  // Each thread holds one buffer at a time; a kept one too small for a request is replaced, so a
  // few more than kThreads may be allocated, never one per request.
  EXPECT_LE(pool.allocated(), 4u * kThreads);
  EXPECT_LE(pool.kept(), static_cast<size_t>(kThreads));
}

}  // namespace
}  // namespace sp
