#include "shardpoint/exec/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/exec/task_group.h"

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

// One worker, held busy while the tasks are queued, so that the order it takes them in is the
// pool's choice alone.
TEST(ThreadPoolTest, TakesPlainTasksFirstThenOrderedOnesByOrderAcrossCallers) {
  ThreadPool pool(1);
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  pool.Schedule([&] {
    std::unique_lock<std::mutex> lock(gate_mu);
    gate_cv.wait(lock, [&] { return open; });
  });
  std::mutex log_mu;
  std::vector<std::string> log;
  auto record = [&](std::string what) {
    return [&, what] {
      std::lock_guard<std::mutex> lock(log_mu);
      log.push_back(what);
    };
  };
  // Two callers, as two ranks sharing the pool, each in its own position order; plain tasks in
  // between.
  std::thread a([&] {
    for (double at : {0.0, 0.5, 0.9}) pool.ScheduleOrdered(record("a" + std::to_string(at)), at);
  });
  a.join();
  pool.Schedule(record("plain1"));
  std::thread b([&] {
    for (double at : {0.1, 0.5, 0.7}) pool.ScheduleOrdered(record("b" + std::to_string(at)), at);
  });
  b.join();
  pool.Schedule(record("plain2"));
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  TaskGroup drain(&pool);  // waits for everything queued before it, on the one worker
  std::atomic<bool> drained{false};
  drain.RunOrdered([&] { drained = true; return OkStatus(); }, 2.0);
  ASSERT_TRUE(drain.Wait().ok());
  EXPECT_TRUE(drained);
  const std::vector<std::string> want = {
      "plain1", "plain2", "a" + std::to_string(0.0), "b" + std::to_string(0.1),
      "a" + std::to_string(0.5), "b" + std::to_string(0.5),  // a tie: a was scheduled first
      "b" + std::to_string(0.7), "a" + std::to_string(0.9)};
  EXPECT_EQ(log, want);
}

TEST(TaskGroupTest, OrderedTasksReportTheFirstErrorAndRunInlineOnAWorker) {
  ThreadPool pool(3);
  TaskGroup group(&pool);
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) {
    group.RunOrdered([&, i] {
      ran.fetch_add(1);
      return i == 20 ? DataLossError("extent 20 of data_0 is short") : OkStatus();
    }, 1.0 - i / 50.0);
  }
  Status s = group.Wait();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "extent 20 of data_0 is short");
  // From a worker of the same pool, ordered tasks run inline, in submission order.
  std::vector<int> inline_order;
  TaskGroup outer(&pool);
  outer.Run([&] {
    TaskGroup inner(&pool);
    for (int i = 0; i < 4; ++i) {
      inner.RunOrdered([&, i] { inline_order.push_back(i); return OkStatus(); }, 4.0 - i);
    }
    return inner.Wait();
  });
  ASSERT_TRUE(outer.Wait().ok());
  EXPECT_EQ(inline_order, (std::vector<int>{0, 1, 2, 3}));
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

// Failing indexes are spread over the blocks, and the later blocks fail first (the first block
// waits until they have): the error returned must still be the lowest index's.
TEST(ParallelForInOrderTest, ReturnsTheLowestFailingIndexWhateverFailsFirst) {
  ThreadPool pool(4);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 400);
    std::vector<bool> fails(n);
    int64_t lowest = n;
    for (int64_t i = 0; i < n; ++i) {
      fails[i] = rng() % 16 == 0;
      if (fails[i] && lowest == n) lowest = i;
    }
    std::atomic<int64_t> later_failures{0};
    const int64_t first_block_end = n / std::min<int64_t>(n, 4);
    std::vector<std::atomic<int>> hits(n);
    Status s = ParallelForInOrder(&pool, n, [&](int64_t i) -> Status {
      hits[i]++;
      if (i < first_block_end && n > 1) {
        // Give the other blocks time to report their errors first.
        for (int spin = 0; spin < 200 && later_failures.load() == 0; ++spin) {
          std::this_thread::sleep_for(std::chrono::microseconds(5));
        }
      }
      if (!fails[i]) return OkStatus();
      if (i >= first_block_end) later_failures.fetch_add(1);
      return DataLossError("index " + std::to_string(i));
    });
    if (lowest == n) {
      ASSERT_TRUE(s.ok()) << s.message();
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    } else {
      ASSERT_EQ(s.message(), "index " + std::to_string(lowest)) << "trial " << trial;
      for (int64_t i = 0; i <= lowest; ++i) EXPECT_EQ(hits[i].load(), 1) << i;
    }
  }
}

