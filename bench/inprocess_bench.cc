// Loads by many in-process ranks: N threads of one process (ThreadComm, as the C++ API and the
// command line run ranks) load a checkpoint in another layout than it was saved in, against one
// copy of the same bytes in memory, in the same run.
//
//   ./build/bench/inprocess_bench [--ranks 1024] [--tensors 20] [--runs 5]
//
// The state: --tensors tensors of [4 x ranks, 128] float32, saved as row blocks of 4 rows, one per
// rank, into an in-memory store (so that the figures are the engine's, not a disk's). The load: a
// TP x DP grid (TP 8): rank r takes 16 columns (those of TP rank r % 8) of the rows of DP group
// r / 8, so every stored block is needed by 8 ranks and read once for them (shared reads between
// threads: engine/read_exchange.h, AssignInMemoryReads). Each run loads on fresh threads and
// checks every loaded value; rank 0 prints the median over --runs runs of the load's time (from
// the ranks' start, after a barrier, to the last rank's return), the bytes read, and the time of
// one memcpy of the state's bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

constexpr int64_t kBlockRows = 4;
constexpr int64_t kCols = 128;
constexpr int kTp = 8;
constexpr int64_t kTpCols = kCols / kTp;

using Clock = std::chrono::steady_clock;

using bench::Median;

// The value every element (row, col) of tensor t holds.
float ValueAt(int t, int64_t row, int64_t col) {
  return static_cast<float>(t * 1000003 + row * kCols + col);
}

// Runs fn(rank, comm) on `ranks` fresh threads of one ThreadCommGroup; the first error, if any.
Status OnRanks(int ranks, const std::function<Status(int, Communicator&)>& fn) {
  ThreadCommOptions options;
  options.timeout = std::chrono::seconds(600);
  ThreadCommGroup group(ranks, options);
  std::vector<Status> statuses(ranks);
  std::vector<std::thread> threads;
  threads.reserve(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { statuses[r] = fn(r, group.comm(r)); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

int Main(int argc, char** argv) {
  int ranks = 1024, tensors = 20, runs = 5;
  if (!bench::ParseIntFlags(argc, argv,
                            {{"--ranks", &ranks}, {"--tensors", &tensors}, {"--runs", &runs}},
                            "inprocess_bench [--ranks N] [--tensors N] [--runs N]")) {
    return 2;
  }
  if (ranks < kTp || ranks % kTp != 0 || tensors < 1 || runs < 1) {
    std::fprintf(stderr, "inprocess_bench: --ranks must be a multiple of %d\n", kTp);
    return 2;
  }
  const int64_t rows = kBlockRows * ranks;
  const std::string path = "/bench";
  MemoryStore store;
  ThreadPool pool(4);

  // Save: rank r writes rows [4r, 4r + 4) of every tensor.
  Status saved = OnRanks(ranks, [&](int r, Communicator& comm) -> Status {
    std::vector<std::vector<float>> data(tensors);
    SaveState state;
    for (int t = 0; t < tensors; ++t) {
      for (int64_t row = kBlockRows * r; row < kBlockRows * (r + 1); ++row) {
        for (int64_t col = 0; col < kCols; ++col) data[t].push_back(ValueAt(t, row, col));
      }
      SaveTensor tensor;
      tensor.name = "t" + std::to_string(t);
      tensor.dtype = DType::kFloat32;
      tensor.shape = {rows, kCols};
      tensor.pieces.push_back(ConstPieceView{Box({kBlockRows * r, 0}, {kBlockRows, kCols}),
                                             reinterpret_cast<const std::byte*>(data[t].data())});
      state.tensors.push_back(std::move(tensor));
    }
    SaveOptions options;
    options.comm = &comm;
    options.store = &store;
    options.pool = &pool;
    return Save(state, path, options);
  });
  if (!saved.ok()) {
    std::fprintf(stderr, "inprocess_bench: save: %s\n", saved.ToString().c_str());
    return 1;
  }

  const int groups = ranks / kTp;
  const int64_t group_rows = rows / groups;
  const uint64_t state_bytes = static_cast<uint64_t>(rows * kCols) * 4 * tensors;
  std::vector<double> load_seconds, copy_seconds;
  uint64_t bytes_read = 0;
  for (int run = 0; run < runs; ++run) {
    std::vector<Clock::time_point> start(ranks), end(ranks);
    std::vector<uint64_t> read(ranks, 0);
    Status loaded = OnRanks(ranks, [&](int r, Communicator& comm) -> Status {
      const Box box({group_rows * (r / kTp), kTpCols * (r % kTp)}, {group_rows, kTpCols});
      std::vector<std::vector<float>> data(tensors,
                                           std::vector<float>(static_cast<size_t>(box.volume())));
      LoadState state;
      for (int t = 0; t < tensors; ++t) {
        LoadTensor tensor;
        tensor.name = "t" + std::to_string(t);
        tensor.dtype = DType::kFloat32;
        tensor.shape = {rows, kCols};
        tensor.pieces.push_back(
            PieceView{box, reinterpret_cast<std::byte*>(data[t].data())});
        state.tensors.push_back(std::move(tensor));
      }
      LoadOptions options;
      options.comm = &comm;
      options.store = &store;
      options.pool = &pool;
      SP_RETURN_IF_ERROR(comm.Barrier());
      start[r] = Clock::now();
      SP_ASSIGN_OR_RETURN(LoadResult result, Load(state, path, options));
      end[r] = Clock::now();
      read[r] = result.bytes_read;
      for (int t = 0; t < tensors; ++t) {
        size_t k = 0;
        for (int64_t row = box.offsets[0]; row < box.exclusive_max(0); ++row) {
          for (int64_t col = box.offsets[1]; col < box.exclusive_max(1); ++col, ++k) {
            if (data[t][k] != ValueAt(t, row, col)) {
              return DataLossError("rank " + std::to_string(r) + " tensor t" +
                                   std::to_string(t) + " holds a wrong value at (" +
                                   std::to_string(row) + ", " + std::to_string(col) + ")");
            }
          }
        }
      }
      return OkStatus();
    });
    if (!loaded.ok()) {
      std::fprintf(stderr, "inprocess_bench: load: %s\n", loaded.ToString().c_str());
      return 1;
    }
    load_seconds.push_back(
        std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) -
                                      *std::min_element(start.begin(), start.end()))
            .count());
    bytes_read = 0;
    for (uint64_t b : read) bytes_read += b;

    // The baseline: one copy of the state's bytes.
    std::vector<char> from(state_bytes, 1), to(state_bytes, 0);
    const auto copy_start = Clock::now();
    std::memcpy(to.data(), from.data(), state_bytes);
    copy_seconds.push_back(std::chrono::duration<double>(Clock::now() - copy_start).count());
    if (to[state_bytes / 2] != 1) return 1;
  }
  std::printf("%d in-process ranks, %d tensors of [%lld, %lld] float32 (%.1f MiB), TP %d x DP %d;"
              " median of %d runs\n",
              ranks, tensors, static_cast<long long>(rows), static_cast<long long>(kCols),
              static_cast<double>(state_bytes) / (1 << 20), kTp, groups, runs);
  std::printf("  load          %8.4f s   (%.1f MiB read by all ranks)\n", Median(load_seconds),
              static_cast<double>(bytes_read) / (1 << 20));
  std::printf("  memcpy        %8.4f s   (the state's bytes, once)\n", Median(copy_seconds));
  return 0;
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) { return sp::Main(argc, argv); }
