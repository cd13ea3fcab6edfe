// What the MPI benchmarks share: MPI around their main, and the world communicator.
#ifndef SHARDPOINT_BENCH_MPI_BENCH_H_
#define SHARDPOINT_BENCH_MPI_BENCH_H_

#include <mpi.h>

#include <cstdio>
#include <memory>

#include "shardpoint/comm/mpi_comm.h"

namespace sp::bench {

// Runs main_fn(argc, argv) between MPI_Init and MPI_Finalize; its communicators are gone (its
// scope) before MPI is finalized.
inline int RunUnderMpi(int argc, char** argv, int (*main_fn)(int, char**)) {
  MPI_Init(&argc, &argv);
  const int rc = main_fn(argc, argv);
  MPI_Finalize();
  return rc;
}

// An MpiComm over MPI_COMM_WORLD, or null after printing why, prefixed by `bench`.
inline std::unique_ptr<MpiComm> WorldComm(const char* bench) {
  Result<std::unique_ptr<MpiComm>> made = MpiComm::Create(MPI_COMM_WORLD);
  if (!made.ok()) {
    std::fprintf(stderr, "%s: %s\n", bench, made.status().ToString().c_str());
    return nullptr;
  }
  return std::move(made).value();
}

}  // namespace sp::bench

#endif  // SHARDPOINT_BENCH_MPI_BENCH_H_
