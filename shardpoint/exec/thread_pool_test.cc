#include <atomic>
#include <vector>

#include <gtest/gtest.h>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/exec/thread_pool.h"

namespace sp {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskBeforeDestruction) {
  std::atomic<int> count{0};
  {
    ThreadPool pool(3);
    for (int i = 0; i < 1000; ++i) pool.Schedule([&] { count.fetch_add(1); });
  }
  EXPECT_EQ(count.load(), 1000);
}

TEST(TaskGroupTest, ReturnsFirstErrorAndCancels) {
  ThreadPool pool(2);
  TaskGroup group(&pool);
  std::atomic<int> ran{0};
  group.Run([] { return DataLossError("chunk 3 of w is corrupt"); });
  for (int i = 0; i < 100; ++i) group.Run([&] { ran.fetch_add(1); return OkStatus(); });
  Status s = group.Wait();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "chunk 3 of w is corrupt");
  EXPECT_TRUE(group.cancelled());
}

TEST(TaskGroupTest, NestedGroupsOnTheSamePoolDoNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int> leaves{0};
  Status s = ParallelFor(&pool, 8, [&](int64_t) {
    return ParallelFor(&pool, 8, [&](int64_t) { leaves.fetch_add(1); return OkStatus(); });
  });
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(leaves.load(), 64);
}

TEST(ParallelForTest, CoversEveryIndexOnceAndPropagatesErrors) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1001);
  ASSERT_TRUE(ParallelFor(&pool, 1001, [&](int64_t i) { hits[i]++; return OkStatus(); }).ok());
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  Status s = ParallelFor(nullptr, 10, [](int64_t i) {
    return i == 7 ? OutOfRangeError("index 7") : OkStatus();
  });
  EXPECT_EQ(s.message(), "index 7");
}

}  // namespace
}  // namespace sp
