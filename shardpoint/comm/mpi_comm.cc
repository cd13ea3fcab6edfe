#include "shardpoint/comm/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <deque>
#include <utility>

namespace sp {
namespace {

Status MpiCheck(int rc, const char* call, const char* collective) {
  if (rc == MPI_SUCCESS) return OkStatus();
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  int error_class = rc;
  if (MPI_Error_class(rc, &error_class) != MPI_SUCCESS) error_class = rc;
  return UnavailableError(std::string(call) + " in " + collective +
                          " failed: " + std::string(text, length) + " (MPI error class " +
                          std::to_string(error_class) + ")");
}

// One round of a split transfer: the bytes of each rank's payload that move in it.
struct TransferRound {
  std::vector<int> counts;        // bytes of rank r's payload moved in this round
  std::vector<int> displs;        // where they sit in the round's staging buffer
  std::vector<uint64_t> offsets;  // where they start in rank r's payload
  int total = 0;                  // sum of counts
};

// Splits the transfer of sizes[r] bytes from (or to) every rank r into rounds that move at most
// `limit` bytes in all, so that every MPI count and displacement fits in an int. Every rank
// computes the same rounds from the same sizes.
class RoundSchedule {
 public:
  RoundSchedule(const std::vector<uint64_t>& sizes, size_t limit)
      : sizes_(sizes), sent_(sizes.size(), 0), limit_(limit) {}

  // Fills *round with the next round; returns false once every byte has been scheduled.
  bool Next(TransferRound* round) {
    const size_t n = sizes_.size();
    round->counts.assign(n, 0);
    round->displs.assign(n, 0);
    round->offsets.assign(n, 0);
    round->total = 0;
    uint64_t budget = limit_;
    for (size_t r = 0; r < n; ++r) {
      const uint64_t take = std::min<uint64_t>(sizes_[r] - sent_[r], budget);
      round->offsets[r] = sent_[r];
      round->counts[r] = static_cast<int>(take);
      round->displs[r] = round->total;
      round->total += static_cast<int>(take);
      sent_[r] += take;
      budget -= take;
    }
    return round->total > 0;
  }

 private:
  const std::vector<uint64_t>& sizes_;
  std::vector<uint64_t> sent_;
  const uint64_t limit_;
};

// The rounds RoundSchedule splits `total` bytes into.
uint64_t RoundCount(uint64_t total, size_t limit) { return (total + limit - 1) / limit; }

// The part of round k of a RoundSchedule that moves bytes of a payload lying at bytes
// [prefix, prefix + size) of all the payloads in rank order: the round moves bytes
// [k x limit, (k + 1) x limit) of them. (offset in the payload, count).
std::pair<uint64_t, int> PartInRound(uint64_t k, uint64_t prefix, uint64_t size, size_t limit) {
  const uint64_t begin = std::max<uint64_t>(k * limit, prefix);
  const uint64_t end = std::min<uint64_t>((k + 1) * limit, prefix + size);
  if (begin >= end) return {0, 0};
  return {begin - prefix, static_cast<int>(end - begin)};
}

// Where each payload lies among all of them in rank order, and their total.
std::vector<uint64_t> Prefixes(const std::vector<uint64_t>& sizes, uint64_t* total) {
  std::vector<uint64_t> prefixes(sizes.size());
  *total = 0;
  for (size_t r = 0; r < sizes.size(); ++r) {
    prefixes[r] = *total;
    *total += sizes[r];
  }
  return prefixes;
}

}  // namespace

Result<std::unique_ptr<MpiComm>> MpiComm::Create(MPI_Comm comm, MpiCommOptions options) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return FailedPreconditionError(std::string("MpiComm::Create: MPI is ") +
                                   (finalized ? "already finalized" : "not initialized") +
                                   ", expected a call between MPI_Init and MPI_Finalize");
  }
  if (options.max_message_bytes == 0 || options.max_message_bytes > size_t{INT_MAX}) {
    return InvalidArgumentError("MpiComm::Create: max_message_bytes is " +
                                std::to_string(options.max_message_bytes) + ", expected 1 to " +
                                std::to_string(INT_MAX));
  }
  MPI_Comm dup = MPI_COMM_NULL;
  SP_RETURN_IF_ERROR(MpiCheck(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup", "MpiComm::Create"));
  int rank = 0;
  int size = 0;
  Status status = MpiCheck(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN),
                           "MPI_Comm_set_errhandler", "MpiComm::Create");
  if (status.ok()) status = MpiCheck(MPI_Comm_rank(dup, &rank), "MPI_Comm_rank", "MpiComm::Create");
  if (status.ok()) status = MpiCheck(MPI_Comm_size(dup, &size), "MPI_Comm_size", "MpiComm::Create");
  // The ranks that share this rank's memory (its machine); the group spans machines when, on
  // any rank, they are fewer than the whole group.
  int spans = 0;
  std::vector<int> machine;
  if (status.ok()) {
    MPI_Comm local = MPI_COMM_NULL;
    status = MpiCheck(MPI_Comm_split_type(dup, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local),
                      "MPI_Comm_split_type", "MpiComm::Create");
    int local_size = size;
    if (status.ok()) {
      status = MpiCheck(MPI_Comm_size(local, &local_size), "MPI_Comm_size", "MpiComm::Create");
      if (status.ok()) {
        machine.resize(static_cast<size_t>(local_size));
        status = MpiCheck(MPI_Allgather(&rank, 1, MPI_INT, machine.data(), 1, MPI_INT, local),
                          "MPI_Allgather", "MpiComm::Create");
        std::sort(machine.begin(), machine.end());
      }
      MPI_Comm_free(&local);
    }
    spans = local_size < size ? 1 : 0;
    if (status.ok()) {
      status = MpiCheck(MPI_Allreduce(MPI_IN_PLACE, &spans, 1, MPI_INT, MPI_MAX, dup),
                        "MPI_Allreduce", "MpiComm::Create");
    }
  }
  if (!status.ok()) {
    MPI_Comm_free(&dup);
    return status;
  }
  return std::unique_ptr<MpiComm>(
      new MpiComm(dup, rank, size, options, spans != 0, std::move(machine)));
}

