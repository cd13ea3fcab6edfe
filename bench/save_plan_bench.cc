// Repeated saves at MPI rank counts: the time from the call to the start of writing (the plan:
// local plans, gather, global plan, scatter; SaveStats::plan_seconds) of the first save and of the
// later ones, with a SavePlanCache (later saves take the cached plan) and without (every save
// plans), in the same run.
//
//   mpirun -np 256 --oversubscribe build/bench/save_plan_bench [--tensors 300] [--saves 6] [--dir D]
//       [--keep-file-above BYTES]
//
// Each rank holds --tensors tensors of a training job's kinds, in turn: row blocks of a matrix
// sharded over every rank (FSDP), blocks of a matrix sharded over groups of 8 ranks and
// replicated across the groups (TP x DP: one copy of each block is written, its owner chosen by
// the plan), and small replicated vectors (written once). Each save goes to a new directory, as a
// training job's steps do; the previous one is removed after it. Rank 0 prints, per way, every
// save's plan and total times (the slowest rank's), and the median of the later saves against the
// first. A third way saves without a cache from tensors that carry their layout rules
// (SaveTensor::layout): each rank then sends the coordinator a digest and its objects, and rank 0
// the names, shapes and rules once (plan/ruled_plan.h). Each way also prints rank 0's resident
// set after its last save, while its cache (when it has one) still holds the plan, and its peak
// during the way's saves; and its heap in use before the first save and after the last, whose
// difference is what the cache holds (the resident set keeps freed memory and cannot show it),
// and what the cache says it holds of the plan (SavePlanCache::plan_bytes). `--keep-file-above`
// makes the cache with that threshold (SavePlanCache's keep_file_above_bytes; 0: every plan is
// kept as its committed file between saves).
#include <malloc.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/mpi_comm.h"

namespace sp {
namespace {

constexpr int64_t kCols = 16;

using bench::Median;  // 0 for no values (a step left out)

double MaxOverRanks(double x) {
  double max = 0;
  MPI_Allreduce(&x, &max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return max;
}

struct RankState {
  std::vector<std::vector<float>> buffers;
  SaveState state;
};

// With `rules`, every tensor also carries the device-mesh rule of its layout (SaveTensor::layout),
// so that the ranks send rules instead of boxes.
RankState MakeState(int rank, int world, int tensors, bool rules) {
  RankState out;
  out.buffers.resize(static_cast<size_t>(tensors));
  const int tp = world % 8 == 0 ? 8 : 1;
  const int64_t n = world;
  for (int i = 0; i < tensors; ++i) {
    SaveTensor t;
    t.name = "layers." + std::to_string(i / 3) + ".p" + std::to_string(i % 3);
    t.dtype = DType::kFloat32;
    Box box;
    MeshLayout layout;
    switch (i % 3) {
      case 0:  // rows over every rank
        t.shape = {4 * static_cast<int64_t>(world), kCols};
        box = Box{{4 * static_cast<int64_t>(rank), 0}, {4, kCols}};
        layout = MeshLayout{{n}, {Placement::Shard(0)}, {}};
        break;
      case 1:  // blocks over tp ranks, replicated over world / tp
        t.shape = {8 * static_cast<int64_t>(tp), kCols};
        box = Box{{8 * static_cast<int64_t>(rank % tp), 0}, {8, kCols}};
        layout = MeshLayout{{n / tp, tp}, {Placement::Replicate(), Placement::Shard(0)}, {}};
        break;
      default:  // replicated
        t.shape = {kCols};
        box = Box{{0}, {kCols}};
        layout = MeshLayout{{n}, {Placement::Replicate()}, {}};
        break;
    }
    if (rules) t.layout = std::move(layout);
    std::vector<float>& data = out.buffers[static_cast<size_t>(i)];
    data.assign(static_cast<size_t>(box.volume()), static_cast<float>(rank + i));
    t.pieces.push_back(ConstPieceView{std::move(box), reinterpret_cast<const std::byte*>(data.data())});
    out.state.tensors.push_back(std::move(t));
  }
  out.state.objects.push_back(ObjectEntry{"step", ObjectEncoding::kJson, "0"});
  return out;
}

struct Way {
  std::vector<double> plan;   // per save, the slowest rank's
  std::vector<double> total;
  int cached = 0;             // saves in which every rank took the cached plan
  double coordinator_mib = 0; // rank 0's resident set after the last save (its cache still held)
  double start_mib = 0;       // rank 0's resident set before the first save
  double peak_mib = 0;        // rank 0's peak resident set from the first save to the last
  // Rank 0's heap in use (allocated and not freed) before the first save and after the last: the
  // difference is what the saves left allocated, the cache's plan when there is one. The resident
  // set cannot tell: freed heap memory stays resident for the next allocations.
  double start_heap_mib = 0;
  double heap_mib = 0;
  double cache_plan_mib = -1;  // with a cache: SavePlanCache::plan_bytes() after the last save
};

// This process's heap in use, in MiB (mallinfo2: small blocks and mapped ones).
double HeapInUseMiB() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<double>(info.uordblks + info.hblkhd) / (1 << 20);
}

// This process's resident set in MiB (`field` VmRSS of /proc/self/status; VmHWM: its peak), or
// -1.
double ResidentMiB(const char* field = "VmRSS:") {
  std::FILE* status = std::fopen("/proc/self/status", "r");
  if (status == nullptr) return -1;
  char line[256];
  double kib = -1;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof(line), status) != nullptr) {
    if (std::strncmp(line, field, n) == 0) kib = std::atof(line + n);
  }
  std::fclose(status);
  return kib / 1024.0;
}

