// Helpers shared by the communicator tests: deterministic pseudo-random payloads that can be
// checked against their seed without keeping a second copy of a large buffer, and a check that
// runs every collective of a Communicator against those payloads.
#ifndef SHARDPOINT_COMM_COMM_TEST_UTIL_H_
#define SHARDPOINT_COMM_COMM_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"

namespace sp::testing {

// Forwards every call to another communicator; tests derive from it to change one answer.
class ForwardingComm : public Communicator {
 public:
  explicit ForwardingComm(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Result<std::vector<std::string>> Gather(std::string p, int root) override {
    return inner_.Gather(std::move(p), root);
  }
  Result<std::string> Scatter(std::vector<std::string> p, int root) override {
    return inner_.Scatter(std::move(p), root);
  }
  Result<std::string> Broadcast(std::string p, int root) override {
    return inner_.Broadcast(std::move(p), root);
  }
  Result<std::vector<std::string>> AllGather(std::string p) override {
    return inner_.AllGather(std::move(p));
  }
  Status Barrier() override { return inner_.Barrier(); }
  Result<bool> AnyRank(bool flag) override { return inner_.AnyRank(flag); }
  Result<std::vector<std::string>> AllToAll(std::vector<std::string> p) override {
    return inner_.AllToAll(std::move(p));
  }
  Result<std::vector<std::string>> ExchangeWithPeers(std::vector<std::pair<int, std::string>> p,
                                                     const std::vector<int>& from) override {
    return inner_.ExchangeWithPeers(std::move(p), from);
  }
  bool spans_machines() const override { return inner_.spans_machines(); }
  std::vector<int> machine_ranks() override { return inner_.machine_ranks(); }
  bool shares_memory() const override { return inner_.shares_memory(); }

 private:
  Communicator& inner_;
};

// The ranks of another communicator as if each ran on a machine of its own: a load shares its
// reads by sending regions between them (engine/read_exchange.h), not through one address space
// or one machine's shared memory.
class AcrossMachinesComm final : public ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  bool shares_memory() const override { return false; }
  bool spans_machines() const override { return true; }
  std::vector<int> machine_ranks() override { return {rank()}; }
};

inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// `size` bytes determined by `seed`.
inline std::string MakePayload(size_t size, uint64_t seed) {
  std::string out(size, '\0');
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = SplitMix64(state);
    std::memcpy(&out[i], &word, 8);
  }
  const uint64_t tail = SplitMix64(state);
  std::memcpy(&out[i], &tail, size - i);
  return out;
}

// True when `bytes` equals MakePayload(size, seed), byte for byte.
inline bool MatchesPayload(const std::string& bytes, size_t size, uint64_t seed) {
  if (bytes.size() != size) return false;
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = SplitMix64(state);
    if (std::memcmp(&bytes[i], &word, 8) != 0) return false;
  }
  const uint64_t tail = SplitMix64(state);
  return std::memcmp(&bytes[i], &tail, size - i) == 0;
}

// Seed of the payload that `rank` contributes for `purpose` in test round `round`.
inline uint64_t Seed(int round, int rank, int purpose) {
  return (uint64_t(round) << 32) ^ (uint64_t(rank) << 8) ^ uint64_t(purpose);
}

// Size of rank r's payload in a test with base size `size`: ranks differ so that a payload
// delivered to the wrong rank is caught.
inline size_t SizeOf(size_t size, int rank) { return size == 0 ? 0 : size + rank; }

// Records the first wrong payload seen. Checks keep going after one, so that every rank makes
// the same sequence of collective calls whatever it finds (a rank that stopped early would make
// the others wait for it).
class FirstMismatch {
 public:
  void Check(bool ok, const char* collective, int root, int from_rank) {
    if (ok || !status_.ok()) return;
    status_ = InternalError(std::string(collective) + " with root " + std::to_string(root) +
                            ": wrong payload from rank " + std::to_string(from_rank));
  }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

// Gather, Scatter and Broadcast with root `root`, each result checked against its seed.
inline Status CheckRootedCollectives(Communicator& comm, size_t size, int round, int root,
                                     FirstMismatch* mismatch) {
  const int n = comm.size();
  const int me = comm.rank();
  SP_ASSIGN_OR_RETURN(auto gathered,
                      comm.Gather(MakePayload(SizeOf(size, me), Seed(round, me, 1)), root));
  mismatch->Check(gathered.size() == (me == root ? size_t(n) : 0), "Gather", root, -1);
  for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
    mismatch->Check(MatchesPayload(gathered[r], SizeOf(size, r), Seed(round, r, 1)), "Gather", root,
                    r);
  }
  std::vector<std::string> parts;
  for (int r = 0; me == root && r < n; ++r) {
    parts.push_back(MakePayload(SizeOf(size, r), Seed(round, r, 2)));
  }
  SP_ASSIGN_OR_RETURN(std::string part, comm.Scatter(std::move(parts), root));
  mismatch->Check(MatchesPayload(part, SizeOf(size, me), Seed(round, me, 2)), "Scatter", root,
                  root);
  std::string value = me == root ? MakePayload(size, Seed(round, root, 3)) : "ignored";
  SP_ASSIGN_OR_RETURN(value, comm.Broadcast(std::move(value), root));
  mismatch->Check(MatchesPayload(value, size, Seed(round, root, 3)), "Broadcast", root, root);
  return OkStatus();
}

