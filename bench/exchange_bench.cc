// The exchange plan of a shared load at MPI rank counts: what each rank receives and how long the
// ranks take to hold their plans, planned on one rank (now) against every rank planning from
// every rank's needs (the protocol it replaced), in the same run.
//
//   mpirun -np 256 --oversubscribe build/bench/exchange_bench [--tensors 40] [--tp 8] [--runs 3]
//   mpirun -np 1 build/bench/exchange_bench --plan-only-ranks 8192   # rank 0's planning alone
//
// A shared load (engine/read_exchange.h) reads each stored chunk that several ranks need once and
// exchanges its regions. Before, every rank all-gathered every rank's needs (AllGatherOrFail of
// EncodeNeeds) and planned the whole exchange from them: each rank received, held and planned
// from O(ranks x its needs). Now rank 0 gathers the needs, plans once (PlanExchange) and sends
// each rank its own plan (PlanExchangeOnRoot): a rank other than 0 receives its plan alone.
//
// The layout: --tensors tensors of [4 x ranks, 16 x tp] float32, saved as row blocks of 4 rows,
// one per rank (each in that rank's file), and loaded by the same ranks as a TP x DP grid: rank
// r takes the columns of TP rank r % tp over the rows of DP group r / tp, so each stored block
// is needed (16 columns each) by the tp ranks of one DP group and read once for them. Each rank
// has tensors x tp needs. Rank 0 prints, for each protocol, the median over --runs runs of the
// slowest rank's time from its needs to its plan, the most bytes a rank other than 0 received,
// and what rank 0 received; each run checks that both protocols give every rank the same plan.
// Here every rank shares the machine's cores, so every rank planning (before) costs the ranks'
// count times the planning; on a cluster each rank plans on its own core, in about the time of
// the planning alone (on rank 0 while the others wait, printed), beside receiving every rank's
// needs.
//
// Then the rounds of the plan: each rank sends the regions it reads for others (filled bytes of
// the packed sizes) and receives its own, --exchanges times over, through an all-to-all of the
// whole group (AllToAllOrFail: one MPI_Allreduce, MPI_Alltoall of every pair's size and
// MPI_Alltoallv; the rounds before) and through one flag (AnyRank) and point-to-point messages
// between the peers alone (ExchangeWithPeers; now). Every received payload is checked for its
// size and bytes. Printed: the median over --runs of the slowest rank's time for all of them.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "bench/mpi_bench.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/mpi_comm.h"
#include "shardpoint/engine/read_exchange.h"

namespace sp {
namespace {

constexpr int64_t kBlockRows = 4;
constexpr int64_t kCols = 16;
constexpr uint64_t kRoundBytes = uint64_t{256} << 20;

using bench::Median;

// Bytes this rank receives from the collectives it calls.
class CountingComm : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  Result<std::vector<std::string>> Gather(std::string p, int root) override {
    return Count(ForwardingComm::Gather(std::move(p), root));
  }
  Result<std::string> Scatter(std::vector<std::string> p, int root) override {
    return Count(ForwardingComm::Scatter(std::move(p), root));
  }
  Result<std::string> Broadcast(std::string p, int root) override {
    return Count(ForwardingComm::Broadcast(std::move(p), root));
  }
  Result<std::vector<std::string>> AllGather(std::string p) override {
    return Count(ForwardingComm::AllGather(std::move(p)));
  }
  uint64_t received = 0;