MpiComm::MpiComm(MPI_Comm comm, int rank, int size, MpiCommOptions options, bool spans_machines,
                 std::vector<int> machine_ranks)
    : comm_(comm),
      rank_(rank),
      size_(size),
      options_(options),
      spans_machines_(spans_machines),
      machine_ranks_(std::move(machine_ranks)) {}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Status MpiComm::CheckRoot(int root, const char* collective) const {
  if (root >= 0 && root < size_) return OkStatus();
  return InvalidArgumentError(std::string(collective) + ": root " + std::to_string(root) +
                              " is out of range for a group of " + std::to_string(size_) +
                              " ranks");
}

Result<std::vector<uint64_t>> MpiComm::AllGatherSizes(uint64_t mine, const char* collective) {
  std::vector<uint64_t> sizes(size_, 0);
  SP_RETURN_IF_ERROR(
      MpiCheck(MPI_Allgather(&mine, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T, comm_),
               "MPI_Allgather of payload sizes", collective));
  return sizes;
}

Result<std::vector<std::string>> MpiComm::Gather(std::string payload, int root) {
  SP_RETURN_IF_ERROR(CheckRoot(root, "Gather"));
  const bool is_root = rank_ == root;
  // Root's own payload does not travel. The root learns every size and sends each rank where its
  // payload lies among them and their total.
  uint64_t mine = is_root ? 0 : payload.size();
  std::vector<uint64_t> sizes(is_root ? size_ : 0);
  SP_RETURN_IF_ERROR(MpiCheck(
      MPI_Gather(&mine, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T, root, comm_),
      "MPI_Gather of payload sizes", "Gather"));
  std::vector<uint64_t> places;  // per rank: its prefix, the total
  if (is_root) {
    uint64_t total = 0;
    const std::vector<uint64_t> prefixes = Prefixes(sizes, &total);
    places.resize(2 * static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      places[2 * r] = prefixes[r];
      places[2 * r + 1] = total;
    }
  }
  uint64_t place[2] = {0, 0};
  SP_RETURN_IF_ERROR(MpiCheck(
      MPI_Scatter(places.data(), 2, MPI_UINT64_T, place, 2, MPI_UINT64_T, root, comm_),
      "MPI_Scatter of payload places", "Gather"));
  std::vector<std::string> gathered(is_root ? size_ : 0);
  for (int r = 0; is_root && r < size_; ++r) gathered[r].reserve(sizes[r]);
  SP_RETURN_IF_ERROR(GatherRounds(payload, sizes, place[0], place[1], root, &gathered));
  if (is_root) gathered[root] = std::move(payload);
  return gathered;
}

