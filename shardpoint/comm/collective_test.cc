#include "shardpoint/comm/collective.h"

#include <gtest/gtest.h>

#include <random>

#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/thread_comm.h"

namespace sp {
namespace {

using ::sp::testing::MakePayload;
using ::sp::testing::MatchesPayload;

constexpr size_t kMiB = size_t{1} << 20;

// Every rank's status must be the same `expected`.
void ExpectSameOnAll(const std::vector<Status>& statuses, const Status& expected) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_EQ(statuses[r], expected) << "rank " << r;
}

TEST(EncodeStatusTest, RoundTripsEveryCode) {
  for (int code = 0; code <= static_cast<int>(StatusCode::kDataLoss); ++code) {
    for (const std::string& message :
         {std::string(), std::string("tensor w1: expected f32, found bf16"),
          std::string("\0\x01\xff binary", 10), MakePayload(kMiB, code)}) {
      const Status original(static_cast<StatusCode>(code), message);
      Status decoded = InternalError("untouched");
      ASSERT_TRUE(DecodeStatus(EncodeStatus(original), &decoded).ok());
      EXPECT_EQ(decoded, original);
    }
  }
  EXPECT_EQ(EncodeStatus(OkStatus()), std::string(8, '\0'));
}

TEST(DecodeStatusTest, RejectsMalformedBytes) {
  const std::string good = EncodeStatus(NotFoundError("file /ckpt/0.data"));
  for (size_t len = 0; len < good.size(); ++len) {
    Status decoded = InternalError("untouched");
    Status status = DecodeStatus(std::string_view(good).substr(0, len), &decoded);
    EXPECT_EQ(status.code(), StatusCode::kDataLoss) << len;
    EXPECT_EQ(decoded, InternalError("untouched"));
  }
  Status decoded;
  EXPECT_EQ(DecodeStatus(good + "x", &decoded),
            DataLossError("encoded status: 1 unexpected bytes after the message"));
  std::string bad_code = good;
  bad_code[0] = 16;
  EXPECT_EQ(DecodeStatus(bad_code, &decoded),
            DataLossError("encoded status: unknown status code 16, expected at most 15"));
  std::string ok_with_message = good;
  ok_with_message[0] = 0;
  EXPECT_EQ(
      DecodeStatus(ok_with_message, &decoded),
      DataLossError("encoded status: an OK code carries a message of 17 bytes, expected none"));
}

TEST(DecodeStatusTest, RandomBytesDecodeOnlyWhenCanonical) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(rng() % 24, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 4 == 0 ? rng() : rng() % 3);
    Status decoded;
    Status status = DecodeStatus(bytes, &decoded);
    if (status.ok()) {
      EXPECT_EQ(EncodeStatus(decoded), bytes);
    } else {
      EXPECT_EQ(status.code(), StatusCode::kDataLoss);
    }
  }
}

TEST(CollectiveTest, SucceedWithOneToEightRanksAndPayloadSizes) {
  for (int n = 1; n <= 8; ++n) {
    for (size_t size : {size_t{0}, size_t{3}, size_t{100000}}) {
      SCOPED_TRACE("ranks " + std::to_string(n) + ", size " + std::to_string(size));
      const int root = n / 2;
      auto statuses = RunRanks(n, [&](Communicator& comm) -> Status {
        const int me = comm.rank();
        SP_ASSIGN_OR_RETURN(auto gathered, GatherOrFail(comm, MakePayload(size + me, me), root));
        if (gathered.size() != (me == root ? size_t(n) : 0)) return InternalError("gather count");
        for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
          if (!MatchesPayload(gathered[r], size + r, r)) return InternalError("gather payload");
        }
        SP_ASSIGN_OR_RETURN(std::string part, ScatterOrFail(comm, std::move(gathered), root));
        if (!MatchesPayload(part, size + me, me)) return InternalError("scatter payload");
        SP_ASSIGN_OR_RETURN(std::string value,
                            BroadcastOrFail(comm, MakePayload(size, 100 + me), root));
        if (!MatchesPayload(value, size, 100 + root)) return InternalError("broadcast value");
        SP_ASSIGN_OR_RETURN(auto all, AllGatherOrFail(comm, MakePayload(size, 200 + me)));
        for (int r = 0; r < n; ++r) {
          if (!MatchesPayload(all[r], size, 200 + r)) return InternalError("all-gather payload");
        }
        return AgreeOnStatus(comm, OkStatus());
      });
      ExpectSameOnAll(statuses, OkStatus());
    }
  }
}

