// What it costs the ranks of a save or a load to agree that none of them failed, at MPI rank
// counts, against the protocol it replaced, in the same run.
//
//   mpirun -np 256 --oversubscribe build/bench/agree_bench [--calls 200] [--runs 5]
//
// Every save commits and every load ends with that agreement (AgreeOnStatus, comm/collective.h),
// and a load between the processes of one machine makes two more of its kind while it maps its
// shared slots. It is now one flag per rank (Communicator::AnyRank: one MPI_Allreduce of an
// int), and the statuses travel only when some rank failed. Before, every rank all-gathered every
// rank's encoded status (AllGatherOrFail of an empty payload: an MPI_Allgather of the sizes, then
// of the bytes), so that each rank received two messages of every rank: 9 bytes per rank of the
// group, 72 KiB at 8,192 ranks, at every commit. Rank 0 prints, for each way, the median over
// --runs runs of the time per call of the slowest rank, and the ratio.
//
// It also times, the same way, the other collectives a load or a save makes on small payloads:
// a Gather of 64 bytes from every rank with a Scatter of 64 bytes to every rank (what a shared
// load's exchange plan takes: engine/read_exchange.h), and an AllToAll of 16 bytes per pair (one
// round of a shared load's exchange). Run with two builds to compare MpiComm's protocols.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/mpi_bench.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/comm/mpi_comm.h"

namespace sp {
namespace {

using bench::Median;

// Seconds per call of `calls` calls of `fn` on the slowest rank, the ranks started together.
double TimeCalls(int calls, const std::function<Status()>& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) {
    if (Status status = fn(); !status.ok()) {
      std::fprintf(stderr, "agree_bench: %s\n", status.ToString().c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double slowest = 0;
  MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest / calls;
}

int Main(int argc, char** argv) {
  int calls = 200, runs = 5;
  if (!bench::ParseIntFlags(argc, argv, {{"--calls", &calls}, {"--runs", &runs}},
                            "agree_bench [--calls N] [--runs N]")) {
    return 2;
  }
  const std::unique_ptr<MpiComm> world = bench::WorldComm("agree_bench");
  if (world == nullptr) return 1;
  Communicator& comm = *world;
  std::vector<double> gathered, flagged;
  for (int run = 0; run < runs; ++run) {  // the two ways in turn, so that drift hits both
    gathered.push_back(TimeCalls(calls, [&] {
      return AllGatherOrFail(comm, Result<std::string>(std::string())).status();
    }));
    flagged.push_back(TimeCalls(calls, [&] { return AgreeOnStatus(comm, OkStatus()); }));
  }
  std::vector<double> rooted, all_to_all;
  for (int run = 0; run < runs; ++run) {
    rooted.push_back(TimeCalls(calls, [&] {
      Result<std::vector<std::string>> gathered = comm.Gather(std::string(64, 'g'), 0);
      if (!gathered.ok()) return gathered.status();
      std::vector<std::string> parts(comm.rank() == 0 ? comm.size() : 0, std::string(64, 's'));
      return comm.Scatter(std::move(parts), 0).status();
    }));
    all_to_all.push_back(TimeCalls(calls, [&] {
      return comm.AllToAll(std::vector<std::string>(comm.size(), std::string(16, 'a'))).status();
    }));
  }
  if (comm.rank() == 0) {
    const double before = Median(gathered), after = Median(flagged);
    std::printf("%d ranks, %d calls per run, median of %d runs (slowest rank, per call)\n",
                comm.size(), calls, runs);
    std::printf("  statuses all-gathered (the protocol before) %10.1f us\n", before * 1e6);
    std::printf("  one flag per rank (AgreeOnStatus)           %10.1f us  = %.1fx faster\n",
                after * 1e6, before / after);
    std::printf("  Gather of 64 B + Scatter of 64 B            %10.1f us\n",
                Median(rooted) * 1e6);
    std::printf("  AllToAll of 16 B per pair                   %10.1f us\n",
                Median(all_to_all) * 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) { return sp::bench::RunUnderMpi(argc, argv, sp::Main); }
