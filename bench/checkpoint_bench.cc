// Save and load throughput against the raw disk, measured in the same run.
//
// For each state size: the synthetic transformer state of shardpoint demo, 4 in-process ranks on a
// 2x2 mesh. Baselines use the same bytes, the same files count and the same thread pool:
//   raw write: the bytes written to 4 files in 16 MiB pwrite pieces, fdatasync, directory fsync,
//              timed with and without preallocating the files;
//   raw read:  those files read back in 16 MiB pread pieces after evicting them from the page
//              cache, each file front to back by one thread, round robin across the files, and
//              round robin with O_DIRECT (no page cache at all).
// Each ratio is taken against the fastest of those ways (by median): the most demanding baseline.
// The O_DIRECT read lands in 16 MiB buffers backed by transparent huge pages; the same read into
// buffers of 4 KiB pages (MADV_NOHUGEPAGE) is printed beside it, not taken as a baseline: a load
// reading in place lands in the caller's memory, whose pages are mostly 4 KiB, and a device that
// takes few segments per request can read slower into those (docs/PERFORMANCE.md has figures).
// The loads use LoadOptions::direct_io's default (unset: O_DIRECT for the files not in the page
// cache, all of them here: every load starts cold); with --direct-io they read extents of 1 MiB
// and more of every file with O_DIRECT, with --page-cache none (--direct-io-auto: the default);
// with --direct-write the saves write the whole blocks of writes of 1 MiB and more with O_DIRECT
// (SaveOptions::direct_io).
// The loads' read depth is tuned as they run (the pool's IoTuner, shared by all of them, learning
// across runs; its depth and measurements are printed); --io-depth N fixes it at N instead.
// --scatter-min-run N reads runs of N bytes and more in place (LoadOptions::scatter_min_run_bytes;
// by default 64 KiB from local files), "off" none, to compare the two. The loads' destinations
// are page-aligned buffers, those of 2 MiB and more in transparent huge pages; --small-pages
// puts every destination in 4 KiB pages (as most callers' memory is).
// shardpoint: Save (durable, committed), Load into the same layout, Load resharded into 3 ranks
// (tensor parallel 3, the same tensor dims split) with shared reads (a chunk several ranks need is
// read by one and its regions sent to the others: the default across machines) and without (each
// rank reads whole rows and checksum blocks of what it needs itself: the default in one process),
// Load of every tensor whole by one rank (as consolidation or a one-process restart reads), and
// Load into 3 ranks with every matrix split along the other dim (the worst case). The
// checkpoint files are evicted from the page cache before each load. Each run rotates the order of
// the steps; medians of --runs runs, and for the resharded loads also the median of each run's
// ratio to that run's raw read (the disk's speed drifts over minutes). Last, the time a load takes
// to ask which of the checkpoint's files are cached (sampled), against counting every page, and
// per read step the device's average read request in each run (`device reads`, from the block
// device's counters: every process's reads count), which tells a load whose requests were cut
// short by its destinations' pages from one the device itself slowed, with the requests it had in
// flight on average and the fraction of the time it had any (`device queue`, `device busy`: one
// that the process left idle waited for it); and the CPU time each read step took per GiB (`read
// cpu`: user and system time of the whole process while it ran), which tells a read the cores
// held back from one the device did; and per load step the time from the
// call to the first read of its last rank to begin (`before reads`, LoadResult::
// before_reads_seconds): metadata, planning, assignment, opening files and reading headers.
//
// usage: checkpoint_bench [--dir DIR] [--runs N] [--mib 256,1024] [--threads T] [--no-verify]
//                         [--block-kib N] [--only STEP,...] [--direct-io]
//                         [--direct-io-auto] [--page-cache] [--direct-write] [--io-depth N]
//                         [--scatter-min-run BYTES|off] [--small-pages]
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/testing/synthetic_model.h"