TEST(CollectiveTest, SixtyFourMebibytePayloads) {
  constexpr size_t kSize = 64 * kMiB;
  auto statuses = RunRanks(4, [&](Communicator& comm) -> Status {
    SP_ASSIGN_OR_RETURN(auto gathered, GatherOrFail(comm, MakePayload(kSize, comm.rank()), 0));
    for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
      if (!MatchesPayload(gathered[r], kSize, r)) return InternalError("gather payload");
    }
    SP_ASSIGN_OR_RETURN(std::string part, ScatterOrFail(comm, std::move(gathered), 0));
    if (!MatchesPayload(part, kSize, comm.rank())) return InternalError("scatter payload");
    SP_ASSIGN_OR_RETURN(std::string value, BroadcastOrFail(comm, std::move(part), 3));
    return MatchesPayload(value, kSize, 3) ? OkStatus() : InternalError("broadcast value");
  });
  ExpectSameOnAll(statuses, OkStatus());
}

TEST(CollectiveTest, LowestFailingRankWinsOnEveryRank) {
  auto statuses = RunRanks(5, [&](Communicator& comm) -> Status {
    const int me = comm.rank();
    Result<std::string> local = std::string("plan");
    if (me == 3) local = NotFoundError("tensor w3 not in checkpoint /c");
    if (me == 1) local = DataLossError("file /c/1.data: crc mismatch");
    return GatherOrFail(comm, std::move(local), 4).status();
  });
  ExpectSameOnAll(statuses, DataLossError("rank 1: file /c/1.data: crc mismatch"));

  statuses = RunRanks(4, [&](Communicator& comm) -> Status {
    Result<std::string> local = std::string("x");
    if (comm.rank() >= 2) local = UnavailableError("store down on " + std::to_string(comm.rank()));
    return AllGatherOrFail(comm, std::move(local)).status();
  });
  ExpectSameOnAll(statuses, UnavailableError("rank 2: store down on 2"));

  statuses = RunRanks(4, [&](Communicator& comm) {
    return AgreeOnStatus(comm, comm.rank() == 3 ? ResourceExhaustedError("disk full") : OkStatus());
  });
  ExpectSameOnAll(statuses, ResourceExhaustedError("rank 3: disk full"));
}

TEST(CollectiveTest, AllToAllOrFailDeliversOrFailsEverywhere) {
  for (int n = 1; n <= 6; ++n) {
    auto statuses = RunRanks(n, [&](Communicator& comm) -> Status {
      std::vector<std::string> out;
      for (int q = 0; q < n; ++q) out.push_back(MakePayload(1000 * q + comm.rank(), q * 8 + comm.rank()));
      SP_ASSIGN_OR_RETURN(auto got, AllToAllOrFail(comm, std::move(out)));
      for (int s = 0; s < n; ++s) {
        if (!MatchesPayload(got[s], 1000 * comm.rank() + s, comm.rank() * 8 + s)) {
          return InternalError("wrong payload from rank " + std::to_string(s));
        }
      }
      return OkStatus();
    });
    ExpectSameOnAll(statuses, OkStatus());
  }
  auto statuses = RunRanks(4, [&](Communicator& comm) -> Status {
    Result<std::vector<std::string>> local = std::vector<std::string>(4, "data");
    if (comm.rank() == 3) local = DataLossError("file /c/3.data: crc mismatch");
    if (comm.rank() == 2) local = std::vector<std::string>(3);
    return AllToAllOrFail(comm, std::move(local)).status();
  });
  ExpectSameOnAll(statuses, InvalidArgumentError("rank 2: AllToAllOrFail: rank 2 computed 3 "
                                                 "payloads, expected one per rank (4)"));
}

TEST(CollectiveTest, RootErrorReachesEveryRank) {
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    Result<std::vector<std::string>> plans = std::vector<std::string>{"a", "b", "c"};
    if (comm.rank() == 1) plans = InvalidArgumentError("overlapping chunks of tensor w");
    return ScatterOrFail(comm, std::move(plans), 1).status();
  });
  ExpectSameOnAll(statuses, InvalidArgumentError("rank 1: overlapping chunks of tensor w"));

  statuses = RunRanks(3, [&](Communicator& comm) {
    return ScatterOrFail(comm, std::vector<std::string>{"only", "two"}, 0).status();
  });
  ExpectSameOnAll(
      statuses, InvalidArgumentError(
                    "rank 0: ScatterOrFail: root computed 2 payloads, expected one per rank (3)"));

  statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    // Non-root ranks' arguments are ignored, errors included.
    Result<std::string> value = comm.rank() == 2 ? Result<std::string>(std::string("v"))
                                                 : Result<std::string>(CancelledError("ignored"));
    Result<std::string> got = BroadcastOrFail(comm, std::move(value), 2);
    if (!got.ok() || got->compare("v") != 0) return InternalError("first broadcast failed");
    return BroadcastOrFail(comm, NotFoundError("no metadata in /c"), 0).status();
  });
  ExpectSameOnAll(statuses, NotFoundError("rank 0: no metadata in /c"));
}

