#include "shardpoint/comm/communicator.h"

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

}  // namespace sp