 private:
  Result<std::string> Count(Result<std::string> out) {
    if (out.ok()) received += out->size();
    return out;
  }
  Result<std::vector<std::string>> Count(Result<std::vector<std::string>> out) {
    if (out.ok()) {
      for (const std::string& each : *out) received += each.size();
    }
    return out;
  }
};

CheckpointMetadata Metadata(int ranks, int tensors) {
  CheckpointMetadata md;
  md.checksum_block_bytes = 1 << 20;
  md.files.resize(ranks);
  const int64_t cols = kCols * 8;  // the widest --tp; each tensor is as wide
  const uint64_t block_bytes = static_cast<uint64_t>(kBlockRows * cols) * 4;
  for (int f = 0; f < ranks; ++f) md.files[f].size = block_bytes * static_cast<uint64_t>(tensors);
  for (int t = 0; t < tensors; ++t) {
    TensorMetadata tensor;
    tensor.name = "t" + std::to_string(t);
    tensor.dtype = DType::kFloat32;
    tensor.shape = {kBlockRows * ranks, cols};
    for (int r = 0; r < ranks; ++r) {
      StoredChunk c;
      c.box = Box({kBlockRows * r, 0}, {kBlockRows, cols});
      c.file = static_cast<uint32_t>(r);
      c.byte_length = block_bytes;
      c.stored_length = block_bytes;
      c.data_offset = block_bytes * static_cast<uint64_t>(t);
      tensor.chunks.push_back(std::move(c));
    }
    md.tensors.push_back(std::move(tensor));
  }
  return md;
}

RankNeeds NeedsOf(int rank, int ranks, int tensors, int tp) {
  RankNeeds needs;
  const int groups = ranks / tp;
  const int blocks = ranks / groups;  // stored blocks per DP group
  const int group = rank / tp;
  const int64_t col = kCols * (rank % tp);
  for (int t = 0; t < tensors; ++t) {
    for (int b = group * blocks; b < (group + 1) * blocks; ++b) {
      needs.needs.push_back(ChunkNeed{static_cast<uint32_t>(t), static_cast<uint32_t>(b),
                                      Box({kBlockRows * b, col}, {kBlockRows, kCols})});
    }
  }
  return needs;
}

// The protocol before: every rank's needs on every rank, every rank planning the whole exchange.
Result<ExchangePlan> PlanEverywhere(Communicator& comm, const RankNeeds& mine,
                                    const CheckpointMetadata& md) {
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                      AllGatherOrFail(comm, Result<std::string>(EncodeNeeds(mine))));
  std::vector<RankNeeds> all;
  for (int r = 0; r < comm.size(); ++r) {
    SP_ASSIGN_OR_RETURN(RankNeeds needs, DecodeNeeds(gathered[r], md, r));
    all.push_back(std::move(needs));
    std::string().swap(gathered[r]);
  }
  return std::move(PlanExchange(all, md, kRoundBytes)[comm.rank()]);
}

struct Timed {
  double seconds = 0;       // the slowest rank's
  uint64_t most_other = 0;  // the most bytes a rank other than 0 received
  uint64_t root = 0;        // bytes rank 0 received
  ExchangePlan plan;
};

// The payloads one round of `plan` sends: (q, the packed bytes of rank q's needs, each byte q).
std::vector<std::pair<int, std::string>> RoundPayloads(const ExchangeRound& round,
                                                       const CheckpointMetadata& md) {
  std::vector<std::pair<int, std::string>> out;
  for (const auto& [q, needs] : round.send) {
    uint64_t bytes = 0;
    for (const ChunkNeed& need : needs) {
      bytes += PackedBytes(need.region, md.tensors[need.tensor].dtype);
    }
    out.emplace_back(q, std::string(bytes, static_cast<char>(q & 0x7f)));
  }
  return out;
}

// The bytes this rank receives from each sender of a round, in the order of round.receive.
std::vector<uint64_t> RoundExpected(const ExchangeRound& round, const ExchangePlan& plan,
                                    const RankNeeds& mine, const CheckpointMetadata& md) {
  std::vector<uint64_t> out;
  for (const auto& [s, indices] : round.receive) {
    uint64_t bytes = 0;
    for (size_t i : indices) {
      const ChunkNeed& need =
          i < mine.needs.size() ? mine.needs[i] : plan.parts[i - mine.needs.size()];
      bytes += PackedBytes(need.region, md.tensors[need.tensor].dtype);
    }
    out.push_back(bytes);
  }
  return out;
}

