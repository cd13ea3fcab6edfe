// Communicator: how the ranks of one save or load exchange plans, as byte buffers.
//
// Every rank of a group must call the same collectives in the same order. Payloads are opaque
// bytes (std::string). A collective returns an error only when the transport itself fails
// (a rank left the group, a timeout); application errors travel as data through the helpers in
// comm/collective.h, so that every rank returns the same error and nothing hangs.
// One Communicator object is used by one thread (its rank) at a time.
//
// Implementations: ThreadComm (ranks as threads of one process; tests and offline tools),
// MPI (comm/mpi_comm.h) and torch.distributed (from Python).
#ifndef SHARDPOINT_COMM_COMMUNICATOR_H_
#define SHARDPOINT_COMM_COMMUNICATOR_H_

#include <string>
#include <utility>
#include <vector>

#include "shardpoint/base/result.h"

namespace sp {

// Whether the lists of Communicator::ExchangeWithPeers name only ranks of a group of `size`, each
// at most once in each list; InvalidArgument naming `rank`, the list and the rank otherwise.
Status CheckPeerLists(const std::vector<std::pair<int, std::string>>& sends,
                      const std::vector<int>& from, int rank, int size);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Root receives every rank's payload, indexed by rank; other ranks receive an empty vector.
  virtual Result<std::vector<std::string>> Gather(std::string payload, int root) = 0;
  // Root passes exactly size() payloads (ignored elsewhere); rank r receives payloads[r].
  virtual Result<std::string> Scatter(std::vector<std::string> payloads, int root) = 0;
  // Every rank receives root's payload (the argument is ignored on other ranks).
  virtual Result<std::string> Broadcast(std::string payload, int root) = 0;
  // Every rank receives every rank's payload, indexed by rank.
  virtual Result<std::vector<std::string>> AllGather(std::string payload) = 0;
  virtual Status Barrier() = 0;
  // Rank r passes exactly size() payloads, payloads[q] meant for rank q; it receives, indexed by
  // sender, what every rank passed for r. The default runs one Scatter per rank (each rank in
  // turn as the root); implementations override it with a direct exchange.
  virtual Result<std::vector<std::string>> AllToAll(std::vector<std::string> payloads);
  // Point to point among the ranks that exchange: this rank sends each (q, bytes) of `sends` to
  // rank q, and receives one payload from each rank of `from`, returned in the order of `from`.
  // Both lists name each rank at most once, and they must match across the group: q sends to r
  // exactly when r lists q in `from` (a plan made for all ranks at once gives each rank its own
  // lists). Every rank calls it at the same point, with empty lists when it exchanges nothing.
  // What one rank moves grows with its peers, not with the group. A rank may name itself; its
  // payload stays. The default runs one AllToAll (a collective), and fails on a payload from a
  // rank not in `from`; implementations override it with sends and receives between the peers
  // alone, where a mismatch waits for the message that never comes (so callers agree, before
  // exchanging, that every rank got its lists).
  virtual Result<std::vector<std::string>> ExchangeWithPeers(
      std::vector<std::pair<int, std::string>> sends, const std::vector<int>& from);
  // Whether `flag` is true on any rank: the same answer on every rank. Protocols agree through it
  // that nothing failed, so that the common case moves one integer per rank and not a message
  // from every rank to every rank (comm/collective.h: AgreeOnStatus). The default runs an
  // AllGather of one byte per rank; implementations override it with an all-reduce.
  virtual Result<bool> AnyRank(bool flag);
  // True when the group's ranks run on more than one machine (they do not share a page cache),
  // so that sending bytes between ranks can be cheaper than reading them again. The same on
  // every rank. The default, for communicators that cannot tell, is false.
  virtual bool spans_machines() const { return false; }
  // The ranks of the group that run on this rank's machine as separate processes, ascending, this
  // rank among them, and the same list on each of them: they read the same devices, so a load
  // puts their reads through one gate (exec/shared_io_tuner.h). Every rank calls it at the same
  // point (it may run a collective the first time). The default, for communicators that cannot
  // tell and for ranks that share a process (and so a thread pool and its gate), is this rank
  // alone.
  virtual std::vector<int> machine_ranks() { return {rank()}; }
  // True when every rank of the group is a thread of this process, so that an address one rank
  // publishes is valid in every other for as long as its owner keeps it (a load then copies the
  // regions of a shared chunk straight into the other ranks' destinations instead of sending
  // them bytes). The same on every rank. The default is false.
  virtual bool shares_memory() const { return false; }
};

}  // namespace sp

#endif  // SHARDPOINT_COMM_COMMUNICATOR_H_
