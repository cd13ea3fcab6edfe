// IoTuner: how many reads run at once, found by measuring what the storage delivers.
//
// A device reads fastest at some number of requests in flight: fewer leave it idle between
// requests, more make it seek between them (a disk), queue behind a throttle (a cloud volume) or
// fight over the page cache. Where that point lies depends on the device, the file system, the
// size of the reads and whatever else runs, so no fixed number fits every machine. The tuner
// gates the reads (Acquire before one, Release after it) and measures, over intervals of running
// reads, the bytes per second delivered while the gate was full; a DepthController keeps a
// smoothed throughput per depth and moves the depth one step at a time toward a neighbour that
// delivers more, re-probing the neighbours now and then to follow a device whose speed drifts.
// The depth stays in [1, max_depth]; max_depth bounds the memory in flight (each read stages at
// most one window of the memory budget). A fixed tuner never changes its depth.
//
// Time spent with the gate not full (too few reads waiting: the end of a load, planning between
// loads) is not measured: it says nothing about the depth; nor are the reads begun before the
// depth last changed. The learned depth persists: a pool's
// tuner (ThreadPool::io_tuner) carries it from one load to the next.
//
// Thread-safe. See docs/PERFORMANCE.md ("Read depth").
#ifndef SHARDPOINT_EXEC_IO_TUNER_H_
#define SHARDPOINT_EXEC_IO_TUNER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace sp {

// The hill climb behind IoTuner, without clocks or threads: fed one throughput per interval.
class DepthController {
 public:
  // `tolerance`: a relative difference of throughput smaller than this is noise (a neighbour must
  // beat the current depth by more to be taken). `probe_every`: intervals spent at the best
  // depth between two probes of a neighbour.
  DepthController(int max_depth, int start_depth, double tolerance = 0.05, int probe_every = 6);

  int depth() const { return depth_; }
  // The throughput measured over one interval at depth(); returns the depth for the next one.
  int Observe(double bytes_per_second);
  // The smoothed throughput measured at `depth`, 0 where never measured.
  double throughput(int depth) const;

 private:
  int max_depth_;
  int depth_;
  int home_;           // the best depth found; depth_ != home_ while probing a neighbour
  int direction_ = 1;  // the neighbour probed next: home_ + direction_
  int steady_ = 0;     // intervals at home_ since the last probe
  double tolerance_;
  int probe_every_;
  std::vector<double> smoothed_;  // by depth; 0: not measured
};

class IoTuner {
 public:
  struct Config {
    int max_depth = 4;
    int start_depth = 0;  // 0: min(max_depth, 4)
    bool fixed = false;   // true: the depth stays start_depth (or max_depth)
    // An interval ends once both have passed with the gate full.
    uint64_t interval_bytes = uint64_t{64} << 20;
    double interval_seconds = 0.05;
    double tolerance = 0.05;
    int probe_every = 6;
    std::function<double()> clock;  // seconds; null: the steady clock (tests give their own)
  };

  explicit IoTuner(Config config);

  IoTuner(const IoTuner&) = delete;
  IoTuner& operator=(const IoTuner&) = delete;

  // Blocks while depth() reads are running, then counts this one as running.
  void Acquire();
  // Ends a read begun by Acquire that delivered `bytes`.
  void Release(uint64_t bytes);

  int depth() const;
  int max_depth() const { return config_.max_depth; }
  bool fixed() const { return config_.fixed; }
  // The smoothed throughput (bytes/s) measured at `depth`, 0 where never measured.
  double throughput(int depth) const;
  // Intervals measured so far.
  int64_t intervals() const;

 private:
  double Now() const;
  // Adds the time since the last event to the interval when the gate was full; called under mu_
  // at every Acquire and Release.
  void Account(double now);

  Config config_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  DepthController controller_;
  int running_ = 0;
  int waiting_ = 0;
  int settling_ = 0;  // completions of reads begun before the last change of depth, not measured
  double last_event_ = 0;
  double interval_seconds_ = 0;  // full-gate time in this interval
  uint64_t interval_bytes_ = 0;  // bytes completed with the gate full in this interval
  int64_t intervals_ = 0;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_IO_TUNER_H_
