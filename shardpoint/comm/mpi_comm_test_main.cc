// Checks MpiComm, and the error-carrying collectives over it, under mpirun with any number of
// ranks (ctest runs it with 4). A check passes only when it passes on every rank. Rank 0 prints
// one line per failed check and then "N passed, M failed"; the exit status is non-zero when any
// check failed.
//
// Every check makes the same sequence of collective calls on every rank whatever it finds (a rank
// that stopped early would leave the others waiting); a watchdog ends a run that hangs anyway.
//
// Usage: mpirun -np 4 mpi_comm_test [--large]
//   --large  also moves payloads larger than 2 GiB (rank 0 needs about 5 GiB of memory).
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "shardpoint/comm/collective.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/mpi_comm.h"

namespace sp {
namespace {

using ::sp::testing::CheckEveryCollective;
using ::sp::testing::MakePayload;
using ::sp::testing::MatchesPayload;

struct Outcome {
  int passed = 0;
  int failed = 0;
};

// Runs `check` on every rank and counts it as passed only if it passed on all of them.
void Run(const char* name, const std::function<Status()>& check, Outcome* outcome) {
  Status status = check();
  int local_failed = status.ok() ? 0 : 1;
  int any_failed = 0;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (!status.ok()) {
    std::fprintf(stderr, "FAILED %s on rank %d: %s\n", name, rank, status.ToString().c_str());
  }
  ++(any_failed ? outcome->failed : outcome->passed);
}

// Keeps the first failure among several checks of one run.
class FirstFailure {
 public:
  void Note(const Status& status) {
    if (status_.ok()) status_ = status;
  }
  void Expect(const Status& actual, const Status& expected) {
    if (actual == expected) return;
    Note(InternalError("got " + actual.ToString() + ", expected " + expected.ToString()));
  }
  void True(bool ok, const char* what) {
    if (!ok) Note(InternalError(what));
  }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

Result<std::unique_ptr<MpiComm>> MakeComm(size_t max_message_bytes) {
  return MpiComm::Create(MPI_COMM_WORLD, MpiCommOptions{max_message_bytes});
}

Status CheckCollectives(size_t max_message_bytes, const std::vector<size_t>& sizes) {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(max_message_bytes));
  FirstFailure failure;
  for (size_t i = 0; i < sizes.size(); ++i) {
    failure.Note(CheckEveryCollective(*comm, sizes[i], static_cast<int>(i)));
  }
  return failure.status();
}

Status CheckOwnBuffersStay() {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(size_t{1} << 30));
  std::string payload = MakePayload(1 << 20, comm->rank());
  const char* mine = payload.data();
  FirstFailure failure;
  SP_ASSIGN_OR_RETURN(auto all, comm->AllGather(std::move(payload)));
  failure.True(all[comm->rank()].data() == mine, "AllGather copied the own payload");
  SP_ASSIGN_OR_RETURN(auto gathered, comm->Gather(std::move(all[comm->rank()]), 0));
  failure.True(comm->rank() != 0 || gathered[0].data() == mine, "Gather copied root's payload");
  return failure.status();
}

Status CheckInvalidCalls() {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(size_t{1} << 30));
  const int n = comm->size();
  const std::string last = std::to_string(n - 1);
  FirstFailure failure;
  failure.Expect(
      comm->Scatter(std::vector<std::string>(n + 1, "x"), n - 1).status(),
      InvalidArgumentError("Scatter: root " + last + " passed " + std::to_string(n + 1) +
                           " payloads, expected one per rank (" + std::to_string(n) + ")"));
  failure.Expect(
      comm->Gather("x", n).status(),
      InvalidArgumentError("Gather: root " + std::to_string(n) +
                           " is out of range for a group of " + std::to_string(n) + " ranks"));
  failure.Expect(
      comm->AllToAll(std::vector<std::string>(comm->rank() == 1 ? n + 2 : n, "x")).status(),
      InvalidArgumentError("AllToAll: rank 1 passed " + std::to_string(n + 2) +
                           " payloads, expected one per rank (" + std::to_string(n) + ")"));
  failure.True(!comm->spans_machines(), "the ranks of this test run on one machine");
  {
    std::vector<int> all(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) all[static_cast<size_t>(r)] = r;
    failure.True(comm->machine_ranks() == all, "machine_ranks() lists every rank, in order");
  }
  failure.Expect(MakeComm(0).status(), InvalidArgumentError("MpiComm::Create: max_message_bytes "
                                                            "is 0, expected 1 to 2147483647"));
  failure.Note(comm->Barrier());
  return failure.status();
}