Status MpiComm::GatherRounds(const std::string& payload, const std::vector<uint64_t>& sizes,
                             uint64_t prefix, uint64_t total, int root,
                             std::vector<std::string>* gathered) {
  const size_t limit = options_.max_message_bytes;
  const bool is_root = rank_ == root;
  RoundSchedule schedule(sizes, limit);  // the root's: every rank's part of each round
  TransferRound round;
  std::string staging;
  const uint64_t rounds = RoundCount(total, limit);
  for (uint64_t k = 0; k < rounds; ++k) {
    if (is_root) {
      schedule.Next(&round);
      staging.resize(round.total);
    }
    const auto [offset, count] =
        PartInRound(k, prefix, is_root ? 0 : payload.size(), limit);
    SP_RETURN_IF_ERROR(MpiCheck(
        MPI_Gatherv(payload.data() + offset, count, MPI_BYTE, staging.data(),
                    is_root ? round.counts.data() : nullptr,
                    is_root ? round.displs.data() : nullptr, MPI_BYTE, root, comm_),
        "MPI_Gatherv", "Gather"));
    if (!is_root) continue;
    for (int r = 0; r < size_; ++r) {
      (*gathered)[r].append(staging.data() + round.displs[r], round.counts[r]);
    }
  }
  return OkStatus();
}

Result<std::string> MpiComm::Scatter(std::vector<std::string> payloads, int root) {
  SP_RETURN_IF_ERROR(CheckRoot(root, "Scatter"));
  const bool is_root = rank_ == root;
  // Per rank: how many payloads root was given, the size of the rank's payload (0 for root's
  // own, which does not travel), where it lies among all of them, and their total.
  std::vector<uint64_t> sizes;
  std::vector<uint64_t> headers;
  if (is_root) {
    sizes.assign(size_, 0);
    for (int r = 0; r < size_ && payloads.size() == size_t(size_); ++r) {
      sizes[r] = r == root ? 0 : payloads[r].size();
    }
    uint64_t total = 0;
    const std::vector<uint64_t> prefixes = Prefixes(sizes, &total);
    headers.resize(4 * static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      headers[4 * r] = payloads.size();
      headers[4 * r + 1] = sizes[r];
      headers[4 * r + 2] = prefixes[r];
      headers[4 * r + 3] = total;
    }
  }
  uint64_t header[4] = {0, 0, 0, 0};
  SP_RETURN_IF_ERROR(MpiCheck(
      MPI_Scatter(headers.data(), 4, MPI_UINT64_T, header, 4, MPI_UINT64_T, root, comm_),
      "MPI_Scatter of payload sizes", "Scatter"));
  if (header[0] != uint64_t(size_)) {
    return InvalidArgumentError("Scatter: root " + std::to_string(root) + " passed " +
                                std::to_string(header[0]) + " payloads, expected one per rank (" +
                                std::to_string(size_) + ")");
  }
  std::string mine(header[1], '\0');
  SP_RETURN_IF_ERROR(ScatterRounds(payloads, sizes, header[2], header[3], root, &mine));
  if (is_root) mine = std::move(payloads[root]);
  return mine;
}

Status MpiComm::ScatterRounds(const std::vector<std::string>& payloads,
                              const std::vector<uint64_t>& sizes, uint64_t prefix, uint64_t total,
                              int root, std::string* mine) {
  const size_t limit = options_.max_message_bytes;
  const bool is_root = rank_ == root;
  RoundSchedule schedule(sizes, limit);  // the root's: every rank's part of each round
  TransferRound round;
  std::string staging;
  const uint64_t rounds = RoundCount(total, limit);
  for (uint64_t k = 0; k < rounds; ++k) {
    if (is_root) {
      schedule.Next(&round);
      staging.clear();
      for (int r = 0; r < size_; ++r) {
        staging.append(payloads[r].data() + round.offsets[r], round.counts[r]);
      }
    }
    const auto [offset, count] = PartInRound(k, prefix, is_root ? 0 : mine->size(), limit);
    SP_RETURN_IF_ERROR(
        MpiCheck(MPI_Scatterv(staging.data(), is_root ? round.counts.data() : nullptr,
                              is_root ? round.displs.data() : nullptr, MPI_BYTE,
                              mine->data() + offset, count, MPI_BYTE, root, comm_),
                 "MPI_Scatterv", "Scatter"));
  }
  return OkStatus();
}

Result<std::string> MpiComm::Broadcast(std::string payload, int root) {
  SP_RETURN_IF_ERROR(CheckRoot(root, "Broadcast"));
  uint64_t total = rank_ == root ? payload.size() : 0;
  SP_RETURN_IF_ERROR(MpiCheck(MPI_Bcast(&total, 1, MPI_UINT64_T, root, comm_),
                              "MPI_Bcast of the payload size", "Broadcast"));
  if (rank_ != root) {
    payload.clear();
    payload.resize(total);
  }
  // The payload goes straight into each rank's buffer, in pieces of at most max_message_bytes.
  for (uint64_t offset = 0; offset < total; offset += options_.max_message_bytes) {
    const int count =
        static_cast<int>(std::min<uint64_t>(options_.max_message_bytes, total - offset));
    SP_RETURN_IF_ERROR(MpiCheck(MPI_Bcast(payload.data() + offset, count, MPI_BYTE, root, comm_),
                                "MPI_Bcast", "Broadcast"));
  }
  return payload;
}

