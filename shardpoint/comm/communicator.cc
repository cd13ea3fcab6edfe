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
