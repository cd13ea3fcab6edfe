#include "shardpoint/comm/thread_comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "shardpoint/comm/comm_test_util.h"

namespace sp {
namespace {

using ::sp::testing::CheckEveryCollective;
using ::sp::testing::MakePayload;
using ::sp::testing::MatchesPayload;

constexpr size_t kMiB = size_t{1} << 20;

void ExpectAllOk(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r)
    EXPECT_TRUE(statuses[r].ok()) << r << ": " << statuses[r];
}

TEST(ThreadCommTest, EveryCollectiveEveryRootOneToEightRanks) {
  for (int n = 1; n <= 8; ++n) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, kMiB}) {
      SCOPED_TRACE("ranks " + std::to_string(n) + ", size " + std::to_string(size));
      ExpectAllOk(
          RunRanks(n, [&](Communicator& comm) { return CheckEveryCollective(comm, size, n); }));
    }
  }
}

TEST(ThreadCommTest, SixtyFourMebibytePayloads) {
  constexpr size_t kSize = 64 * kMiB;
  ExpectAllOk(
      RunRanks(3, [&](Communicator& comm) { return CheckEveryCollective(comm, kSize, 0); }));
  ExpectAllOk(RunRanks(8, [&](Communicator& comm) -> Status {
    // Gather: the root ends up holding 8 x 64 MiB.
    SP_ASSIGN_OR_RETURN(auto gathered, comm.Gather(MakePayload(kSize, comm.rank()), 5));
    for (size_t r = 0; r < gathered.size(); ++r) {
      if (!MatchesPayload(gathered[r], kSize, r)) return InternalError("wrong gathered payload");
    }
    return comm.rank() == 5 && gathered.size() != 8 ? InternalError("root got no payloads")
                                                    : OkStatus();
  }));
}

TEST(ThreadCommTest, GatherAndScatterMoveBuffersWithoutCopying) {
  constexpr int kRanks = 4;
  std::vector<const char*> original(kRanks);
  ExpectAllOk(RunRanks(kRanks, [&](Communicator& comm) -> Status {
    std::string payload = MakePayload(kMiB, comm.rank());
    original[comm.rank()] = payload.data();
    SP_ASSIGN_OR_RETURN(auto gathered, comm.Gather(std::move(payload), 1));
    for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
      if (gathered[r].data() != original[r]) return InternalError("gather copied a payload");
    }
    // Root hands the very same buffers back to their senders.
    SP_ASSIGN_OR_RETURN(std::string part, comm.Scatter(std::move(gathered), 1));
    if (part.data() != original[comm.rank()]) return InternalError("scatter copied a payload");
    return MatchesPayload(part, kMiB, comm.rank()) ? OkStatus() : InternalError("wrong part");
  }));
}

TEST(ThreadCommTest, BroadcastAndAllGatherReturnOwnBufferWithoutCopying) {
  ExpectAllOk(RunRanks(3, [&](Communicator& comm) -> Status {
    std::string payload = MakePayload(kMiB, comm.rank());
    const char* mine = payload.data();
    SP_ASSIGN_OR_RETURN(auto all, comm.AllGather(std::move(payload)));
    if (all[comm.rank()].data() != mine) return InternalError("all-gather copied own payload");
    for (int r = 0; r < 3; ++r) {
      if (!MatchesPayload(all[r], kMiB, r)) return InternalError("wrong all-gather payload");
    }
    std::string value = std::move(all[comm.rank()]);
    SP_ASSIGN_OR_RETURN(std::string out, comm.Broadcast(std::move(value), 2));
    if (comm.rank() == 2 && out.data() != mine)
      return InternalError("broadcast copied root's payload");
    return MatchesPayload(out, kMiB, 2) ? OkStatus() : InternalError("wrong broadcast value");
  }));
}

TEST(ThreadCommTest, ThousandRoundsInSequence) {
  constexpr int kRanks = 5;
  ExpectAllOk(RunRanks(kRanks, [&](Communicator& comm) -> Status {
    const int me = comm.rank();
    for (int round = 0; round < 1000; ++round) {
      const int root = round % kRanks;
      const std::string tag = std::to_string(round) + "/" + std::to_string(me);
      SP_ASSIGN_OR_RETURN(auto all, comm.AllGather(tag));
      for (int r = 0; r < kRanks; ++r) {
        if (all[r] != std::to_string(round) + "/" + std::to_string(r))
          return InternalError("all-gather " + tag);
      }
      SP_ASSIGN_OR_RETURN(auto gathered, comm.Gather(tag, root));
      if (me == root &&
          gathered[kRanks - 1] != std::to_string(round) + "/" + std::to_string(kRanks - 1)) {
        return InternalError("gather " + tag);
      }
      SP_ASSIGN_OR_RETURN(std::string value, comm.Broadcast(tag, root));
      if (value != std::to_string(round) + "/" + std::to_string(root))
        return InternalError("broadcast " + tag);
      std::vector<std::string> parts;
      for (int r = 0; me == root && r < kRanks; ++r)
        parts.push_back(std::to_string(round * kRanks + r));
      SP_ASSIGN_OR_RETURN(std::string part, comm.Scatter(std::move(parts), root));
      if (part != std::to_string(round * kRanks + me)) return InternalError("scatter " + tag);
      SP_RETURN_IF_ERROR(comm.Barrier());
    }
    return OkStatus();
  }));
}

