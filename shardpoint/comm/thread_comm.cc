#include "shardpoint/comm/thread_comm.h"

#include <cassert>
#include <exception>
#include <thread>
#include <utility>

namespace sp {

// The k-th collective of every rank. Created by the first rank to arrive; erased when every rank
// has either exited it or left the group without arriving.
struct ThreadCommGroup::Round {
  enum class State { kAbsent, kArrived, kExited };

  explicit Round(int size) : state(size, State::kAbsent), calls(size) {}

  std::vector<State> state;
  std::vector<Call> calls;
  int arrived = 0;
  int departed = 0;       // ranks done reading the other ranks' buffers
  bool complete = false;  // every rank arrived and the call is valid
  Status error;           // set at most once; then the round has failed on every rank
};

class ThreadCommGroup::Comm final : public Communicator {
 public:
  Comm(ThreadCommGroup* group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }
  bool shares_memory() const override { return true; }

  Result<std::vector<std::string>> Gather(std::string payload, int root) override {
    std::vector<std::string> gathered;
    SP_RETURN_IF_ERROR(group_->Run(rank_, Call{Op::kGather, root, &payload, nullptr},
                                   Outputs{&gathered, nullptr}));
    return gathered;
  }

  Result<std::string> Scatter(std::vector<std::string> payloads, int root) override {
    std::string mine;
    SP_RETURN_IF_ERROR(
        group_->Run(rank_, Call{Op::kScatter, root, nullptr, &payloads}, Outputs{nullptr, &mine}));
    return mine;
  }

  Result<std::string> Broadcast(std::string payload, int root) override {
    std::string value;
    SP_RETURN_IF_ERROR(group_->Run(rank_, Call{Op::kBroadcast, root, &payload, nullptr},
                                   Outputs{nullptr, &value}));
    return value;
  }

  Result<std::vector<std::string>> AllGather(std::string payload) override {
    std::vector<std::string> gathered;
    SP_RETURN_IF_ERROR(group_->Run(rank_, Call{Op::kAllGather, 0, &payload, nullptr},
                                   Outputs{&gathered, nullptr}));
    return gathered;
  }

  Status Barrier() override { return group_->Run(rank_, Call{Op::kBarrier}, Outputs{}); }

  Result<std::vector<std::string>> AllToAll(std::vector<std::string> payloads) override {
    std::vector<std::string> received;
    SP_RETURN_IF_ERROR(group_->Run(rank_, Call{Op::kAllToAll, 0, nullptr, &payloads},
                                   Outputs{&received, nullptr}));
    return received;
  }

 private:
  ThreadCommGroup* group_;
  int rank_;
};

ThreadCommGroup::ThreadCommGroup(int size, ThreadCommOptions options)
    : size_(size), options_(options), left_(size, false), next_generation_(size, 0) {
  assert(size >= 1);
  comms_.reserve(size);
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<Comm>(this, r));
}

ThreadCommGroup::~ThreadCommGroup() = default;

Communicator& ThreadCommGroup::comm(int rank) {
  assert(rank >= 0 && rank < size_);
  return *comms_[rank];
}

const char* ThreadCommGroup::OpName(Op op) {
  switch (op) {
    case Op::kGather:
      return "Gather";
    case Op::kScatter:
      return "Scatter";
    case Op::kBroadcast:
      return "Broadcast";
    case Op::kAllGather:
      return "AllGather";
    case Op::kBarrier:
      return "Barrier";
    case Op::kAllToAll:
      return "AllToAll";
  }
  return "unknown collective";
}

void ThreadCommGroup::Leave(int rank) {
  assert(rank >= 0 && rank < size_);
  std::lock_guard<std::mutex> lock(mu_);
  if (left_[rank]) return;
  left_[rank] = true;
  for (auto it = rounds_.begin(); it != rounds_.end();) {
    Round& round = *it->second;
    if (round.state[rank] == Round::State::kAbsent && !round.complete && round.error.ok()) {
      FailRound(round, LeftError(round));
    }
    it = Finished(round) ? rounds_.erase(it) : std::next(it);
  }
}

