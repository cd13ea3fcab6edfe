// A load that shares its reads between machines, at MPI rank counts: the ranks save --mib MiB as
// row blocks (one per rank in each of --tensors tensors of 16 KiB rows), then load every tensor
// as column blocks, each rank 1/N of the columns, while the communicator says that each rank runs
// on a machine of its own: one rank reads each stored chunk and sends the others their columns,
// round by round (engine/read_exchange.h). Timed in the same run, in turn, median of --runs (the
// slowest rank's time):
//   raw read             every rank reads its own data file whole with pread, 16 MiB at a time:
//                        the bytes a shared load reads in all, each once
//   shared, peers        the load (now): each round one flag, then messages between peers alone
//   shared, all-to-all   the same load with each round's exchange an all-to-all of the group
//                        (Communicator's default ExchangeWithPeers over MpiComm::AllToAll: the
//                        rounds before)
//   own reads            share_reads=false: every rank reads the rows of every chunk itself
// and the bytes all ranks read from storage. Every load's values are checked. The files are in
// the page cache (just written): this measures the engine and the exchange, not the disk.
//
//   mpirun -np 4 --oversubscribe build/bench/shared_load_bench [--mib 256] [--tensors 2] [--runs 5]
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/mpi_bench.h"
#include "shardpoint/base/random_id.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/mpi_comm.h"