namespace sp {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kPiece = uint64_t{16} << 20;
constexpr int kRawFiles = 4;
bool g_verify = true;  // --no-verify: loads skip checksum verification
// --direct-io: loads read extents of 1 MiB and more with O_DIRECT; --page-cache: never; unset
// (the default, --direct-io-auto): from the files not in the page cache.
std::optional<bool> g_direct;
bool g_direct_write = false;  // --direct-write: saves write with O_DIRECT
uint64_t g_block = kDefaultChecksumBlockBytes;  // --block-kib N: checksum block of the saves
int g_io_depth = 0;  // --io-depth N: loads run at most N reads at once (0: tuned, the default)
// --scatter-min-run N: the shortest run a load reads in place (LoadOptions::scatter_min_run_bytes;
// "off": every column read is staged and copied; unset: the default for local files).
std::optional<uint64_t> g_scatter_min_run;
bool g_small_pages = false;  // --small-pages: the loads' destinations in 4 KiB pages
// --only a,b: run only these read steps (raw-file, raw-robin, raw-direct, raw-direct-4k, same,
// reshard, alone, whole, transposed),
// e.g. to profile one of them; the writes always run. Empty: every step.
std::vector<std::string> g_only;
// The read steps by those names, in the order of the reads in BenchSize.
constexpr const char* kReadSteps[] = {"raw-file", "raw-robin", "raw-direct", "raw-direct-4k",
                                      "same",     "reshard",   "alone",      "whole",
                                      "transposed"};

using bench::Median;  // 0 for no values (a step left out)

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

Status FirstError(const std::vector<Status>& statuses) {
  for (const Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

// Evicts every regular file under `dir` from the page cache (files are already durable).
void DropCache(const std::string& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct RawPiece {
  int file;
  uint64_t offset;
  std::byte* data;
  uint64_t size;
};

// The model's bytes cut into 16 MiB pieces, dealt to kRawFiles files of equal size.
std::vector<RawPiece> RawLayout(testing::GlobalModel& model) {
  std::vector<RawPiece> pieces;
  uint64_t total = model.total_bytes();
  uint64_t per_file = (total + kRawFiles - 1) / kRawFiles;
  uint64_t pos = 0;
  for (AlignedBuffer& buffer : model.data) {
    for (uint64_t lo = 0; lo < buffer.size();) {
      int file = static_cast<int>(pos / per_file);
      uint64_t file_end = (file + 1) * per_file;
      uint64_t n = std::min({kPiece, buffer.size() - lo, file_end - pos});
      pieces.push_back({file, pos - file * per_file, buffer.data() + lo, n});
      lo += n;
      pos += n;
    }
  }
  return pieces;
}

// The CPU time, user and system, of every thread of this process since it started (seconds).
double ProcessCpuSeconds() {
  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}
// The read requests the block device holding `dir` has completed, the bytes they carried, the
// milliseconds they spent on the device added up, and the milliseconds it had any request in
// flight, since it started (fields 1, 3, 4 and 10 of /sys/dev/block/MAJOR:MINOR/stat); nullopt
// where that file cannot be read. Every process's reads count, so the machine should be otherwise
// idle.
struct DeviceReads {
  uint64_t requests = 0;
  uint64_t bytes = 0;
  uint64_t request_ms = 0;
  uint64_t busy_ms = 0;
};
std::optional<DeviceReads> ReadDeviceReads(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return std::nullopt;
  std::ifstream in("/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                   std::to_string(minor(st.st_dev)) + "/stat");
  uint64_t f[10] = {};
  for (uint64_t& x : f) {
    if (!(in >> x)) return std::nullopt;
  }
  return DeviceReads{f[0], f[2] * 512, f[3], f[9]};
}

// What the device did while the last timed read ran (RawRead, RawReadDirect, TimedLoad): its read
// requests in flight on average (their milliseconds on the device over the read's), and the
// fraction of the read's time it had any in flight. A device that is kept busy but slower has
// shorter requests (`device reads`) or fewer of them in flight; one that is left idle waited for
// the process. nullopt where the counters cannot be read.
struct DeviceQueue {
  double in_flight = 0;
  double busy = 0;
};
std::optional<DeviceQueue> g_device_queue;

void NoteDeviceQueue(const std::optional<DeviceReads>& before, const std::string& dir,
                     double seconds) {
  const std::optional<DeviceReads> after = ReadDeviceReads(dir);
  g_device_queue.reset();
  if (!before || !after || seconds <= 0) return;
  const double ms = seconds * 1e3;
  g_device_queue = DeviceQueue{static_cast<double>(after->request_ms - before->request_ms) / ms,
                               std::min(1.0, (after->busy_ms - before->busy_ms) / ms)};
}

// The CPU time the last timed read (RawRead, RawReadDirect, TimedLoad) took between its clock's
// start and stop, every thread of the process counted: what a read costs the machine beside
// its time.
double g_read_cpu_s = 0;
// The last TimedLoad's time before reading: the largest LoadResult::before_reads_seconds of its
// ranks (the load's reads are complete only once the last rank has begun); -1 after a raw read.
double g_before_reads_s = -1;

double RawWrite(const std::string& dir, const std::vector<RawPiece>& pieces, ThreadPool& pool,
                bool preallocate) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto t0 = Clock::now();
  int fds[kRawFiles];
  uint64_t file_bytes[kRawFiles] = {};
  for (const RawPiece& p : pieces) file_bytes[p.file] = std::max(file_bytes[p.file], p.offset + p.size);
  for (int f = 0; f < kRawFiles; ++f) {
    fds[f] = ::open((dir + "/raw-" + std::to_string(f)).c_str(),
                    O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (preallocate) ::posix_fallocate(fds[f], 0, static_cast<off_t>(file_bytes[f]));
  }
  Check(ParallelFor(&pool, static_cast<int64_t>(pieces.size()), [&](int64_t i) -> Status {
          const RawPiece& p = pieces[i];
          if (::pwrite(fds[p.file], p.data, p.size, p.offset) != static_cast<ssize_t>(p.size)) {
            return ErrnoToStatus(errno, "raw pwrite");
          }
          return OkStatus();
        }),
        "raw write");
  Check(ParallelFor(&pool, kRawFiles, [&](int64_t f) -> Status {
          if (::fdatasync(fds[f]) != 0) return ErrnoToStatus(errno, "raw fdatasync");
          ::close(fds[f]);
          return OkStatus();
        }),
        "raw sync");
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ::fsync(dfd);
  ::close(dfd);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One cold read of the raw files in 16 MiB preads. `per_file`: each file read front to back by
// one task; otherwise the pieces go to the threads round robin across the files (piece k of every
// file before piece k+1 of any). (Handing the pieces out in file order instead, so that all
// threads read one file at neighbouring offsets, is 20-40% slower on this kind of disk.)
double RawRead(const std::string& dir, const std::vector<RawPiece>& pieces,
               std::vector<AlignedBuffer>& sink, ThreadPool& pool, bool per_file) {
  DropCache(dir);
  const std::optional<DeviceReads> device0 = ReadDeviceReads(dir);
  auto t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  int fds[kRawFiles];
  for (int f = 0; f < kRawFiles; ++f) {
    fds[f] = ::open((dir + "/raw-" + std::to_string(f)).c_str(), O_RDONLY | O_CLOEXEC);
  }
  std::vector<std::vector<const RawPiece*>> by_file(kRawFiles);
  for (const RawPiece& p : pieces) by_file[p.file].push_back(&p);
  for (auto& list : by_file) {
    std::sort(list.begin(), list.end(),
              [](const RawPiece* a, const RawPiece* b) { return a->offset < b->offset; });
  }
  std::atomic<size_t> next_sink{0};
  auto read = [&](const RawPiece& p) -> Status {
    std::byte* out = sink[next_sink++ % sink.size()].data();
    if (::pread(fds[p.file], out, p.size, p.offset) != static_cast<ssize_t>(p.size)) {
      return ErrnoToStatus(errno, "raw pread");
    }
    return OkStatus();
  };
  TaskGroup group(&pool);
  if (per_file) {
    for (int f = 0; f < kRawFiles; ++f) {
      group.Run([&, f]() -> Status {
        for (const RawPiece* p : by_file[f]) SP_RETURN_IF_ERROR(read(*p));
        return OkStatus();
      });
    }
  } else {
    for (size_t k = 0;; ++k) {
      bool any = false;
      for (int f = 0; f < kRawFiles; ++f) {
        if (k >= by_file[f].size()) continue;
        any = true;
        const RawPiece* p = by_file[f][k];
        group.Run([&, p] { return read(*p); });
      }
      if (!any) break;
    }
  }
  Check(group.Wait(), "raw read");
  for (int f = 0; f < kRawFiles; ++f) ::close(fds[f]);
  g_read_cpu_s = ProcessCpuSeconds() - cpu0;
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  NoteDeviceQueue(device0, dir, secs);
  return secs;
}

// One cold read of the raw files with O_DIRECT (no page cache): each file in 16 MiB pieces at
// aligned offsets (the last one rounded up: the read stops at the end of the file), round robin
// across the files as above. The fastest way to read a file once on many devices, so a baseline
// for the loads with direct I/O.
double RawReadDirect(const std::string& dir, std::vector<AlignedBuffer>& sink, ThreadPool& pool) {
  DropCache(dir);
  const std::optional<DeviceReads> device0 = ReadDeviceReads(dir);
  auto t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  int fds[kRawFiles];
  uint64_t sizes[kRawFiles];
  for (int f = 0; f < kRawFiles; ++f) {
    const std::string path = dir + "/raw-" + std::to_string(f);
    fds[f] = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fds[f] < 0) Check(ErrnoToStatus(errno, "open " + path + " with O_DIRECT"), "raw direct read");
    sizes[f] = std::filesystem::file_size(path);
  }
  std::atomic<size_t> next_sink{0};
  TaskGroup group(&pool);
  for (uint64_t at = 0;; at += kPiece) {
    bool any = false;
    for (int f = 0; f < kRawFiles; ++f) {
      if (at >= sizes[f]) continue;
      any = true;
      const uint64_t want = (std::min(kPiece, sizes[f] - at) + 4095) / 4096 * 4096;
      group.Run([&, f, at, want]() -> Status {
        std::byte* out = sink[next_sink++ % sink.size()].data();
        if (::pread(fds[f], out, want, static_cast<off_t>(at)) < 0) {
          return ErrnoToStatus(errno, "raw direct pread");
        }
        return OkStatus();
      });
    }
    if (!any) break;
  }
  Check(group.Wait(), "raw direct read");
  for (int f = 0; f < kRawFiles; ++f) ::close(fds[f]);
  g_read_cpu_s = ProcessCpuSeconds() - cpu0;
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  NoteDeviceQueue(device0, dir, secs);
  return secs;
}

// What a load spends, before its first read, asking which of the checkpoint's files are in the
// page cache (ReadableFile::CachedFraction: it samples files over 16 MiB), against counting every
// page of every file (mincore over the whole of each; the baseline). Cold files, as the loads
// see them; the milliseconds for all the files, medians of 5.
std::string ResidencyCheck(const std::string& dir) {
  DropCache(dir);
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.file_size() > 0) paths.push_back(entry.path().string());
  }
  PosixStore store;
  std::vector<double> sampled, every;
  for (int run = 0; run < 5; ++run) {
    auto t0 = Clock::now();
    for (const std::string& path : paths) {
      Result<std::unique_ptr<ReadableFile>> file = store.OpenReadable(path);
      Check(file.status(), "residency check");
      (void)(*file)->CachedFraction(0, (*file)->size());
    }
    auto t1 = Clock::now();
    for (const std::string& path : paths) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) Check(ErrnoToStatus(errno, "open " + path), "residency check");
      const size_t size = std::filesystem::file_size(path);
      void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (map != MAP_FAILED) {
        std::vector<unsigned char> resident((size + 4095) / 4096);
        ::mincore(map, size, resident.data());
        ::munmap(map, size);
      }
      ::close(fd);
    }
    auto t2 = Clock::now();
    sampled.push_back(std::chrono::duration<double>(t1 - t0).count());
    every.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  char out[160];
  std::snprintf(out, sizeof(out),
                "  %-20s %.2f ms for the %zu files (sampled), every page %.2f ms (the baseline)\n",
                "residency check", Median(sampled) * 1e3, paths.size(), Median(every) * 1e3);
  return out;
}

double TimedSave(testing::GlobalModel& model, std::vector<testing::RankShards>& train,
                 const std::string& dir, ThreadPool& pool, SaveStats* rank0) {
  // A fresh directory, as a training job saves each step: like the raw baseline, the time of
  // deleting an earlier checkpoint is not counted.
  std::filesystem::remove_all(dir);
  auto t0 = Clock::now();
  Check(FirstError(RunRanks(4, [&](Communicator& comm) {
          SaveOptions options;
          options.comm = &comm;
          options.pool = &pool;
          options.checksum_block_bytes = g_block;
          options.direct_io = g_direct_write;
          if (comm.rank() == 0) options.stats = rank0;
          return Save(train[comm.rank()].AsSaveState(model), dir, options);
        })),
        "save");
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double TimedLoad(testing::GlobalModel& model, std::vector<testing::RankShards>& dest,
                 const std::string& dir, ThreadPool& pool, uint64_t* bytes_read,
                 bool share_reads = true) {
  DropCache(dir);
  std::vector<uint64_t> read(dest.size(), 0);
  std::vector<double> before_reads(dest.size(), 0);
  const std::optional<DeviceReads> device0 = ReadDeviceReads(dir);
  auto t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  Check(FirstError(RunRanks(static_cast<int>(dest.size()), [&](Communicator& comm) -> Status {
          LoadOptions options;
          options.comm = &comm;
          options.pool = &pool;
          options.verify_checksums = g_verify;
          options.direct_io = g_direct;
          options.io_depth = g_io_depth;
          options.scatter_min_run_bytes = g_scatter_min_run;
          options.share_reads = share_reads;
          SP_ASSIGN_OR_RETURN(LoadResult r, Load(dest[comm.rank()].AsLoadState(model), dir, options));
          read[comm.rank()] = r.bytes_read;
          before_reads[comm.rank()] = r.before_reads_seconds;
          return OkStatus();
        })),
        "load");
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  g_read_cpu_s = ProcessCpuSeconds() - cpu0;
  NoteDeviceQueue(device0, dir, secs);
  g_before_reads_s = *std::max_element(before_reads.begin(), before_reads.end());
  *bytes_read = 0;
  for (uint64_t b : read) *bytes_read += b;
  return secs;
}

void BenchSize(uint64_t mib, int runs, const std::string& dir, ThreadPool& pool) {
  testing::GlobalModel model = testing::MakeGlobalModel(testing::ConfigForBytes(mib << 20), 11);
  auto train = testing::ShardModel(model, testing::Which::kTrain, true);
  Check(train.status(), "shard");
  std::vector<RawPiece> raw = RawLayout(model);
  std::vector<AlignedBuffer> sink, small_page_sink;
  for (int i = 0; i < pool.size(); ++i) {
    sink.emplace_back(kPiece);
    small_page_sink.emplace_back(kPiece);
    // Before its first touch: no page of it is a huge page.
    ::madvise(small_page_sink.back().data(), kPiece, MADV_NOHUGEPAGE);
  }
  const double gb = model.total_bytes() / 1e9;
  const std::string raw_dir = dir + "/raw", ckpt_dir = dir + "/checkpoint";

  std::vector<double> raw_w, raw_r, save, load_same, load_reshard, load_alone, load_whole,
      load_transposed;
  std::vector<double> phases[4];  // rank 0's plan, write, sync, commit
  // Per read step, the device's average read request in each run (KiB): a direct read into
  // 4 KiB pages that lie apart in physical memory reaches the device in requests cut at its
  // segment limit, far below what it takes into huge pages (docs/PERFORMANCE.md, "Requests cut
  // by the destination's pages").
  std::map<std::string, std::vector<double>> request_kib;
  // Per read step, the device's read requests in flight on average and the fraction of the time
  // it had any, in each run (g_device_queue).
  std::map<std::string, std::vector<double>> in_flight, busy;
  // Per read step, the CPU seconds its read took per GiB of state in each run (g_read_cpu_s).
  std::map<std::string, std::vector<double>> cpu_per_gib;
  // Per load step, the milliseconds before its last rank's first read in each run.
  std::map<std::string, std::vector<double>> before_reads_ms;
  uint64_t read_same = 0, read_reshard = 0, read_alone = 0, read_whole = 0, read_transposed = 0;
  // Each load fills destinations of its own layout, allocated (zeroed) before it is timed and
  // freed after it, so that a 4 GiB state needs room for two copies of it, not six. The last run
  // checks every byte each load put there.
  int64_t bad = 0;
  std::string first;
  auto timed_load = [&](testing::Which which, std::vector<double>& times, uint64_t* bytes_read,
                        bool share_reads, bool check) {
    Result<std::vector<testing::RankShards>> dest = testing::ShardModel(model, which, false);
    Check(dest.status(), "shard");
    if (g_small_pages) {
      // Give back the pages of the large buffers (huge pages) and fault them in again, 4 KiB each.
      for (testing::RankShards& rank : *dest) {
        for (std::vector<AlignedBuffer>& pieces : rank.buffers) {
          for (AlignedBuffer& b : pieces) {
            if (b.size() < (size_t{2} << 20)) continue;
            ::madvise(b.data(), b.size(), MADV_NOHUGEPAGE);
            ::madvise(b.data(), b.size(), MADV_DONTNEED);
            std::memset(b.data(), 0, b.size());
          }
        }
      }
    }
    times.push_back(TimedLoad(model, *dest, ckpt_dir, pool, bytes_read, share_reads));
    if (check) bad += testing::CountMismatches(model, *dest, &first);
  };
  // Each run times every step once. The disk's speed depends on what it did just before (it
  // throttles after long transfers), so each run rotates the order of the writes and, after them,
  // of the reads: every step takes every position equally often.
  std::vector<double> raw_w_plain, raw_w_prealloc, raw_r_file, raw_r_robin, raw_r_direct,
      raw_r_direct_small;
  for (int run = 0; run < runs; ++run) {
    SaveStats stats;
    const bool last = run == runs - 1;
    std::vector<std::function<void()>> writes = {
        [&] { raw_w_plain.push_back(RawWrite(raw_dir, raw, pool, false)); },
        [&] { raw_w_prealloc.push_back(RawWrite(raw_dir, raw, pool, true)); },
        [&] {
          save.push_back(TimedSave(model, *train, ckpt_dir, pool, &stats));
          phases[0].push_back(stats.plan_seconds);
          phases[1].push_back(stats.write_seconds);
          phases[2].push_back(stats.sync_seconds);
          phases[3].push_back(stats.commit_seconds);
        }};
    std::vector<std::function<void()>> reads = {
        [&] { raw_r_file.push_back(RawRead(raw_dir, raw, sink, pool, true)); },
        [&] { raw_r_robin.push_back(RawRead(raw_dir, raw, sink, pool, false)); },
        [&] { raw_r_direct.push_back(RawReadDirect(raw_dir, sink, pool)); },
        [&] { raw_r_direct_small.push_back(RawReadDirect(raw_dir, small_page_sink, pool)); },
        [&] { timed_load(testing::Which::kTrain, load_same, &read_same, true, last); },
        [&] { timed_load(testing::Which::kServe, load_reshard, &read_reshard, true, last); },
        [&] { timed_load(testing::Which::kServe, load_alone, &read_alone, false, last); },
        [&] { timed_load(testing::Which::kWhole, load_whole, &read_whole, true, last); },
        [&] {
          timed_load(testing::Which::kTransposed, load_transposed, &read_transposed, true, last);
        }};
    for (size_t i = 0; i < writes.size(); ++i) writes[(run + i) % writes.size()]();
    for (size_t i = 0; i < reads.size(); ++i) {
      const size_t step = (run + i) % reads.size();
      const char* name = kReadSteps[step];
      if (g_only.empty() || std::find(g_only.begin(), g_only.end(), name) != g_only.end()) {
        const std::optional<DeviceReads> before = ReadDeviceReads(dir);
        g_before_reads_s = -1;
        reads[step]();
        if (g_before_reads_s >= 0) before_reads_ms[name].push_back(g_before_reads_s * 1e3);
        const std::optional<DeviceReads> after = ReadDeviceReads(dir);
        cpu_per_gib[name].push_back(g_read_cpu_s / (model.total_bytes() / double(1 << 30)));
        if (g_device_queue) {
          in_flight[name].push_back(g_device_queue->in_flight);
          busy[name].push_back(g_device_queue->busy);
        }
        if (before && after && after->requests > before->requests) {
          request_kib[name].push_back(static_cast<double>(after->bytes - before->bytes) /
                                      (after->requests - before->requests) / 1024);
        }
      }
    }
    std::filesystem::remove_all(raw_dir);
  }
  // The baselines: the faster way by median (the most demanding), run by run.
  raw_w = Median(raw_w_plain) <= Median(raw_w_prealloc) ? raw_w_plain : raw_w_prealloc;
  raw_r = {};
  for (const std::vector<double>* way : {&raw_r_file, &raw_r_robin, &raw_r_direct}) {
    if (!way->empty() && (raw_r.empty() || Median(*way) < Median(raw_r))) raw_r = *way;
  }
  const std::string residency = ResidencyCheck(ckpt_dir);
  std::filesystem::remove_all(ckpt_dir);

  auto line = [&](const char* name, const std::vector<double>& t, double base, const char* vs,
                  const char* target) {
    if (t.empty()) return;
    double m = Median(t);
    std::printf("  %-20s median %7.3f s  (min %.3f, max %.3f)  %6.2f GB/s", name, m,
                *std::min_element(t.begin(), t.end()), *std::max_element(t.begin(), t.end()),
                gb / m);
    if (base > 0) std::printf("  = %.2fx %s  [target %s]", base / m, vs, target);
    std::printf("\n");
  };
  // The disk changes speed over minutes: each load's ratio against the raw read of its own run
  // (seconds apart), the median over runs, with the spread.
  auto paired = [&](const std::vector<double>& t) {
    if (t.empty() || t.size() != raw_r.size()) return;
    std::vector<double> r;
    for (size_t i = 0; i < t.size(); ++i) r.push_back(raw_r[i] / t[i]);
    std::printf("  %-20s each run against its own raw read: median %.2fx (min %.2fx, max %.2fx)\n",
                "", Median(r), *std::min_element(r.begin(), r.end()),
                *std::max_element(r.begin(), r.end()));
  };
  std::printf("state %s (%zu tensors), %d runs, %d I/O threads, loads %s%s\n",
              HumanBytes(model.total_bytes()).c_str(), model.specs.size(), runs, pool.size(),
              !g_direct.has_value() ? "with direct I/O where the files are cold (auto)"
              : *g_direct           ? "with direct I/O"
                                    : "through the page cache",
              g_small_pages ? ", into 4 KiB pages" : "");
  line("raw write plain", raw_w_plain, 0, "", "");
  line("raw write prealloc", raw_w_prealloc, 0, "", "");
  line("raw read per file", raw_r_file, 0, "", "");
  line("raw read round robin", raw_r_robin, 0, "", "");
  line("raw read direct", raw_r_direct, 0, "", "");
  line("raw direct 4K pages", raw_r_direct_small, 0, "", "");
  line("save (4 ranks)", save, Median(raw_w), "raw write", ">= 0.9x");
  std::printf("  %-20s plan %.3f s, write %.3f s, sync %.3f s, commit %.3f s (rank 0, medians)\n",
              "save phases", Median(phases[0]), Median(phases[1]), Median(phases[2]),
              Median(phases[3]));
  // Targets: docs/PERFORMANCE.md (every cold load layout but the worst case at 0.85x).
  line("load same layout", load_same, Median(raw_r), "raw read", ">= 0.85x");
  paired(load_same);
  line("load resharded 4->3", load_reshard, Median(raw_r), "raw read", ">= 0.85x");
  paired(load_reshard);
  line("  no shared reads", load_alone, Median(raw_r), "raw read", ">= 0.85x");
  paired(load_alone);
  line("load whole, 1 rank", load_whole, Median(raw_r), "raw read", ">= 0.85x");
  paired(load_whole);
  line("load transposed 4->3", load_transposed, Median(raw_r), "raw read", "none: worst case");
  if (g_io_depth > 0) {
    std::printf("  %-20s fixed at %d of %d threads (--io-depth)\n", "read depth", g_io_depth,
                pool.size());
  } else {
    // The pool's tuner, shared by every load of this process: where it stands now, and what it
    // measured at each depth (smoothed GB/s with the gate full).
    IoTuner& tuner = pool.io_tuner();
    std::printf("  %-20s tuned: %d of %d threads after %lld intervals", "read depth",
                tuner.home_depth(), pool.size(), static_cast<long long>(tuner.intervals()));
    if (tuner.depth() != tuner.home_depth()) std::printf(" (probing %d)", tuner.depth());
    std::printf("; GB/s by depth:");
    for (int d = 1; d <= tuner.max_depth(); ++d) {
      if (tuner.throughput(d) > 0) std::printf(" %d:%.2f", d, tuner.throughput(d) / 1e9);
    }
    std::printf("\n");
  }
  // One line of a figure per read step: its median and range over the runs, with `digits`.
  auto print_per_step = [](const char* label, const char* what,
                           const std::map<std::string, std::vector<double>>& per_step, int digits) {
    if (per_step.empty()) return;
    std::printf("  %-20s %s, median (min-max) of the runs:", label, what);
    for (const char* name : kReadSteps) {
      const auto it = per_step.find(name);
      if (it == per_step.end()) continue;
      const std::vector<double>& v = it->second;
      std::printf(" %s %.*f (%.*f-%.*f)", name, digits, Median(v), digits,
                  *std::min_element(v.begin(), v.end()), digits,
                  *std::max_element(v.begin(), v.end()));
    }
    std::printf("\n");
  };
  print_per_step("device reads", "KiB per request", request_kib, 0);
  print_per_step("device queue", "reads in flight on average", in_flight, 1);
  print_per_step("device busy", "fraction of the time with a read in flight", busy, 2);
  print_per_step("read cpu", "CPU seconds per GiB", cpu_per_gib, 2);
  print_per_step("before reads", "ms to the last rank's first read", before_reads_ms, 1);
  std::printf("%s", residency.c_str());
  std::printf("  bytes read: same layout %s, resharded %s (%s without shared reads), whole by one "
              "rank %s, transposed %s (checkpoint %s); byte check: %s\n\n",
              HumanBytes(read_same).c_str(), HumanBytes(read_reshard).c_str(),
              HumanBytes(read_alone).c_str(), HumanBytes(read_whole).c_str(),
              HumanBytes(read_transposed).c_str(),
              HumanBytes(model.total_bytes()).c_str(),
              bad == 0 ? "every byte matches" : ("MISMATCH " + first).c_str());
  if (bad != 0) std::exit(1);
}

}  // namespace
}  // namespace sp

int main(int argc, char** argv) {
  // Line by line even into a file or pipe: a run stopped by a time limit keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string dir = "/tmp/shardpoint-bench";
  int runs = 5;
  int threads = 0;
  std::vector<uint64_t> sizes = {256, 1024};
  for (int i = 1; i < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--direct-write" || a == "--small-pages") {
      (a == "--direct-write" ? sp::g_direct_write : sp::g_small_pages) = true;
      --i;
      continue;
    }
    if (a == "--no-verify" || a == "--direct-io" || a == "--direct-io-auto" ||
        a == "--page-cache") {
      if (a == "--no-verify") sp::g_verify = false;
      if (a == "--direct-io") sp::g_direct = true;
      if (a == "--direct-io-auto") sp::g_direct.reset();
      if (a == "--page-cache") sp::g_direct = false;
      --i;
      continue;
    }
    if (i + 1 >= argc) a = "--help";
    std::string v = a == "--help" ? "" : argv[i + 1];
    if (a == "--dir") dir = v;
    else if (a == "--runs") runs = std::stoi(v);
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--block-kib") sp::g_block = std::stoull(v) << 10;
    else if (a == "--io-depth") sp::g_io_depth = std::stoi(v);
    else if (a == "--scatter-min-run") {
      sp::g_scatter_min_run =
          v == "off" ? std::numeric_limits<uint64_t>::max() : std::stoull(v);
    }
    else if (a == "--only") {
      for (size_t p = 0; p < v.size();) {
        size_t c = v.find(',', p);
        sp::g_only.push_back(v.substr(p, c - p));
        p = c == std::string::npos ? v.size() : c + 1;
      }
    }
    else if (a == "--mib") {
      sizes.clear();
      for (size_t p = 0; p < v.size();) {
        size_t c = v.find(',', p);
        sizes.push_back(std::stoull(v.substr(p, c - p)));
        p = c == std::string::npos ? v.size() : c + 1;
      }
    } else {
      std::fprintf(stderr, "usage: checkpoint_bench [--dir DIR] [--runs N] [--mib 256,1024] [--threads T] [--no-verify] [--block-kib N] [--only STEP,...] [--direct-io] [--direct-io-auto] [--page-cache] [--direct-write] [--io-depth N] [--scatter-min-run BYTES|off] [--small-pages]\n");
      return 2;
    }
  }
  std::filesystem::create_directories(dir);
  sp::ThreadPool pool(threads > 0 ? threads : sp::DefaultIoThreads());
  for (uint64_t mib : sizes) sp::BenchSize(mib, runs, dir, pool);
  std::filesystem::remove_all(dir);
  return 0;
}