// Rank `fail_rank` fails in phase `fail_phase` of a four-phase protocol; every rank must stop in
// that phase with the same error.
Status CheckFailureInPhase(int fail_rank, int fail_phase) {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(64));
  const int me = comm->rank();
  auto local = [&](int phase) -> Result<std::string> {
    if (me == fail_rank && phase == fail_phase)
      return NotFoundError("tensor w" + std::to_string(phase));
    return MakePayload(100 + me, phase);
  };
  const Status expected = NotFoundError("rank " + std::to_string(fail_rank) + ": tensor w" +
                                        std::to_string(fail_phase));
  int phase = 0;
  Status status = GatherOrFail(*comm, local(0), 0).status();
  if (status.ok()) status = AllGatherOrFail(*comm, local(++phase)).status();
  if (status.ok()) status = BroadcastOrFail(*comm, local(++phase), fail_rank).status();
  if (status.ok()) status = AgreeOnStatus(*comm, local(++phase).status());
  FirstFailure failure;
  failure.True(phase == fail_phase, "stopped in a phase other than the failing one");
  failure.Expect(status, expected);
  return failure.status();
}

Status CheckScatterOrFail() {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(10));
  const int n = comm->size();
  std::vector<std::string> parts;
  for (int r = 0; r < n; ++r) parts.push_back(MakePayload(1000 * r, r));
  FirstFailure failure;
  SP_ASSIGN_OR_RETURN(std::string part, ScatterOrFail(*comm, std::move(parts), n - 1));
  failure.True(MatchesPayload(part, 1000 * comm->rank(), comm->rank()),
               "ScatterOrFail delivered the wrong part");
  Result<std::vector<std::string>> failed = DataLossError("file /c/3.data: crc mismatch");
  failure.Expect(ScatterOrFail(*comm, std::move(failed), 0).status(),
                 DataLossError("rank 0: file /c/3.data: crc mismatch"));
  return failure.status();
}

Status CheckLargerThanTwoGiB() {
  SP_ASSIGN_OR_RETURN(auto comm, MakeComm(size_t{1} << 30));
  const size_t size = (size_t{1} << 31) + 5;
  const int sender = comm->size() - 1;
  std::string value = comm->rank() == sender ? MakePayload(size, 7) : std::string();
  SP_ASSIGN_OR_RETURN(value, comm->Broadcast(std::move(value), sender));
  FirstFailure failure;
  failure.True(MatchesPayload(value, size, 7), "Broadcast of 2 GiB + 5 bytes");
  SP_ASSIGN_OR_RETURN(auto gathered,
                      comm->Gather(comm->rank() == sender ? std::move(value) : std::string(), 0));
  failure.True(comm->rank() != 0 || MatchesPayload(gathered[sender], size, 7),
               "Gather of 2 GiB + 5 bytes");
  return failure.status();
}

int RunAll(bool large) {
  Outcome outcome;
  const std::vector<size_t> sizes = {0, 1, 7, 4096, (size_t{1} << 20) + 3};
  Run(
      "collectives, default split", [&] { return CheckCollectives(size_t{1} << 30, sizes); },
      &outcome);
  Run(
      "collectives, split into 4093-byte rounds",
      [&] { return CheckCollectives(4093, {0, 1, 4093, 4094, 100003}); }, &outcome);
  Run(
      "collectives, one-byte rounds", [&] { return CheckCollectives(1, {0, 1, 5, 300}); },
      &outcome);
  Run("own buffers stay", CheckOwnBuffersStay, &outcome);
  Run("invalid calls", CheckInvalidCalls, &outcome);
  Run("ScatterOrFail", CheckScatterOrFail, &outcome);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  for (int fail_rank = 0; fail_rank < size; ++fail_rank) {
    for (int phase = 0; phase < 4; ++phase) {
      Run("failure in a phase", [&] { return CheckFailureInPhase(fail_rank, phase); }, &outcome);
    }
  }
  if (large) Run("payloads larger than 2 GiB", CheckLargerThanTwoGiB, &outcome);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::printf("%d passed, %d failed\n", outcome.passed, outcome.failed);
  return outcome.failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) {
  const bool large = argc > 1 && std::strcmp(argv[1], "--large") == 0;
  alarm(large ? 1800 : 300);  // a hung run ends on SIGALRM, and mpirun then ends the others
  MPI_Init(&argc, &argv);
  const int exit_code = sp::RunAll(large);
  MPI_Finalize();
  return exit_code;
}