// The slowest rank's time to exchange every round of `plan` `repeats` times, through an
// all-to-all of the group or point to point between the peers.
double TimeRounds(Communicator& comm, const ExchangePlan& plan, const RankNeeds& mine,
                  const CheckpointMetadata& md, bool peers, int repeats) {
  std::vector<std::vector<std::pair<int, std::string>>> payloads;
  std::vector<std::vector<uint64_t>> expected;
  std::vector<std::vector<int>> from;
  for (const ExchangeRound& round : plan.rounds) {
    payloads.push_back(RoundPayloads(round, md));
    expected.push_back(RoundExpected(round, plan, mine, md));
    from.emplace_back();
    for (const auto& [s, indices] : round.receive) from.back().push_back(s);
  }
  const char me = static_cast<char>(comm.rank() & 0x7f);
  bool wrong = false;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  for (int repeat = 0; repeat < repeats; ++repeat) {
    for (size_t k = 0; k < plan.rounds.size(); ++k) {
      std::vector<std::string> got;
      if (peers) {
        Result<bool> failed = comm.AnyRank(false);
        Result<std::vector<std::string>> received =
            failed.ok() ? comm.ExchangeWithPeers(payloads[k], from[k])
                        : Result<std::vector<std::string>>(failed.status());
        if (!received.ok()) {
          std::fprintf(stderr, "exchange_bench: %s\n", received.status().ToString().c_str());
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
        got = std::move(received).value();
      } else {
        std::vector<std::string> all(static_cast<size_t>(comm.size()));
        for (const auto& [q, bytes] : payloads[k]) all[q] = bytes;
        Result<std::vector<std::string>> received = AllToAllOrFail(comm, std::move(all));
        if (!received.ok()) {
          std::fprintf(stderr, "exchange_bench: %s\n", received.status().ToString().c_str());
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (int s : from[k]) got.push_back(std::move((*received)[s]));
      }
      for (size_t i = 0; i < got.size(); ++i) {
        wrong = wrong || got[i].size() != expected[k][i] ||
                std::count(got[i].begin(), got[i].end(), me) != static_cast<long>(got[i].size());
      }
    }
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (wrong) {
    std::fprintf(stderr, "exchange_bench: rank %d received a wrong payload (%s)\n", comm.rank(),
                 peers ? "point to point" : "all-to-all");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  double slowest = 0;
  MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

Timed Run(Communicator& inner, const RankNeeds& mine, const CheckpointMetadata& md,
          bool on_root) {
  CountingComm comm(inner);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  Result<ExchangePlan> plan = on_root ? PlanExchangeOnRoot(comm, mine, md, kRoundBytes)
                                      : PlanEverywhere(comm, mine, md);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!plan.ok()) {
    std::fprintf(stderr, "exchange_bench: %s\n", plan.status().ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  Timed out;
  MPI_Allreduce(&seconds, &out.seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  unsigned long long other = comm.rank() == 0 ? 0 : comm.received, most = 0;
  MPI_Allreduce(&other, &most, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  out.most_other = most;
  unsigned long long root = comm.received;
  MPI_Bcast(&root, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  out.root = root;
  out.plan = std::move(plan).value();
  return out;
}

int Main(int argc, char** argv) {
  int tensors = 40, tp = 8, runs = 3, exchanges = 20, plan_ranks = 0;
  if (!bench::ParseIntFlags(argc, argv,
                            {{"--tensors", &tensors},
                             {"--tp", &tp},
                             {"--runs", &runs},
                             {"--exchanges", &exchanges},
                             {"--plan-only-ranks", &plan_ranks}},
                            "exchange_bench [--tensors N] [--tp N] [--runs N] [--exchanges N] "
                            "[--plan-only-ranks N]")) {
    return 2;
  }
  const std::unique_ptr<MpiComm> world = bench::WorldComm("exchange_bench");
  if (world == nullptr) return 1;
  Communicator& comm = *world;
  if (plan_ranks > 0) {
    // The planning alone for a group of --plan-only-ranks ranks (more than this machine can run
    // as processes), on rank 0: what rank 0 computes for a shared load of that many ranks.
    if (comm.rank() != 0) return 0;
    if (plan_ranks % tp != 0) {
      std::fprintf(stderr, "exchange_bench: --tp must divide --plan-only-ranks\n");
      return 2;
    }
    const CheckpointMetadata md = Metadata(plan_ranks, tensors);
    std::vector<RankNeeds> all;
    size_t needs = 0;
    for (int r = 0; r < plan_ranks; ++r) {
      all.push_back(NeedsOf(r, plan_ranks, tensors, tp));
      needs += all.back().needs.size();
    }
    std::vector<double> seconds;
    for (int run = 0; run < runs; ++run) {
      const auto start = std::chrono::steady_clock::now();
      const std::vector<ExchangePlan> plans = PlanExchange(all, md, kRoundBytes);
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("PlanExchange for %d ranks, %d tensors, TP %d (%zu needs): %.3f s, median of %d "
                "(%.2f us a need)\n",
                plan_ranks, tensors, tp, needs, Median(seconds), runs,
                1e6 * Median(seconds) / static_cast<double>(std::max<size_t>(1, needs)));
    return 0;
  }
  if (tp < 1 || tp > 8 || comm.size() % tp != 0 || tensors < 1) {
    if (comm.rank() == 0) {
      std::fprintf(stderr, "exchange_bench: --tp must be 1-8 and divide the %d ranks\n",
                   comm.size());
    }
    return 2;
  }
  const CheckpointMetadata md = Metadata(comm.size(), tensors);
  const RankNeeds mine = NeedsOf(comm.rank(), comm.size(), tensors, tp);
  std::vector<double> everywhere, on_root;
  Timed before, after;
  for (int run = 0; run < runs; ++run) {  // the two protocols in turn, so that drift hits both
    before = Run(comm, mine, md, false);
    after = Run(comm, mine, md, true);
    if (!(before.plan == after.plan)) {
      std::fprintf(stderr, "exchange_bench: rank %d got different plans from the protocols\n",
                   comm.rank());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    everywhere.push_back(before.seconds);
    on_root.push_back(after.seconds);
  }
  std::vector<double> all_to_all, peers;
  for (int run = 0; run < runs; ++run) {
    all_to_all.push_back(TimeRounds(comm, after.plan, mine, md, false, exchanges));
    peers.push_back(TimeRounds(comm, after.plan, mine, md, true, exchanges));
  }
  // The most peers a rank sends to in a round.
  unsigned long long my_peers = 0, most_peers = 0;
  for (const ExchangeRound& round : after.plan.rounds) {
    my_peers = std::max<unsigned long long>(my_peers, round.send.size());
  }
  MPI_Allreduce(&my_peers, &most_peers, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  // The planning alone, on rank 0 while the others wait: what every rank computed before, each on
  // its own core on a cluster (here the ranks share the machine's cores).
  double plan_alone = 0;
  if (comm.rank() == 0) {
    std::vector<RankNeeds> all;
    for (int r = 0; r < comm.size(); ++r) all.push_back(NeedsOf(r, comm.size(), tensors, tp));
    const auto start = std::chrono::steady_clock::now();
    const std::vector<ExchangePlan> plans = PlanExchange(all, md, kRoundBytes);
    plan_alone = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm.rank() == 0) {
    std::printf("%d ranks, %d tensors, TP %d: %zu needs per rank, %llu chunks shared; "
                "median of %d runs (slowest rank)\n",
                comm.size(), tensors, tp, mine.needs.size(),
                static_cast<unsigned long long>(after.plan.shared_chunks), runs);
    std::printf("  %-42s %10s %16s %14s\n", "", "seconds", "other rank recv", "rank 0 recv");
    std::printf("  %-42s %10.4f %16llu %14llu\n", "every rank plans from all needs (before)",
                Median(everywhere), static_cast<unsigned long long>(before.most_other),
                static_cast<unsigned long long>(before.root));
    std::printf("  %-42s %10.4f %16llu %14llu\n", "rank 0 plans, each rank sent its own (now)",
                Median(on_root), static_cast<unsigned long long>(after.most_other),
                static_cast<unsigned long long>(after.root));
    std::printf("  time %.1fx faster; a rank other than 0 receives %.1fx fewer bytes\n",
                Median(everywhere) / Median(on_root),
                static_cast<double>(before.most_other) /
                    static_cast<double>(std::max<uint64_t>(1, after.most_other)));
    std::printf("  planning alone on one rank (PlanExchange of every rank's needs): %.4f s\n",
                plan_alone);
    std::printf("rounds: %zu, each rank sends to at most %llu ranks; %d exchanges of every round, "
                "median of %d runs (slowest rank)\n",
                after.plan.rounds.size(), most_peers, exchanges, runs);
    std::printf("  %-42s %10.4f\n", "all-to-all of the group (before)", Median(all_to_all));
    std::printf("  %-42s %10.4f\n", "flag, then point to point (now)", Median(peers));
    std::printf("  %.1fx faster\n", Median(all_to_all) / Median(peers));
  }
  return 0;
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) { return sp::bench::RunUnderMpi(argc, argv, sp::Main); }