Status ThreadCommGroup::Run(int rank, const Call& call, const Outputs& out) {
  uint64_t generation = 0;
  Round* round = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (left_[rank]) {
      return FailedPreconditionError("rank " + std::to_string(rank) + " called " + OpName(call.op) +
                                     " after leaving the communicator group");
    }
    generation = next_generation_[rank]++;
    round = &Arrive(rank, call, generation);
    Status status = AwaitArrivals(lock, *round, generation);
    if (!status.ok() || call.op == Op::kBarrier) {
      Exit(rank, generation, *round);
      return status;
    }
  }
  Extract(rank, *round, out);
  {
    std::unique_lock<std::mutex> lock(mu_);
    ++round->departed;
    cv_.notify_all();
    // The other ranks may still be reading this rank's buffers; keep them alive until done.
    cv_.wait(lock, [&] { return round->departed == size_; });
    Finalize(rank, *round, out);
    Exit(rank, generation, *round);
  }
  return OkStatus();
}

ThreadCommGroup::Round& ThreadCommGroup::Arrive(int rank, const Call& call, uint64_t generation) {
  std::unique_ptr<Round>& slot = rounds_[generation];
  if (slot == nullptr) slot = std::make_unique<Round>(size_);
  Round& round = *slot;
  round.calls[rank] = call;
  round.state[rank] = Round::State::kArrived;
  ++round.arrived;
  if (!round.error.ok()) return round;
  if (round.arrived == size_) {
    Status status = Validate(round);
    if (status.ok()) {
      round.complete = true;
      cv_.notify_all();
    } else {
      FailRound(round, std::move(status));
    }
  } else if (Status status = LeftError(round); !status.ok()) {
    FailRound(round, std::move(status));
  }
  return round;
}

Status ThreadCommGroup::AwaitArrivals(std::unique_lock<std::mutex>& lock, Round& round,
                                      uint64_t generation) {
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  auto settled = [&] { return round.complete || !round.error.ok(); };
  if (!cv_.wait_until(lock, deadline, settled)) {
    FailRound(round, TimeoutError(round, generation));
  }
  return round.error;
}

void ThreadCommGroup::Extract(int rank, const Round& round, const Outputs& out) {
  const Call& mine = round.calls[rank];
  const int size = static_cast<int>(round.calls.size());
  switch (mine.op) {
    case Op::kGather:
      if (rank != mine.root) return;
      out.gathered->resize(size);
      for (int r = 0; r < size; ++r) (*out.gathered)[r] = std::move(*round.calls[r].payload);
      return;
    case Op::kScatter:
      *out.single = std::move((*round.calls[mine.root].payloads)[rank]);
      return;
    case Op::kBroadcast:
      if (rank != mine.root) *out.single = *round.calls[mine.root].payload;
      return;
    case Op::kAllGather:
      out.gathered->resize(size);
      for (int r = 0; r < size; ++r) {
        if (r != rank) (*out.gathered)[r] = *round.calls[r].payload;
      }
      return;
    case Op::kAllToAll:
      out.gathered->resize(size);
      for (int r = 0; r < size; ++r) (*out.gathered)[r] = std::move((*round.calls[r].payloads)[rank]);
      return;
    case Op::kBarrier:
      return;
  }
}

void ThreadCommGroup::Finalize(int rank, const Round& round, const Outputs& out) {
  const Call& mine = round.calls[rank];
  if (mine.op == Op::kBroadcast && rank == mine.root) *out.single = std::move(*mine.payload);
  if (mine.op == Op::kAllGather) (*out.gathered)[rank] = std::move(*mine.payload);
}

void ThreadCommGroup::Exit(int rank, uint64_t generation, Round& round) {
  round.state[rank] = Round::State::kExited;
  if (Finished(round)) rounds_.erase(generation);
}

bool ThreadCommGroup::Finished(const Round& round) const {
  for (int r = 0; r < size_; ++r) {
    const bool gone = round.state[r] == Round::State::kAbsent && left_[r];
    if (round.state[r] != Round::State::kExited && !gone) return false;
  }
  return true;
}

