// MpiComm: a Communicator over an MPI communicator (built only where MPI is found).
//
// Every rank of the MPI communicator is one rank of the group. Payloads are variable-length: each
// collective first exchanges payload sizes, then moves the bytes with MPI_Gatherv, MPI_Scatterv,
// MPI_Allgatherv or MPI_Bcast. Gather and Scatter move sizes to and from the root only: the root
// learns every rank's size, and each other rank only its own, where it lies among all the
// payloads and their total (what its part of each round follows from), so that what a rank
// receives does not grow with the group. MPI counts and displacements are ints, so a transfer is
// split into rounds that move at most `max_message_bytes` (default 1 GiB) in all; payloads of any
// size, beyond 2 GiB included, go through. A rank's own payload never travels: the root of Gather
// and Scatter keeps its own buffer, and AllGather moves each rank's own payload into its result.
// ExchangeWithPeers is no collective: point-to-point messages between the ranks that exchange,
// in parts of at most `max_message_bytes` each, whose sizes the receiver learns by probing.
//
// Errors. The wrapped communicator is duplicated (so shardpoint's messages never mix with the
// application's) and set to MPI_ERRORS_RETURN; a failed MPI call returns kUnavailable naming the
// call and the collective, with MPI's error string. Arguments every rank checks alike (root out
// of range) and Scatter given the wrong number of payloads at the root fail with
// kInvalidArgument on every rank. Unlike ThreadComm, MPI offers no timeouts and cannot detect
// mismatched collectives: as with MPI itself, every rank must call the same collectives with the
// same root in the same order. A rank that dies usually makes the MPI runtime end the job.
//
// Thread-safety: one thread uses an MpiComm at a time (MPI_THREAD_SERIALIZED or stronger when
// other threads also call MPI). MPI must be initialized before Create and finalized only after
// the MpiComm is destroyed.
#ifndef SHARDPOINT_COMM_MPI_COMM_H_
#define SHARDPOINT_COMM_MPI_COMM_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"

namespace sp {

struct MpiCommOptions {
  // Upper bound on the bytes one MPI call moves in all (1 to INT_MAX). Smaller values bound the
  // staging memory of Gather, Scatter and AllGather at the cost of more rounds.
  size_t max_message_bytes = size_t{1} << 30;
};

class MpiComm final : public Communicator {
 public:
  // Duplicates `comm` (which the caller keeps owning). Returns kFailedPrecondition when MPI is
  // not initialized, kInvalidArgument for a bad option, kUnavailable when MPI fails.
  static Result<std::unique_ptr<MpiComm>> Create(MPI_Comm comm, MpiCommOptions options = {});
  // Frees the duplicated communicator (unless MPI is already finalized).
  ~MpiComm() override;

  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::vector<std::string>> Gather(std::string payload, int root) override;
  Result<std::string> Scatter(std::vector<std::string> payloads, int root) override;
  Result<std::string> Broadcast(std::string payload, int root) override;
  Result<std::vector<std::string>> AllGather(std::string payload) override;
  Status Barrier() override;
  // One MPI_Allreduce (MPI_MAX) of an int.
  Result<bool> AnyRank(bool flag) override;
  // Whether the ranks span machines: learned at Create() by splitting the group by shared memory.
  bool spans_machines() const override { return spans_machines_; }
  // The ranks of this rank's shared-memory split, learned at Create() too.
  std::vector<int> machine_ranks() override { return machine_ranks_; }
  // One MPI_Allreduce (whether any rank passed other than one payload per rank, and the largest
  // payload), MPI_Alltoall of the sizes, then MPI_Alltoallv in rounds that move at most
  // max_message_bytes / size() bytes of each pair's payload.
  Result<std::vector<std::string>> AllToAll(std::vector<std::string> payloads) override;
  // MPI_Isend of each payload to its peer, then, for each rank in `from`, MPI_Mprobe and
  // MPI_Imrecv of what it sent; nothing else moves. A payload travels as messages of at most
  // max_message_bytes, the last one shorter (possibly empty), which tells the receiver it is the
  // last; messages of one sender arrive in order (MPI does not overtake), so rounds do not mix.
  Result<std::vector<std::string>> ExchangeWithPeers(std::vector<std::pair<int, std::string>> sends,
                                                     const std::vector<int>& from) override;

 private:
  MpiComm(MPI_Comm comm, int rank, int size, MpiCommOptions options, bool spans_machines,
          std::vector<int> machine_ranks);

  Status CheckRoot(int root, const char* collective) const;
  // Sizes of every rank's payload, known on every rank.
  Result<std::vector<uint64_t>> AllGatherSizes(uint64_t mine, const char* collective);
  // The rounds of a Gather or Scatter: `sizes` (every rank's, on the root only), this rank's
  // payload at bytes [prefix, prefix + its size) of all of them, `total` bytes in all.
  Status GatherRounds(const std::string& payload, const std::vector<uint64_t>& sizes,
                      uint64_t prefix, uint64_t total, int root,
                      std::vector<std::string>* gathered);
  Status ScatterRounds(const std::vector<std::string>& payloads, const std::vector<uint64_t>& sizes,
                       uint64_t prefix, uint64_t total, int root, std::string* mine);
  Status AllGatherRounds(const std::string& payload, const std::vector<uint64_t>& sizes,
                         std::vector<std::string>* gathered);

  MPI_Comm comm_;
  int rank_;
  int size_;
  MpiCommOptions options_;
  bool spans_machines_;
  std::vector<int> machine_ranks_;
};

}  // namespace sp

#endif  // SHARDPOINT_COMM_MPI_COMM_H_