// A protocol of five phases; rank `fail_rank` fails in phase `fail_phase` (for the scatter and
// broadcast phases the failure is the root's). Records the phase each rank stopped in.
Status RunProtocol(Communicator& comm, int fail_rank, int fail_phase, std::vector<int>* stopped) {
  const int me = comm.rank();
  auto local = [&](int phase) -> Result<std::string> {
    if (me == fail_rank && phase == fail_phase) {
      return FailedPreconditionError("injected failure in phase " + std::to_string(phase));
    }
    return "phase " + std::to_string(phase) + " from " + std::to_string(me);
  };
  (*stopped)[me] = 0;
  SP_RETURN_IF_ERROR(AllGatherOrFail(comm, local(0)).status());
  (*stopped)[me] = 1;
  SP_RETURN_IF_ERROR(GatherOrFail(comm, local(1), 0).status());
  (*stopped)[me] = 2;
  Result<std::vector<std::string>> parts = std::vector<std::string>(comm.size(), "p");
  if (Status status = local(2).status(); !status.ok()) parts = status;
  SP_RETURN_IF_ERROR(ScatterOrFail(comm, std::move(parts), fail_rank).status());
  (*stopped)[me] = 3;
  SP_RETURN_IF_ERROR(BroadcastOrFail(comm, local(3), fail_rank).status());
  (*stopped)[me] = 4;
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, local(4).status()));
  (*stopped)[me] = 5;
  return OkStatus();
}

TEST(CollectiveTest, FailureInPhaseKStopsEveryRankInPhaseK) {
  for (int n : {1, 2, 3, 6}) {
    for (int phase = 0; phase <= 5; ++phase) {
      for (int fail_rank = 0; fail_rank < n; ++fail_rank) {
        SCOPED_TRACE(std::to_string(n) + " ranks, rank " + std::to_string(fail_rank) +
                     " fails in phase " + std::to_string(phase));
        std::vector<int> stopped(n, -1);
        auto statuses = RunRanks(
            n, [&](Communicator& comm) { return RunProtocol(comm, fail_rank, phase, &stopped); });
        const Status expected =
            phase == 5
                ? OkStatus()
                : FailedPreconditionError("rank " + std::to_string(fail_rank) +
                                          ": injected failure in phase " + std::to_string(phase));
        ExpectSameOnAll(statuses, expected);
        for (int r = 0; r < n; ++r) EXPECT_EQ(stopped[r], phase) << "rank " << r;
      }
    }
  }
}

TEST(CollectiveTest, RankThatLeavesMidProtocolFailsTheRestIdentically) {
  for (int leave_phase = 0; leave_phase < 3; ++leave_phase) {
    auto statuses = RunRanks(4, [&](Communicator& comm) -> Status {
      for (int phase = 0; phase < 3; ++phase) {
        if (comm.rank() == 1 && phase == leave_phase) return OkStatus();
        SP_RETURN_IF_ERROR(AllGatherOrFail(comm, std::string("ok")).status());
        SP_RETURN_IF_ERROR(AgreeOnStatus(comm, OkStatus()));
      }
      return OkStatus();
    });
    EXPECT_TRUE(statuses[1].ok());
    for (int r : {0, 2, 3}) {
      EXPECT_EQ(statuses[r], AbortedError("rank 1 left the communicator group during AllGather"))
          << r;
    }
  }
}

TEST(CollectiveTest, MalformedEnvelopeIsDataLoss) {
  auto statuses = RunRanks(3, [&](Communicator& comm) -> Status {
    if (comm.rank() == 1) return comm.AllGather(std::string()).status();
    if (comm.rank() == 2) return comm.AllGather(std::string("x\x07")).status();
    return AllGatherOrFail(comm, std::string("fine")).status();
  });
  EXPECT_EQ(statuses[0],
            DataLossError("AllGatherOrFail: the envelope sent by rank 1 is malformed: it is "
                          "empty, expected at least the 1-byte tag"));
  statuses = RunRanks(2, [&](Communicator& comm) -> Status {
    if (comm.rank() == 1) return comm.AllGather(std::string("\x09\x01", 2)).status();
    return AllGatherOrFail(comm, std::string("fine")).status();
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kDataLoss);
  EXPECT_EQ(
      statuses[0].message().rfind("AllGatherOrFail: the envelope sent by rank 1 is malformed: ", 0),
      0u)
      << statuses[0];
}

}  // namespace
}  // namespace sp