TEST(ThreadCommTest, RankThatReturnsEarlyAbortsTheOthers) {
  for (bool early_ok : {true, false}) {
    std::vector<Status> second(4);
    auto statuses = RunRanks(4, [&](Communicator& comm) -> Status {
      SP_RETURN_IF_ERROR(comm.Barrier());
      if (comm.rank() == 2) return early_ok ? OkStatus() : NotFoundError("rank 2's own failure");
      Status first = comm.Gather("x", 0).status();
      // A later collective waits for rank 2 too, and fails the same way.
      second[comm.rank()] = comm.AllGather("y").status();
      return first;
    });
    EXPECT_EQ(statuses[2], early_ok ? OkStatus() : NotFoundError("rank 2's own failure"));
    for (int r : {0, 1, 3}) {
      EXPECT_EQ(statuses[r], AbortedError("rank 2 left the communicator group during Gather")) << r;
      EXPECT_EQ(second[r], AbortedError("rank 2 left the communicator group during AllGather"))
          << r;
    }
  }
}

TEST(ThreadCommTest, LeaveWakesRanksAlreadyWaiting) {
  std::atomic<int> waiting{0};
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    if (comm.rank() == 0) {
      while (waiting.load() < 2) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return OkStatus();
    }
    ++waiting;
    return comm.Broadcast("v", 1).status();
  });
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_EQ(statuses[1], AbortedError("rank 0 left the communicator group during Broadcast"));
  EXPECT_EQ(statuses[2], statuses[1]);
}

TEST(ThreadCommTest, RankThatLeftCannotCallCollectives) {
  ThreadCommGroup group(2);
  group.Leave(1);
  group.Leave(1);  // idempotent
  EXPECT_EQ(group.comm(1).Barrier(),
            FailedPreconditionError("rank 1 called Barrier after leaving the communicator group"));
  EXPECT_EQ(group.comm(0).Barrier(),
            AbortedError("rank 1 left the communicator group during Barrier"));
}

TEST(ThreadCommTest, ExceptionBecomesInternalError) {
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    if (comm.rank() == 1) throw std::runtime_error("boom");
    if (comm.rank() == 2) throw 7;
    return comm.Barrier();
  });
  EXPECT_EQ(statuses[1], InternalError("rank 1 threw an exception: boom"));
  EXPECT_EQ(statuses[2], InternalError("rank 2 threw an exception that is not a std::exception"));
  EXPECT_EQ(statuses[0].code(), StatusCode::kAborted);
}

TEST(ThreadCommTest, TimeoutNamesOperationAndMissingRanks) {
  ThreadCommGroup group(4, ThreadCommOptions{std::chrono::milliseconds(100)});
  std::vector<Status> statuses(4);
  std::thread t1([&] { statuses[1] = group.comm(1).AllGather("a").status(); });
  statuses[0] = group.comm(0).AllGather("b").status();
  t1.join();
  const Status expected = DeadlineExceededError(
      "AllGather (collective #0) timed out after 100 ms waiting for ranks 2, 3, which never "
      "arrived");
  EXPECT_EQ(statuses[0], expected);
  EXPECT_EQ(statuses[1], expected);
  // Latecomers to the failed round get the same error at once, and the ranks stay in step.
  std::thread t2([&] { statuses[2] = group.comm(2).AllGather("c").status(); });
  t2.join();
  EXPECT_EQ(statuses[2], expected);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      if (r != 3) statuses[r] = group.comm(r).Barrier();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(group.comm(3).Barrier(),
            DeadlineExceededError("AllGather (collective #0) timed out after 100 ms waiting for "
                                  "ranks 2, 3, which never arrived"));
  EXPECT_EQ(statuses[0], DeadlineExceededError("Barrier (collective #1) timed out after 100 ms "
                                               "waiting for rank 3, which never arrived"));
}

TEST(ThreadCommTest, MismatchedCollectivesFailOnEveryRank) {
  std::vector<Status> after(3);
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    Status status =
        comm.rank() == 1 ? comm.Broadcast("v", 0).status() : comm.Gather("v", 0).status();
    after[comm.rank()] = comm.Barrier();  // the group is still in step afterwards
    return status;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r],
              InternalError("collective mismatch: rank 0 called Gather, rank 1 called Broadcast"));
    EXPECT_TRUE(after[r].ok()) << after[r];
  }
  statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    return comm.Scatter({"a", "b", "c"}, comm.rank() == 2 ? 1 : 0).status();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(statuses[r], InternalError("collective mismatch: rank 0 called Scatter with root 0, "
                                         "rank 2 called it with root 1"));
  }
}

