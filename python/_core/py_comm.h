// PyCommunicator: a Communicator whose collectives are methods of a Python object.
//
// The object (typically shardpoint's torch.distributed adapter, or an in-process fake in tests)
// has integer attributes `rank` and `size` and the methods
//   gather(data: bytes, root: int) -> list[bytes] | None      (None on non-root ranks)
//   scatter(chunks: list[bytes] | None, root: int) -> bytes
//   broadcast(data: bytes | None, root: int) -> bytes
//   all_gather(data: bytes) -> list[bytes]
//   barrier() -> None
// and optionally
//   all_to_all(chunks: list[bytes]) -> list[bytes] (chunks[i] to rank i; returns what each rank
//     sent to this one); without it AllToAll runs one scatter per rank;
//   all_to_all_buffers(send: bytearray, sizes: list[int]) -> (recv, recv_sizes): the same
//     exchange on one buffer each way, preferred over all_to_all when both exist. `send` holds
//     the payloads back to back, sizes[i] bytes for rank i; `recv` is any C-contiguous object
//     with the buffer protocol (a numpy array, a bytearray) holding what each rank sent to this
//     one back to back, recv_sizes[i] bytes from rank i. The payloads cross the Python boundary
//     without a bytes object each: the core copies them into `send` and out of `recv` with the
//     GIL released;
//   spans_machines() -> bool: whether the group's ranks run on more than one machine, the same on
//     every rank (it may be a collective: it is called at the same point on every rank, once per
//     PyCommunicator, with the GIL taken). Without it, or when it raises (reported as an
//     unraisable exception), the answer is false, the default of Communicator;
//   machine_ranks() -> list[int]: the ranks of the group on this rank's machine, in separate
//     processes, ascending, this rank among them (called like spans_machines). Without it, or
//     when it raises or returns anything else (reported as an unraisable exception), the answer
//     is [rank], the default of Communicator.
//   exchange_with_peers(sends: list[tuple[int, bytearray]], sources: list[int]) -> list: sends
//     each payload to its rank and returns one payload from each rank of `sources`, in that
//     order (bytes-like objects), moving nothing between other ranks
//     (Communicator::ExchangeWithPeers; the core checks the lists first); without it
//     ExchangeWithPeers runs one all-to-all;
//   any_rank(flag: bool) -> bool: whether flag is true on any rank, the same on every rank (an
//     all-reduce); without it AnyRank runs an all_gather of one byte per rank.
// Each collective acquires the GIL only for the duration of the Python call, so the engine can
// run with the GIL released, on any thread (AsyncSaver's background thread included). A Python
// exception raised by a method, or a result of the wrong shape, becomes kUnavailable
// "communicator <op> failed: <exception text>"; the Python error is cleared.
//
// Thread-safety: like any Communicator, one thread calls it at a time. Construction and
// destruction need the GIL (the object holds a Python reference).
#ifndef SHARDPOINT_PYTHON_CORE_PY_COMM_H_
#define SHARDPOINT_PYTHON_CORE_PY_COMM_H_

#include <nanobind/nanobind.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/comm/communicator.h"

namespace sp::python {

class PyCommunicator final : public Communicator {
 public:
  // Reads `rank` and `size` once and checks the methods exist. Raises TypeError / ValueError
  // (naming the missing attribute or the bad value) when `comm` does not look like a
  // communicator. GIL held.
  static std::unique_ptr<PyCommunicator> FromObject(nanobind::handle comm);

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::vector<std::string>> Gather(std::string payload, int root) override;
  Result<std::string> Scatter(std::vector<std::string> payloads, int root) override;
  Result<std::string> Broadcast(std::string payload, int root) override;
  Result<std::vector<std::string>> AllGather(std::string payload) override;
  Status Barrier() override;
  Result<bool> AnyRank(bool flag) override;
  Result<std::vector<std::string>> AllToAll(std::vector<std::string> payloads) override;
  Result<std::vector<std::string>> ExchangeWithPeers(std::vector<std::pair<int, std::string>> sends,
                                                     const std::vector<int>& from) override;
  bool spans_machines() const override;
  std::vector<int> machine_ranks() override;

 private:
  PyCommunicator(nanobind::object comm, int rank, int size, bool has_all_to_all,
                 bool has_all_to_all_buffers, bool has_spans_machines, bool has_any_rank,
                 bool has_exchange_with_peers)
      : comm_(std::move(comm)),
        rank_(rank),
        size_(size),
        has_all_to_all_(has_all_to_all),
        has_all_to_all_buffers_(has_all_to_all_buffers),
        has_spans_machines_(has_spans_machines),
        has_any_rank_(has_any_rank),
        has_exchange_with_peers_(has_exchange_with_peers) {}

  // AllToAll through the object's all_to_all_buffers.
  Result<std::vector<std::string>> AllToAllBuffers(std::vector<std::string> payloads);

  nanobind::object comm_;
  int rank_;
  int size_;
  bool has_all_to_all_;
  bool has_all_to_all_buffers_;
  bool has_spans_machines_;
  bool has_any_rank_;
  bool has_exchange_with_peers_;
  mutable std::optional<bool> spans_machines_;  // the object's answer, once asked
  std::optional<std::vector<int>> machine_ranks_;  // the object's answer, once asked
};

// Returns a PyCommunicator for `comm`, or null when `comm` is None (one rank). GIL held.
std::unique_ptr<PyCommunicator> MaybeCommunicator(nanobind::handle comm);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_PY_COMM_H_
