// shardpoint demo: the main job end to end. In-process ranks save a synthetic transformer state
// from a 2x2 (dp, tp) mesh, load it into 3 ranks laid out differently, and check every byte.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/testing/synthetic_model.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kDemoUsage[] =
    "usage: shardpoint demo [--dir DIR] [--mib N] [--threads T] [--keep]\n"
    "\n"
    "Saves a synthetic transformer-like state (bf16 weights, fp32 Adam moments; tensor-parallel,\n"
    "fully-sharded, replicated and uneven layouts on a 2x2 mesh) from 4 in-process ranks, loads it\n"
    "into 3 ranks with another layout, checks every byte and prints the figures.\n"
    "  --dir DIR     where to write the checkpoint (default: a fresh directory under /tmp)\n"
    "  --mib N       approximate state size in MiB (default 256)\n"
    "  --threads T   I/O threads shared by the ranks (default: max(4, cores))\n"
    "  --keep        keep the checkpoint afterwards\n";

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

Status FirstError(const std::vector<Status>& statuses) {
  for (const Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

void Row(const char* phase, int ranks, uint64_t bytes, size_t files, double secs) {
  std::printf("%-8s %5d  %12s  %5zu  %8.3f s  %6.2f GB/s\n", phase, ranks,
              HumanBytes(bytes).c_str(), files, secs, bytes / secs / 1e9);
}

}  // namespace

int DemoCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"keep", "help"}, {"dir", "mib", "threads"});
  if (!args.ok()) return UsageError("demo", args.status().message(), kDemoUsage);
  if (args->Has("help")) {
    std::cout << kDemoUsage;
    return kExitOk;
  }
  Result<int64_t> mib = ParseInt("mib", args->Get("mib", "256"), 1, int64_t{1} << 20);
  if (!mib.ok()) return UsageError("demo", mib.status().message(), kDemoUsage);
  Result<int64_t> threads = ParseInt("threads", args->Get("threads", "0"), 0, 1024);
  if (!threads.ok()) return UsageError("demo", threads.status().message(), kDemoUsage);
  std::string dir = args->Get("dir", "");
  bool remove_after = !args->Has("keep") && dir.empty();
  if (dir.empty()) {
    char tmpl[] = "/tmp/shardpoint-demo-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return Fail("demo", ErrnoToStatus(errno, "mkdtemp"));
    dir = std::string(tmpl) + "/checkpoint";
  }

  testing::GlobalModel model = testing::MakeGlobalModel(testing::ConfigForBytes(static_cast<uint64_t>(*mib) << 20), 7);
  Result<std::vector<testing::RankShards>> train =
      testing::ShardModel(model, testing::Which::kTrain, true);
  Result<std::vector<testing::RankShards>> serve =
      testing::ShardModel(model, testing::Which::kServe, false);
  if (!train.ok()) return Fail("demo", train.status());
  if (!serve.ok()) return Fail("demo", serve.status());
  ThreadPool pool(*threads > 0 ? static_cast<int>(*threads) : DefaultIoThreads());

  std::printf("shardpoint demo: %zu tensors (bf16 weights, fp32 Adam moments), %s\n",
              model.specs.size(), HumanBytes(model.total_bytes()).c_str());
  std::printf("  save: 4 ranks on a 2x2 (dp, tp) mesh; load: 3 ranks, other splits; %d I/O threads\n",
              pool.size());
  std::printf("  checkpoint: %s\n\n", dir.c_str());

  auto t0 = Clock::now();
  Status saved = FirstError(RunRanks(4, [&](Communicator& comm) {
    SaveOptions options;
    options.comm = &comm;
    options.pool = &pool;
    options.overwrite = true;
    return Save((*train)[comm.rank()].AsSaveState(model), dir, options);
  }));
  const double save_secs = Seconds(t0);
  if (!saved.ok()) return Fail("demo", saved.WithContext("save"));

  t0 = Clock::now();
  std::vector<uint64_t> bytes_read(3, 0);
  Status loaded = FirstError(RunRanks(3, [&](Communicator& comm) -> Status {
    LoadOptions options;
    options.comm = &comm;
    options.pool = &pool;
    SP_ASSIGN_OR_RETURN(LoadResult r, Load((*serve)[comm.rank()].AsLoadState(model), dir, options));
    bytes_read[comm.rank()] = r.bytes_read;
    if (r.objects.size() != 1 || r.objects[0].payload != "1200") {
      return DataLossError("object 'train.step' did not come back as 1200");
    }
    return OkStatus();
  }));
  const double load_secs = Seconds(t0);
  if (!loaded.ok()) return Fail("demo", loaded.WithContext("load"));

  t0 = Clock::now();
  Result<VerifyReport> verified = Verify(dir, nullptr, &pool);
  const double verify_secs = Seconds(t0);
  if (!verified.ok()) return Fail("demo", verified.status().WithContext("verify"));
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(dir);
  if (!md.ok()) return Fail("demo", md.status());

  std::string first;
  const int64_t mismatches = testing::CountMismatches(model, *serve, &first);
  uint64_t read_total = 0;
  for (uint64_t b : bytes_read) read_total += b;

  std::printf("%-8s %5s  %12s  %5s  %10s  %11s\n", "phase", "ranks", "bytes", "files", "time",
              "throughput");
  Row("save", 4, model.total_bytes(), md->files.size(), save_secs);
  Row("load", 3, model.total_bytes(), md->files.size(), load_secs);
  Row("verify", 1, verified->bytes_checked, verified->files_checked, verify_secs);
  std::printf("\nload read %s from storage for %s of state (resharding reads whole rows of a\n"
              "stored chunk wherever a rank needs part of them)\n",
              HumanBytes(read_total).c_str(), HumanBytes(model.total_bytes()).c_str());
  std::printf("verification: %s; checksums: %s\n",
              mismatches == 0 ? "every byte of every tensor on all 3 ranks matches the original"
                              : ("MISMATCH in " + std::to_string(mismatches) +
                                 " pieces, first: " + first).c_str(),
              verified->ok() ? "all sound" : verified->defects[0].c_str());
  if (remove_after) std::filesystem::remove_all(std::filesystem::path(dir).parent_path());
  return mismatches == 0 && verified->ok() ? kExitOk : kExitFailure;
}

}  // namespace sp::cli
