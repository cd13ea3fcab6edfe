#include "shardpoint/comm/communicator.h"

#include <utility>

namespace sp {

Result<std::vector<std::string>> Communicator::AllToAll(std::vector<std::string> payloads) {
  // Each Scatter checks its root's payload count, so a malformed call fails on every rank
  // instead of leaving the others waiting.
  const int n = size();
  std::vector<std::string> received(n);
  for (int root = 0; root < n; ++root) {
    std::vector<std::string> mine;
    if (root == rank()) mine = std::move(payloads);
    SP_ASSIGN_OR_RETURN(received[root], Scatter(std::move(mine), root));
  }
  return received;
}

namespace {

Status CheckPeerList(const std::vector<int>& ranks, const char* verb, int rank, int size) {
  std::vector<bool> named(static_cast<size_t>(size), false);
  for (int q : ranks) {
    if (q < 0 || q >= size) {
      return InvalidArgumentError("ExchangeWithPeers: rank " + std::to_string(rank) + " " + verb +
                                  " rank " + std::to_string(q) + ", expected a rank of 0.." +
                                  std::to_string(size - 1));
    }
    if (named[q]) {
      return InvalidArgumentError("ExchangeWithPeers: rank " + std::to_string(rank) + " " + verb +
                                  " rank " + std::to_string(q) + " twice");
    }
    named[q] = true;
  }
  return OkStatus();
}

}  // namespace

Status CheckPeerLists(const std::vector<std::pair<int, std::string>>& sends,
                      const std::vector<int>& from, int rank, int size) {
  std::vector<int> to;
  to.reserve(sends.size());
  for (const auto& [q, bytes] : sends) to.push_back(q);
  SP_RETURN_IF_ERROR(CheckPeerList(to, "sends to", rank, size));
  return CheckPeerList(from, "receives from", rank, size);
}

Result<std::vector<std::string>> Communicator::ExchangeWithPeers(
    std::vector<std::pair<int, std::string>> sends, const std::vector<int>& from) {
  const int n = size();
  const Status malformed = CheckPeerLists(sends, from, rank(), n);
  // A malformed call still takes part in the collective, with nothing to send, so that the
  // others do not wait.
  std::vector<std::string> payloads(n);
  if (malformed.ok()) {
    for (auto& [q, bytes] : sends) payloads[q] = std::move(bytes);
  }
  SP_ASSIGN_OR_RETURN(std::vector<std::string> received, AllToAll(std::move(payloads)));
  SP_RETURN_IF_ERROR(malformed);
  std::vector<bool> expected(n, false);
  std::vector<std::string> out;
  out.reserve(from.size());
  for (int s : from) {
    expected[s] = true;
    out.push_back(std::move(received[s]));
  }
  for (int s = 0; s < n; ++s) {
    if (!expected[s] && !received[s].empty()) {
      return InvalidArgumentError("ExchangeWithPeers: rank " + std::to_string(s) + " sent " +
                                  std::to_string(received[s].size()) + " bytes to rank " +
                                  std::to_string(rank()) + ", which does not receive from it");
    }
  }
  return out;
}

Result<bool> Communicator::AnyRank(bool flag) {
  SP_ASSIGN_OR_RETURN(std::vector<std::string> flags,
                      AllGather(std::string(1, flag ? '\1' : '\0')));
  if (static_cast<int>(flags.size()) != size()) {
    return DataLossError("AnyRank: the all-gather returned " + std::to_string(flags.size()) +
                         " flags, expected one per rank (" + std::to_string(size()) + ")");
  }
  bool any = false;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r].size() != 1 || (flags[r][0] != '\0' && flags[r][0] != '\1')) {
      return DataLossError("AnyRank: rank " + std::to_string(r) + " sent a flag of " +
                           std::to_string(flags[r].size()) + " bytes, expected one byte 0 or 1");
    }
    any = any || flags[r][0] == '\1';
  }
  return any;
}

}  // namespace sp