namespace sp {
namespace {

constexpr int64_t kCols = 4096;  // float32: 16 KiB rows

using bench::Median;

// Rounds through an all-to-all of the group (the default ExchangeWithPeers), over ranks that say
// they run on machines of their own (testing::AcrossMachinesComm).
class AllToAllRounds final : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  Result<std::vector<std::string>> ExchangeWithPeers(std::vector<std::pair<int, std::string>> p,
                                                     const std::vector<int>& from) override {
    return Communicator::ExchangeWithPeers(std::move(p), from);
  }
};

float Value(int tensor, int64_t row, int64_t col) {
  return static_cast<float>((tensor * 7919 + row * 31 + col) % 1000003);
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "shared_load_bench: %s\n", what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

double Slowest(double seconds) {
  double out = 0;
  MPI_Allreduce(&seconds, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

unsigned long long Sum(unsigned long long mine) {
  unsigned long long out = 0;
  MPI_Allreduce(&mine, &out, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

int Main(int argc, char** argv) {
  int mib = 256, tensors = 2, runs = 5;
  if (!bench::ParseIntFlags(argc, argv,
                            {{"--mib", &mib}, {"--tensors", &tensors}, {"--runs", &runs}},
                            "shared_load_bench [--mib N] [--tensors N] [--runs N]")) {
    return 2;
  }
  const std::unique_ptr<MpiComm> world = bench::WorldComm("shared_load_bench");
  if (world == nullptr) return 1;
  const int rank = world->rank(), n = world->size();
  const int64_t rows = std::max<int64_t>(
      1, (static_cast<int64_t>(mib) << 20) / (static_cast<int64_t>(n) * tensors * kCols * 4));
  if (kCols % n != 0 || tensors < 1) {
    if (rank == 0) std::fprintf(stderr, "shared_load_bench: the ranks must divide %lld\n",
                                static_cast<long long>(kCols));
    return 2;
  }
  const int64_t cols = kCols / n;

  char dir[256] = {};
  if (rank == 0) {
    std::snprintf(dir, sizeof(dir), "%s/sp-shared-load-bench-%s",
                  std::filesystem::temp_directory_path().c_str(), RandomHexId(12).c_str());
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string path = std::string(dir) + "/ckpt";

  // The save: rank r holds rows [r x rows, (r + 1) x rows) of every tensor.
  std::vector<std::vector<float>> held(tensors);
  SaveState save_state;
  for (int t = 0; t < tensors; ++t) {
    held[t].resize(static_cast<size_t>(rows * kCols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        held[t][static_cast<size_t>(r * kCols + c)] = Value(t, rank * rows + r, c);
      }
    }
    save_state.tensors.push_back(SaveTensor{
        "t" + std::to_string(t), DType::kFloat32, {n * rows, kCols},
        {ConstPieceView{Box{{rank * rows, 0}, {rows, kCols}},
                        reinterpret_cast<const std::byte*>(held[t].data())}}});
  }
  SaveOptions save_options;
  save_options.comm = world.get();
  if (Status saved = Save(save_state, path, save_options); !saved.ok()) Fail(saved.ToString());
  held.clear();

  // This rank's data files: the raw read's share.
  std::vector<std::string> mine;
  char tag[32];
  std::snprintf(tag, sizeof(tag), "-r%05d-", rank);
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    if (entry.path().filename().string().find(tag) != std::string::npos) {
      mine.push_back(entry.path().string());
    }
  }
  std::vector<char> buffer(size_t{16} << 20);
  auto raw_read = [&]() -> unsigned long long {
    unsigned long long bytes = 0;
    for (const std::string& file : mine) {
      const int fd = ::open(file.c_str(), O_RDONLY);
      if (fd < 0) Fail("open " + file + ": " + std::strerror(errno));
      for (;;) {
        const ssize_t got = ::pread(fd, buffer.data(), buffer.size(), static_cast<off_t>(bytes));
        if (got < 0) Fail("read " + file + ": " + std::strerror(errno));
        if (got == 0) break;
        bytes += static_cast<unsigned long long>(got);
      }
      ::close(fd);
    }
    return bytes;
  };

  std::vector<std::vector<float>> out(tensors);
  for (auto& o : out) o.resize(static_cast<size_t>(n * rows * cols));
  testing::AcrossMachinesComm peers(*world);
  testing::AcrossMachinesComm apart(*world);
  AllToAllRounds all_to_all(apart);
  auto load = [&](Communicator& via, bool share) -> uint64_t {
    LoadState state;
    for (int t = 0; t < tensors; ++t) {
      std::fill(out[t].begin(), out[t].end(), -1.0f);
      state.tensors.push_back(LoadTensor{
          "t" + std::to_string(t), DType::kFloat32, {n * rows, kCols},
          {PieceView{Box{{0, rank * cols}, {n * rows, cols}},
                     reinterpret_cast<std::byte*>(out[t].data())}}});
    }
    LoadOptions options;
    options.comm = &via;
    options.share_reads = share;
    Result<LoadResult> loaded = Load(state, path, options);
    if (!loaded.ok()) Fail(loaded.status().ToString());
    return loaded->bytes_read;
  };
  auto check = [&](const char* what) {
    for (int t = 0; t < tensors; ++t) {
      for (int64_t r = 0; r < n * rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          if (out[t][static_cast<size_t>(r * cols + c)] != Value(t, r, rank * cols + c)) {
            Fail(std::string(what) + ": rank " + std::to_string(rank) + " loaded a wrong value");
          }
        }
      }
    }
  };

  enum Way { kRaw, kPeers, kAllToAll, kOwn, kWays };
  const char* names[kWays] = {"raw read of the files", "shared, rounds between peers (now)",
                              "shared, rounds as all-to-all (before)",
                              "own reads (share_reads=false)"};
  std::vector<double> seconds[kWays];
  unsigned long long bytes[kWays] = {};
  for (int run = 0; run < runs; ++run) {
    for (int way = 0; way < kWays; ++way) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = std::chrono::steady_clock::now();
      uint64_t read = 0;
      switch (way) {
        case kRaw: read = raw_read(); break;
        case kPeers: read = load(peers, true); break;
        case kAllToAll: read = load(all_to_all, true); break;
        default: read = load(*world, false); break;
      }
      seconds[way].push_back(Slowest(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
      bytes[way] = Sum(read);
      if (way != kRaw && run == 0) check(names[way]);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    std::filesystem::remove_all(dir);
    const double raw = Median(seconds[kRaw]);
    std::printf("%d ranks, %d tensors of [%lld, %lld] float32 (%d MiB) saved as row blocks, loaded "
                "as column blocks; median of %d runs (slowest rank), page cache warm\n",
                n, tensors, static_cast<long long>(n * rows), static_cast<long long>(kCols), mib,
                runs);
    std::printf("  %-40s %10s %14s %10s\n", "", "seconds", "bytes read", "vs raw");
    for (int way = 0; way < kWays; ++way) {
      std::printf("  %-40s %10.4f %14llu %9.2fx\n", names[way], Median(seconds[way]), bytes[way],
                  raw / Median(seconds[way]));
    }
  }
  return 0;
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) { return sp::bench::RunUnderMpi(argc, argv, sp::Main); }