TEST(ParallelForInOrderTest, RunsInlineWithoutAPoolAndTurnsFailedAllocationsIntoErrors) {
  std::vector<int64_t> order;
  Status s = ParallelForInOrder(nullptr, 10, [&](int64_t i) -> Status {
    order.push_back(i);
    if (i == 3) throw std::bad_alloc();
    return i == 5 ? OutOfRangeError("index 5") : OkStatus();
  });
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
  ThreadPool pool(2);
  s = ParallelForInOrder(&pool, 100, [&](int64_t i) -> Status {
    if (i == 90) throw std::bad_alloc();
    return i == 60 ? OutOfRangeError("index 60") : OkStatus();
  });
  EXPECT_EQ(s.message(), "index 60");
  EXPECT_TRUE(ParallelForInOrder(&pool, 0, [](int64_t) { return InternalError("ran"); }).ok());
}

// With or without a pool, every index below the lowest failing one runs once, and that index's
// error is returned, whichever thread takes it and whatever fails first.
TEST(ParallelForHelpedTest, ReturnsTheLowestFailingIndexAndRunsEveryIndexBelowIt) {
  ThreadPool pool(3);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 200);
    std::vector<bool> fails(n);
    int64_t lowest = n;
    for (int64_t i = 0; i < n; ++i) {
      fails[i] = rng() % 12 == 0;
      if (fails[i] && lowest == n) lowest = i;
    }
    std::vector<std::atomic<int>> hits(n);
    Status s = ParallelForHelped(trial % 3 == 0 ? nullptr : &pool, n, [&](int64_t i) -> Status {
      hits[i]++;
      if (i % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
      return fails[i] ? DataLossError("index " + std::to_string(i)) : OkStatus();
    });
    if (lowest == n) {
      ASSERT_TRUE(s.ok()) << s.message();
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    } else {
      ASSERT_EQ(s.message(), "index " + std::to_string(lowest)) << "trial " << trial;
    }
    for (int64_t i = 0; i < std::min(lowest + 1, n); ++i) EXPECT_EQ(hits[i].load(), 1) << i;
    for (int64_t i = 0; i < n; ++i) EXPECT_LE(hits[i].load(), 1) << i;
  }
  Status s = ParallelForHelped(&pool, 50, [&](int64_t i) -> Status {
    if (i == 30) throw std::bad_alloc();
    return OkStatus();
  });
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(ParallelForHelped(&pool, 0, [](int64_t) { return InternalError("ran"); }).ok());
}

// Every worker is busy with another caller's task: the caller runs every index itself and
// returns without waiting for them (ParallelForInOrder would wait until they are free). The
// helpers it scheduled start later, after its variables are gone, and find nothing to do.
TEST(ParallelForHelpedTest, TheCallerDoesNotWaitForWorkersBusyElsewhere) {
  ThreadPool pool(2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  int blocked = 0;
  for (int w = 0; w < 2; ++w) {
    pool.Schedule([&] {
      std::unique_lock<std::mutex> lock(mu);
      ++blocked;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return blocked == 2; });
  }
  bool done = false;
  Status status = InternalError("not run");
  std::vector<std::thread::id> ran_on;
  std::thread caller([&] {
    std::vector<std::thread::id> ids(20);
    Status s = ParallelForHelped(&pool, 20, [&ids](int64_t i) -> Status {
      ids[i] = std::this_thread::get_id();
      return OkStatus();
    });
    std::lock_guard<std::mutex> lock(mu);
    status = s;
    ran_on = ids;
    done = true;
    cv.notify_all();
  });
  const std::thread::id caller_id = caller.get_id();
  bool returned;
  {
    std::unique_lock<std::mutex> lock(mu);
    returned = cv.wait_for(lock, std::chrono::seconds(20), [&] { return done; });
    release = true;
    cv.notify_all();
  }
  caller.join();
  EXPECT_TRUE(returned) << "the caller waited for the pool's busy workers";
  EXPECT_TRUE(status.ok()) << status.message();
  ASSERT_EQ(ran_on.size(), 20u);
  for (const std::thread::id& id : ran_on) EXPECT_EQ(id, caller_id);
}

}  // namespace
}  // namespace sp
