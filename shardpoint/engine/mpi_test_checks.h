// The checks of the MPI test programs (mpi_load_test, mpi_scale_test): a check passes only when
// it holds on every rank; rank 0 prints "N passed, M failed", and each failing rank a line.
#ifndef SHARDPOINT_ENGINE_MPI_TEST_CHECKS_H_
#define SHARDPOINT_ENGINE_MPI_TEST_CHECKS_H_

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "shardpoint/comm/mpi_comm.h"

namespace sp {

class MpiChecks {
 public:
  explicit MpiChecks(int rank) : rank_(rank) {}

  // Counts `name` as passed only when `ok` holds on every rank (a collective call).
  void Expect(const std::string& name, bool ok, const std::string& detail = "") {
    int failed = ok ? 0 : 1, any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!ok) std::fprintf(stderr, "FAILED %s on rank %d %s\n", name.c_str(), rank_, detail.c_str());
    ++(any ? failed_ : passed_);
  }
  // Prints the counts on rank 0; the process's exit status (non-zero when a check failed).
  int Report() const {
    if (rank_ == 0) std::printf("%d passed, %d failed\n", passed_, failed_);
    return failed_ == 0 ? 0 : 1;
  }

 private:
  int rank_;
  int passed_ = 0;
  int failed_ = 0;
};

// The whole of an MPI test program: MPI_Init, an MpiComm over MPI_COMM_WORLD, body(comm, checks),
// the report, MPI_Finalize; returns the exit status. A hung run ends on SIGALRM after
// `alarm_seconds`, and mpirun then ends the other ranks.
inline int RunMpiChecks(int* argc, char*** argv, unsigned alarm_seconds,
                        const std::function<void(Communicator&, MpiChecks&)>& body) {
  alarm(alarm_seconds);
  MPI_Init(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MpiChecks checks(rank);
  Result<std::unique_ptr<MpiComm>> made = MpiComm::Create(MPI_COMM_WORLD);
  checks.Expect("MpiComm::Create", made.ok(), made.ok() ? "" : made.status().ToString());
  if (made.ok()) body(**made, checks);
  const int exit_code = checks.Report();
  made = Result<std::unique_ptr<MpiComm>>(nullptr);  // before MPI_Finalize
  MPI_Finalize();
  return exit_code;
}

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_MPI_TEST_CHECKS_H_