// Runs every collective on `comm` (the rooted ones once per root, then AllGather, AllToAll,
// ExchangeWithPeers and AnyRank), checking each result against its seed or flags. Rank r's
// payloads have SizeOf(size, r) bytes. A transport error is returned at once; a wrong payload is
// returned after every collective has run.
inline Status CheckEveryCollective(Communicator& comm, size_t size, int round) {
  const int n = comm.size();
  const int me = comm.rank();
  FirstMismatch mismatch;
  for (int root = 0; root < n; ++root) {
    SP_RETURN_IF_ERROR(CheckRootedCollectives(comm, size, round, root, &mismatch));
  }
  SP_ASSIGN_OR_RETURN(auto all, comm.AllGather(MakePayload(SizeOf(size, me), Seed(round, me, 4))));
  mismatch.Check(all.size() == size_t(n), "AllGather", -1, -1);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    mismatch.Check(MatchesPayload(all[r], SizeOf(size, r), Seed(round, r, 4)), "AllGather", -1, r);
  }
  // AllToAll: the payload from s to q has SizeOf(size, s) + q bytes (q + s bytes when size is
  // 0, so some pairs send nothing).
  auto pair_size = [size](int s, int q) { return size == 0 ? size_t(q + s) % 2 : SizeOf(size, s) + q; };
  std::vector<std::string> outgoing;
  for (int q = 0; q < n; ++q) outgoing.push_back(MakePayload(pair_size(me, q), Seed(round, me, 16 + q)));
  SP_ASSIGN_OR_RETURN(auto incoming, comm.AllToAll(std::move(outgoing)));
  mismatch.Check(incoming.size() == size_t(n), "AllToAll", -1, -1);
  for (int s = 0; s < static_cast<int>(incoming.size()); ++s) {
    mismatch.Check(MatchesPayload(incoming[s], pair_size(s, me), Seed(round, s, 16 + me)),
                   "AllToAll", -1, s);
  }
  // ExchangeWithPeers: s sends to q when (s + q + round) % 3 != 0 (a rank sometimes to itself),
  // the AllToAll's sizes again, so some payloads are exact multiples of a split's rounds.
  auto peers = [&](int s, int q) { return (s + q + round) % 3 != 0; };
  std::vector<std::pair<int, std::string>> sends;
  std::vector<int> from;
  for (int q = 0; q < n; ++q) {
    if (!peers(me, q)) continue;
    sends.emplace_back(q, MakePayload(pair_size(me, q), Seed(round, me, 48 + q)));
    from.push_back(q);
  }
  SP_ASSIGN_OR_RETURN(auto from_peers, comm.ExchangeWithPeers(std::move(sends), from));
  mismatch.Check(from_peers.size() == from.size(), "ExchangeWithPeers", -1, -1);
  for (size_t i = 0; i < std::min(from.size(), from_peers.size()); ++i) {
    const int s = from[i];
    mismatch.Check(MatchesPayload(from_peers[i], pair_size(s, me), Seed(round, s, 48 + me)),
                   "ExchangeWithPeers", -1, s);
  }
  // AnyRank: nobody, then each rank in turn alone, then everybody.
  for (int flagged = -1; flagged <= n; ++flagged) {
    SP_ASSIGN_OR_RETURN(bool any, comm.AnyRank(flagged == n || flagged == me));
    mismatch.Check(any == (flagged >= 0), "AnyRank", -1, flagged);
  }
  SP_RETURN_IF_ERROR(comm.Barrier());
  return mismatch.status();
}

}  // namespace sp::testing

#endif  // SHARDPOINT_COMM_COMM_TEST_UTIL_H_