// Resets this process's peak resident set (VmHWM) to its current one.
void ResetPeak() {
  std::FILE* clear = std::fopen("/proc/self/clear_refs", "w");
  if (clear == nullptr) return;
  std::fputs("5", clear);
  std::fclose(clear);
}

Way Run(Communicator& comm, RankState& rank, const std::string& dir, int saves, bool cache_plans,
        uint64_t keep_file_above = SavePlanCache::kDefaultKeepFileAboveBytes) {
  Way way;
  SavePlanCache cache(keep_file_above);
  ResetPeak();
  way.start_mib = ResidentMiB();
  way.start_heap_mib = HeapInUseMiB();
  for (int s = 0; s < saves; ++s) {
    rank.state.objects[0].payload = std::to_string(s);
    const std::string path = dir + "/step" + std::to_string(s);
    SaveStats stats;
    SaveOptions options;
    options.comm = &comm;
    options.stats = &stats;
    options.threads = 1;
    if (cache_plans) options.plan_cache = &cache;
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    const Status saved = Save(rank.state, path, options);
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!saved.ok()) {
      std::fprintf(stderr, "rank %d: save %d failed: %s\n", comm.rank(), s, saved.ToString().c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    way.plan.push_back(MaxOverRanks(stats.plan_seconds));
    way.total.push_back(MaxOverRanks(total));
    int all = stats.plan_cached ? 1 : 0, every = 0;
    MPI_Allreduce(&all, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    way.cached += every;
    MPI_Barrier(MPI_COMM_WORLD);
    if (comm.rank() == 0 && s > 0) {
      std::filesystem::remove_all(dir + "/step" + std::to_string(s - 1));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
  way.coordinator_mib = ResidentMiB();
  way.peak_mib = ResidentMiB("VmHWM:");
  way.heap_mib = HeapInUseMiB();
  if (cache_plans) way.cache_plan_mib = static_cast<double>(cache.plan_bytes()) / (1 << 20);
  return way;
}

void Print(const char* name, const Way& way) {
  std::printf("%s: %d of %zu saves took the cached plan\n", name, way.cached, way.plan.size());
  for (size_t s = 0; s < way.plan.size(); ++s) {
    std::printf("  save %zu  plan %8.4f s  total %8.4f s\n", s + 1, way.plan[s], way.total[s]);
  }
  std::vector<double> later_plan(way.plan.begin() + 1, way.plan.end());
  std::vector<double> later_total(way.total.begin() + 1, way.total.end());
  std::printf("  later saves (median): plan %.4f s, the first %.4f s (first / later = %.1fx); "
              "total %.4f s, the first %.4f s\n",
              Median(later_plan), way.plan[0], way.plan[0] / std::max(Median(later_plan), 1e-9),
              Median(later_total), way.total[0]);
  std::printf("  coordinator (rank 0) resident after the last save: %.1f MiB; peak during the "
              "saves %.1f MiB (%.1f MiB before the first)\n",
              way.coordinator_mib, way.peak_mib, way.start_mib);
  std::printf("  coordinator (rank 0) heap in use after the last save: %.1f MiB (%.1f MiB before "
              "the first): %.1f MiB left allocated\n",
              way.heap_mib, way.start_heap_mib, way.heap_mib - way.start_heap_mib);
  if (way.cache_plan_mib >= 0) {
    std::printf("  the cache's plan on rank 0 between saves (SavePlanCache::plan_bytes): "
                "%.1f MiB\n",
                way.cache_plan_mib);
  }
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int tensors = 300, saves = 6;
  uint64_t keep_file_above = sp::SavePlanCache::kDefaultKeepFileAboveBytes;
  std::string dir = "/tmp/shardpoint-save-plan-bench";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tensors") tensors = std::stoi(argv[i + 1]);
    else if (a == "--saves") saves = std::stoi(argv[i + 1]);
    else if (a == "--dir") dir = argv[i + 1];
    else if (a == "--keep-file-above") keep_file_above = std::stoull(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: save_plan_bench [--tensors N] [--saves K] [--dir DIR] "
                           "[--keep-file-above BYTES]\n");
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  if (saves < 2) saves = 2;
  sp::Result<std::unique_ptr<sp::MpiComm>> made = sp::MpiComm::Create(MPI_COMM_WORLD);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  sp::MpiComm& comm = **made;
  sp::RankState rank = sp::MakeState(comm.rank(), comm.size(), tensors, false);
  sp::RankState ruled = sp::MakeState(comm.rank(), comm.size(), tensors, true);
  if (comm.rank() == 0) {
    std::printf("%d MPI ranks x %d tensors each, %d saves per way\n", comm.size(), tensors, saves);
  }
  // Alternating which way runs first would need more saves; the uncached way runs first so that
  // the file system's state favours it if anything.
  const sp::Way plain = sp::Run(comm, rank, dir + "/plain", saves, false);
  const sp::Way cached = sp::Run(comm, rank, dir + "/cached", saves, true, keep_file_above);
  const sp::Way rules = sp::Run(comm, ruled, dir + "/rules", saves, false);
  if (comm.rank() == 0) {
    sp::Print("without a plan cache", plain);
    sp::Print("with a plan cache", cached);
    sp::Print("without a plan cache, the tensors' layout rules sent instead of their boxes", rules);
    std::printf("every save planned, plan (median of all): %.4f s with rules against %.4f s with "
                "boxes = %.2fx\n",
                sp::Median(rules.plan), sp::Median(plain.plan),
                sp::Median(plain.plan) / std::max(sp::Median(rules.plan), 1e-9));
    std::vector<double> plain_later(plain.plan.begin() + 1, plain.plan.end());
    std::vector<double> cached_later(cached.plan.begin() + 1, cached.plan.end());
    std::printf("later saves, plan: %.4f s cached against %.4f s planned again = %.1fx\n",
                sp::Median(cached_later), sp::Median(plain_later),
                sp::Median(plain_later) / std::max(sp::Median(cached_later), 1e-9));
  }
  made->reset();
  MPI_Finalize();
  return 0;
}