void ThreadCommGroup::FailRound(Round& round, Status status) {
  round.error = std::move(status);
  cv_.notify_all();
}

Status ThreadCommGroup::Validate(const Round& round) const {
  const Call& first = round.calls[0];
  const bool rooted =
      first.op != Op::kAllGather && first.op != Op::kBarrier && first.op != Op::kAllToAll;
  for (int r = 1; r < size_; ++r) {
    const Call& other = round.calls[r];
    if (other.op != first.op) {
      return InternalError(std::string("collective mismatch: rank 0 called ") + OpName(first.op) +
                           ", rank " + std::to_string(r) + " called " + OpName(other.op));
    }
    if (rooted && other.root != first.root) {
      return InternalError(std::string("collective mismatch: rank 0 called ") + OpName(first.op) +
                           " with root " + std::to_string(first.root) + ", rank " +
                           std::to_string(r) + " called it with root " +
                           std::to_string(other.root));
    }
  }
  if (rooted && (first.root < 0 || first.root >= size_)) {
    return InvalidArgumentError(std::string(OpName(first.op)) + ": root " +
                                std::to_string(first.root) + " is out of range for a group of " +
                                std::to_string(size_) + " ranks");
  }
  if (first.op == Op::kScatter && round.calls[first.root].payloads->size() != size_t(size_)) {
    return InvalidArgumentError("Scatter: root " + std::to_string(first.root) + " passed " +
                                std::to_string(round.calls[first.root].payloads->size()) +
                                " payloads, expected one per rank (" + std::to_string(size_) + ")");
  }
  for (int r = 0; first.op == Op::kAllToAll && r < size_; ++r) {
    if (round.calls[r].payloads->size() != size_t(size_)) {
      return InvalidArgumentError("AllToAll: rank " + std::to_string(r) + " passed " +
                                  std::to_string(round.calls[r].payloads->size()) +
                                  " payloads, expected one per rank (" + std::to_string(size_) +
                                  ")");
    }
  }
  return OkStatus();
}

ThreadCommGroup::Op ThreadCommGroup::FirstArrivedOp(const Round& round) const {
  for (int r = 0; r < size_; ++r) {
    if (round.state[r] != Round::State::kAbsent) return round.calls[r].op;
  }
  return Op::kBarrier;
}

Status ThreadCommGroup::LeftError(const Round& round) const {
  const Op op = FirstArrivedOp(round);
  for (int r = 0; r < size_; ++r) {
    if (round.state[r] == Round::State::kAbsent && left_[r]) {
      return AbortedError("rank " + std::to_string(r) + " left the communicator group during " +
                          OpName(op));
    }
  }
  return OkStatus();
}

Status ThreadCommGroup::TimeoutError(const Round& round, uint64_t generation) const {
  std::string missing;
  int count = 0;
  for (int r = 0; r < size_; ++r) {
    if (round.state[r] != Round::State::kAbsent) continue;
    missing += (count++ == 0 ? "" : ", ") + std::to_string(r);
  }
  return DeadlineExceededError(
      std::string(OpName(FirstArrivedOp(round))) + " (collective #" + std::to_string(generation) +
      ") timed out after " + std::to_string(options_.timeout.count()) + " ms waiting for " +
      (count == 1 ? "rank " : "ranks ") + missing + ", which never arrived");
}

std::vector<Status> RunRanks(int n, const std::function<Status(Communicator&)>& fn,
                             ThreadCommOptions options) {
  std::vector<Status> statuses(n > 0 ? n : 0);
  if (n <= 0) return statuses;
  ThreadCommGroup group(n, options);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&group, &fn, &statuses, r] {
      Status status;
      try {
        status = fn(group.comm(r));
      } catch (const std::exception& e) {
        status = InternalError("rank " + std::to_string(r) + " threw an exception: " + e.what());
      } catch (...) {
        status = InternalError("rank " + std::to_string(r) +
                               " threw an exception that is not a std::exception");
      }
      group.Leave(r);
      statuses[r] = std::move(status);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

}  // namespace sp