TEST(ThreadCommTest, MalformedCallsFailOnEveryRank) {
  auto statuses =
      RunRanks(4, [&](Communicator& comm) { return comm.Scatter({"a", "b", "c"}, 2).status(); });
  for (const Status& s : statuses) {
    EXPECT_EQ(s,
              InvalidArgumentError("Scatter: root 2 passed 3 payloads, expected one per rank (4)"));
  }
  statuses = RunRanks(2, [&](Communicator& comm) { return comm.Gather("x", 2).status(); });
  for (const Status& s : statuses) {
    EXPECT_EQ(s, InvalidArgumentError("Gather: root 2 is out of range for a group of 2 ranks"));
  }
}

// Forwards every collective to another communicator except AllToAll, which runs the default
// (one Scatter per root) of the Communicator base class.
class DefaultAllToAll final : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  Result<std::vector<std::string>> AllToAll(std::vector<std::string> p) override {
    return Communicator::AllToAll(std::move(p));
  }
};

TEST(ThreadCommTest, DefaultAllToAllThroughScatters) {
  for (int n = 1; n <= 5; ++n) {
    for (size_t size : {size_t{0}, size_t{7}, kMiB}) {
      SCOPED_TRACE("ranks " + std::to_string(n) + ", size " + std::to_string(size));
      ExpectAllOk(RunRanks(n, [&](Communicator& comm) {
        DefaultAllToAll wrapped(comm);
        return CheckEveryCollective(wrapped, size, n);
      }));
    }
  }
  auto statuses = RunRanks(3, [&](Communicator& comm) {
    DefaultAllToAll wrapped(comm);
    std::vector<std::string> parts(comm.rank() == 1 ? 2 : 3);
    return wrapped.AllToAll(std::move(parts)).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s,
              InvalidArgumentError("Scatter: root 1 passed 2 payloads, expected one per rank (3)"));
  }
}

// The default ExchangeWithPeers (one AllToAll) checks the lists it is given: a rank named twice or
// out of the group is the caller's error (the others still complete the collective), and a
// payload from a rank the receiver does not list is the receiver's.
TEST(ThreadCommTest, ExchangeWithPeersRefusesListsThatDoNotMatch) {
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    std::vector<std::pair<int, std::string>> sends;
    std::vector<int> from;
    if (comm.rank() == 1) sends.emplace_back(7, "x");
    if (comm.rank() == 0) sends.emplace_back(2, "four");
    return comm.ExchangeWithPeers(std::move(sends), from).status();
  });
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1], InvalidArgumentError(
                             "ExchangeWithPeers: rank 1 sends to rank 7, expected a rank of 0..2"));
  EXPECT_EQ(statuses[2], InvalidArgumentError("ExchangeWithPeers: rank 0 sent 4 bytes to rank 2, "
                                              "which does not receive from it"));
  statuses = RunRanks(2, [&](Communicator& comm) -> Status {
    std::vector<std::pair<int, std::string>> sends;
    sends.emplace_back(1 - comm.rank(), "a");
    if (comm.rank() == 0) sends.emplace_back(1, "b");
    return comm.ExchangeWithPeers(std::move(sends), {1 - comm.rank(), 1 - comm.rank()}).status();
  });
  EXPECT_EQ(statuses[0], InvalidArgumentError("ExchangeWithPeers: rank 0 sends to rank 1 twice"));
  EXPECT_EQ(statuses[1],
            InvalidArgumentError("ExchangeWithPeers: rank 1 receives from rank 0 twice"));
}

TEST(ThreadCommTest, AllToAllMovesBuffersAndChecksCounts) {
  constexpr int kRanks = 3;
  std::vector<std::vector<const char*>> sent(kRanks, std::vector<const char*>(kRanks));
  ExpectAllOk(RunRanks(kRanks, [&](Communicator& comm) -> Status {
    std::vector<std::string> parts;
    for (int q = 0; q < kRanks; ++q) {
      parts.push_back(MakePayload(kMiB, comm.rank() * 10 + q));
      sent[comm.rank()][q] = parts.back().data();
    }
    SP_ASSIGN_OR_RETURN(auto got, comm.AllToAll(std::move(parts)));
    SP_RETURN_IF_ERROR(comm.Barrier());
    for (int s = 0; s < kRanks; ++s) {
      if (got[s].data() != sent[s][comm.rank()]) return InternalError("AllToAll copied a payload");
      if (!MatchesPayload(got[s], kMiB, s * 10 + comm.rank())) return InternalError("wrong part");
    }
    return OkStatus();
  }));
  auto statuses = RunRanks(4, [&](Communicator& comm) {
    return comm.AllToAll(std::vector<std::string>(comm.rank() == 2 ? 5 : 4)).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s,
              InvalidArgumentError("AllToAll: rank 2 passed 5 payloads, expected one per rank (4)"));
  }
}

TEST(ThreadCommTest, RanksAreOnOneMachine) {
  ExpectAllOk(RunRanks(2, [](Communicator& comm) {
    return comm.spans_machines() ? InternalError("in-process ranks span machines") : OkStatus();
  }));
}

TEST(ThreadCommTest, RunRanksWithNoRanksRunsNothing) {
  int calls = 0;
  EXPECT_TRUE(RunRanks(0, [&](Communicator&) {
                ++calls;
                return OkStatus();
              }).empty());
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace sp