Result<std::vector<std::string>> MpiComm::AllGather(std::string payload) {
  SP_ASSIGN_OR_RETURN(std::vector<uint64_t> sizes, AllGatherSizes(payload.size(), "AllGather"));
  std::vector<std::string> gathered(size_);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) gathered[r].reserve(sizes[r]);
  }
  SP_RETURN_IF_ERROR(AllGatherRounds(payload, sizes, &gathered));
  gathered[rank_] = std::move(payload);
  return gathered;
}

Status MpiComm::AllGatherRounds(const std::string& payload, const std::vector<uint64_t>& sizes,
                                std::vector<std::string>* gathered) {
  RoundSchedule schedule(sizes, options_.max_message_bytes);
  TransferRound round;
  std::string staging;
  while (schedule.Next(&round)) {
    staging.resize(round.total);
    SP_RETURN_IF_ERROR(MpiCheck(
        MPI_Allgatherv(payload.data() + round.offsets[rank_], round.counts[rank_], MPI_BYTE,
                       staging.data(), round.counts.data(), round.displs.data(), MPI_BYTE, comm_),
        "MPI_Allgatherv", "AllGather"));
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) (*gathered)[r].append(staging.data() + round.displs[r], round.counts[r]);
    }
  }
  return OkStatus();
}

Status MpiComm::Barrier() { return MpiCheck(MPI_Barrier(comm_), "MPI_Barrier", "Barrier"); }

Result<bool> MpiComm::AnyRank(bool flag) {
  int mine = flag ? 1 : 0, any = 0;
  SP_RETURN_IF_ERROR(MpiCheck(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm_),
                              "MPI_Allreduce", "AnyRank"));
  return any != 0;
}

Result<std::vector<std::string>> MpiComm::AllToAll(std::vector<std::string> payloads) {
  // One all-reduce says whether any rank passed other than one payload per rank (so that a
  // malformed call fails everywhere) and the largest payload; only when some rank did are the
  // counts all-gathered, to name the first.
  const bool malformed = payloads.size() != size_t(size_);
  std::vector<uint64_t> send_sizes(size_), recv_sizes(size_);
  uint64_t agreed[2] = {malformed ? 1u : 0u, 0};  // any malformed, the largest payload
  for (int q = 0; q < size_ && !malformed; ++q) {
    send_sizes[q] = q == rank_ ? 0 : payloads[q].size();  // this rank's own payload stays
    agreed[1] = std::max(agreed[1], send_sizes[q]);
  }
  SP_RETURN_IF_ERROR(MpiCheck(MPI_Allreduce(MPI_IN_PLACE, agreed, 2, MPI_UINT64_T, MPI_MAX, comm_),
                              "MPI_Allreduce of the payload counts", "AllToAll"));
  if (agreed[0] != 0) {
    SP_ASSIGN_OR_RETURN(std::vector<uint64_t> counts,
                        AllGatherSizes(payloads.size(), "AllToAll"));
    for (int r = 0; r < size_; ++r) {
      if (counts[r] != uint64_t(size_)) {
        return InvalidArgumentError("AllToAll: rank " + std::to_string(r) + " passed " +
                                    std::to_string(counts[r]) +
                                    " payloads, expected one per rank (" + std::to_string(size_) +
                                    ")");
      }
    }
  }
  const uint64_t largest = agreed[1];
  SP_RETURN_IF_ERROR(MpiCheck(MPI_Alltoall(send_sizes.data(), 1, MPI_UINT64_T, recv_sizes.data(),
                                           1, MPI_UINT64_T, comm_),
                              "MPI_Alltoall of payload sizes", "AllToAll"));
  std::vector<std::string> received(size_);
  for (int s = 0; s < size_; ++s) received[s].reserve(recv_sizes[s]);
  const uint64_t quota = std::max<uint64_t>(1, options_.max_message_bytes / size_);
  std::vector<int> scounts(size_), sdispls(size_), rcounts(size_), rdispls(size_);
  std::string send, recv;
  for (uint64_t at = 0; at < largest; at += quota) {
    send.clear();
    int rtotal = 0;
    for (int q = 0; q < size_; ++q) {
      const uint64_t take = send_sizes[q] > at ? std::min(quota, send_sizes[q] - at) : 0;
      sdispls[q] = static_cast<int>(send.size());
      scounts[q] = static_cast<int>(take);
      send.append(payloads[q].data() + (take > 0 ? at : 0), take);
      const uint64_t get = recv_sizes[q] > at ? std::min(quota, recv_sizes[q] - at) : 0;
      rdispls[q] = rtotal;
      rcounts[q] = static_cast<int>(get);
      rtotal += static_cast<int>(get);
    }
    recv.resize(rtotal);
    SP_RETURN_IF_ERROR(MpiCheck(MPI_Alltoallv(send.data(), scounts.data(), sdispls.data(), MPI_BYTE,
                                              recv.data(), rcounts.data(), rdispls.data(), MPI_BYTE,
                                              comm_),
                                "MPI_Alltoallv", "AllToAll"));
    for (int s = 0; s < size_; ++s) received[s].append(recv.data() + rdispls[s], rcounts[s]);
  }
  received[rank_] = std::move(payloads[rank_]);
  return received;
}

Result<std::vector<std::string>> MpiComm::ExchangeWithPeers(
    std::vector<std::pair<int, std::string>> sends, const std::vector<int>& from) {
  // Checked before anything is sent: a malformed list is this rank's error alone, and its peers
  // would wait (the lists come from one plan, checked where it was decoded).
  SP_RETURN_IF_ERROR(CheckPeerLists(sends, from, rank_, size_));
  constexpr int kPeerTag = 0x5350;
  const uint64_t limit = options_.max_message_bytes;
  std::vector<MPI_Request> requests;
  std::string own;  // this rank's payload to itself, which does not travel
  // Each part lands in a string of its own (a deque does not move them as it grows); a payload
  // of several is joined once all have arrived.
  std::deque<std::string> parts;
  std::vector<std::pair<size_t, size_t>> of_sender;  // per entry of `from`: first part, count
  Status posted = [&]() -> Status {
    for (const auto& [q, bytes] : sends) {
      if (q == rank_) continue;
      // Parts of `limit` bytes, then a shorter last one (empty when the payload is a multiple).
      for (uint64_t at = 0;; at += limit) {
        const int count = static_cast<int>(std::min<uint64_t>(limit, bytes.size() - at));
        requests.push_back(MPI_REQUEST_NULL);
        SP_RETURN_IF_ERROR(MpiCheck(MPI_Isend(bytes.data() + at, count, MPI_BYTE, q, kPeerTag,
                                              comm_, &requests.back()),
                                    "MPI_Isend", "ExchangeWithPeers"));
        if (static_cast<uint64_t>(count) < limit) break;
      }
    }
    for (int s : from) {
      of_sender.emplace_back(parts.size(), 0);
      if (s == rank_) continue;
      for (;;) {
        MPI_Message message;
        MPI_Status status;
        SP_RETURN_IF_ERROR(MpiCheck(MPI_Mprobe(s, kPeerTag, comm_, &message, &status),
                                    "MPI_Mprobe", "ExchangeWithPeers"));
        int count = 0;
        SP_RETURN_IF_ERROR(MpiCheck(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count",
                                    "ExchangeWithPeers"));
        std::string& part = parts.emplace_back(static_cast<size_t>(count), '\0');
        ++of_sender.back().second;
        requests.push_back(MPI_REQUEST_NULL);
        SP_RETURN_IF_ERROR(MpiCheck(
            MPI_Imrecv(part.data(), count, MPI_BYTE, &message, &requests.back()), "MPI_Imrecv",
            "ExchangeWithPeers"));
        if (static_cast<uint64_t>(count) < limit) break;
      }
    }
    return OkStatus();
  }();
  // Whatever was posted completes before this frame (which holds the buffers) goes, also when a
  // call failed: the peers run the same exchange, so it does unless the job itself is failing.
  const Status waited = MpiCheck(
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
      "MPI_Waitall", "ExchangeWithPeers");
  SP_RETURN_IF_ERROR(posted);
  SP_RETURN_IF_ERROR(waited);
  for (auto& [q, bytes] : sends) {
    if (q == rank_) own = std::move(bytes);
  }
  std::vector<std::string> received(from.size());
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] == rank_) {
      received[i] = std::move(own);
      continue;
    }
    const auto [first, count] = of_sender[i];
    if (count == 1) {
      received[i] = std::move(parts[first]);
      continue;
    }
    size_t total = 0;
    for (size_t j = first; j < first + count; ++j) total += parts[j].size();
    received[i].reserve(total);
    for (size_t j = first; j < first + count; ++j) {
      received[i] += parts[j];
      std::string().swap(parts[j]);
    }
  }
  return received;
}

}  // namespace sp
