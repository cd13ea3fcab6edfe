// IoTuner: how many reads run at once, found by measuring what the storage delivers.
//
// A device reads fastest at some number of requests in flight: fewer leave it idle between
// requests, more make it seek between them (a disk), queue behind a throttle (a cloud volume) or
// fight over the page cache. Where that point lies depends on the device, the file system, the
// size of the reads and whatever else runs, so no fixed number fits every machine. The tuner
// gates the reads (Acquire before one, Release after it) and measures, over intervals of running
// reads, the bytes per second delivered while reads were asked for; a DepthController keeps a
// recent mean throughput per depth and moves the depth one step at a time toward a neighbour that
// delivers more by more than the measured noise, re-probing the neighbours now and then to follow
// a device whose speed drifts.
// The depth stays in [1, max_depth]; max_depth bounds the memory in flight (each read stages at
// most one window of the memory budget). A fixed tuner never changes its depth.
//
// Time counts while at least one read runs or waits to: what a depth delivers is measured with
// all it costs, the time a read that was let in takes to begin (a waiter woken, a thread
// scheduled) and the moments the readers' threads are busy with bytes already read, when fewer
// reads than the depth ask. Counting only the time with as many reads asking as the depth
// (and the bytes of the reads that ended then) rated the depth that equals the readers' threads
// too low: after each read its thread works on the bytes, so the gate is short of a read then,
// and a read that ends in that moment (reads begun together end together) had its time counted
// but not its bytes. Simulated with equal throughput at every depth, 4 threads and 2-5 ms of
// work after each 16 MiB read, that rated depth 4 5-10% low and depth 3 up to 7% high. Time
// with no read asking (planning between loads) is not measured, nor are the reads begun before
// the depth last changed. The learned depth persists: a pool's tuner (ThreadPool::io_tuner)
// carries it from one load to the next.
//
// Reads are let in in the order they asked. Thread-safe. SharedIoTuner (exec/shared_io_tuner.h)
// is the same gate in memory shared by the processes of a machine. See docs/PERFORMANCE.md
// ("Read depth").
#ifndef SHARDPOINT_EXEC_IO_TUNER_H_
#define SHARDPOINT_EXEC_IO_TUNER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>

namespace sp {

// The most reads a gate lets run at once (a bound on any max_depth).
inline constexpr int kMaxIoDepth = 256;

// The hill climb behind IoTuner, without clocks or threads: fed one throughput per interval.
// Plain data (no pointers), so that it can live in memory shared between processes.
//
// Each depth keeps a running mean of its readings in which each new one weighs 1/kMeanWindow
// once there are that many (older readings fade out). How much one interval's reading scatters
// is measured too, from the readings at the home depth (their relative deviation from its
// mean), and a move needs more than that scatter explains: comparing a neighbour with home, the
// band of noise is the larger of `tolerance` and `confidence` standard errors of the difference
// of the two means. On a steady device the band is the tolerance; on one whose readings scatter
// by tens of percent (a shared virtual disk), a neighbour must show a real difference over
// several probes before the depth moves, and the start depth holds meanwhile. The first probe
// waits for four readings at the start depth, so that the scatter is known.
class DepthController {
 public:
  // `tolerance`: a relative difference of throughput smaller than this is noise even on a steady
  // device (a deeper neighbour must beat home by more; a shallower one may be this much slower).
  // `probe_every`: intervals spent at the best depth between two probes of a neighbour.
  // `confidence`: standard errors of the difference that a move must clear. max_depth is
  // clamped to [1, kMaxIoDepth].
  DepthController(int max_depth, int start_depth, double tolerance = 0.05, int probe_every = 6,
                  double confidence = 2.0);

  int depth() const { return depth_; }
  // The best depth found so far: depth() is another one only while a neighbour is probed.
  int home_depth() const { return home_; }
  // The throughput measured over one interval at depth(); returns the depth for the next one.
  int Observe(double bytes_per_second);
  // The running mean of the readings at `depth`, 0 where never measured.
  double throughput(int depth) const;
  // The measured relative standard deviation of one interval's reading (0 until measured).
  double scatter() const;

  // Each new reading weighs at least 1/kMeanWindow in a depth's mean and each new deviation at
  // least 1/kScatterWindow in the scatter (the older ones fade out).
  static constexpr int kMeanWindow = 4;
  static constexpr int kScatterWindow = 8;
  // Readings at the start depth before the first probe.
  static constexpr int kFirstProbeAfter = 4;

 private:
  // The relative band of noise when comparing `probe` with home.
  double Band(int probe) const;

  int max_depth_;
  int depth_;
  int home_;           // the best depth found; depth_ != home_ while probing a neighbour
  int direction_ = 1;  // the neighbour probed next: home_ + direction_
  int steady_ = 0;     // intervals at home_ since the last probe
  double tolerance_;
  int probe_every_;
  double confidence_;
  double mean_[kMaxIoDepth + 1] = {};  // by depth; 0: not measured
  int readings_[kMaxIoDepth + 1] = {};  // by depth, up to kMeanWindow
  double rel_variance_ = 0;  // mean squared relative deviation of a reading at home
  int deviations_ = 0;       // readings in rel_variance_, up to kScatterWindow
};

// What a read executor needs of a gate: Acquire before a read, Release after it.
class IoGate {
 public:
  virtual ~IoGate() = default;
  // Blocks until this read may run, then counts it as running.
  virtual void Acquire() = 0;
  // Ends a read begun by Acquire that delivered `bytes`.
  virtual void Release(uint64_t bytes) = 0;
  // How many reads may run at once now.
  virtual int depth() const = 0;
};

// How a tuned gate measures and moves (IoTuner, SharedIoTuner).
struct IoTunerConfig {
  int max_depth = 4;
  int start_depth = 0;  // 0: min(max_depth, 4)
  bool fixed = false;   // true: the depth stays start_depth (or max_depth)
  // An interval ends once both have passed in measured time (reads asked for).
  uint64_t interval_bytes = uint64_t{64} << 20;
  double interval_seconds = 0.05;
  double tolerance = 0.05;
  int probe_every = 6;
  double confidence = 2.0;
};

// The bookkeeping of a tuned gate, as plain data that a caller guards with its own lock (a
// std::mutex in IoTuner, a process-shared mutex in SharedIoTuner) and feeds its own clock.
// Reads are let in first come, first served: each takes a ticket, and ticket t may begin once
// t < ended + depth (the reads before it have begun, and at most depth - 1 of them still run).
class TunerCore {
 public:
  TunerCore(IoTunerConfig config, double now);

  // A read asks to be let in; returns its ticket.
  uint64_t Take(double now);
  bool Granted(uint64_t ticket) const { return ticket < grant_limit(); }
  // Tickets below this are granted (their reads may run).
  uint64_t grant_limit() const { return ended_ + controller_.depth(); }
  uint64_t taken() const { return taken_; }
  // A granted read begins / a running read ends having delivered `bytes`. End measures, and
  // returns true when the depth changed (waiters may now be let in).
  void Begin(double now);
  bool End(double now, uint64_t bytes);
  // Forgets reads that will never end or begin (their process died): `begun` of them had begun.
  void Reclaim(uint64_t begun, uint64_t waiting);

  int depth() const { return controller_.depth(); }
  int home_depth() const { return controller_.home_depth(); }
  double throughput(int depth) const { return controller_.throughput(depth); }
  int64_t intervals() const { return intervals_; }
  uint64_t waiting() const { return taken_ - begun_; }
  bool fixed() const { return config_.fixed; }
  int max_depth() const { return config_.max_depth; }

 private:
  // Whether a read runs or waits to (and none began at an older depth).
  bool Measuring() const;
  // Adds the time since the last event to the interval when it was measured.
  void Account(double now);

  IoTunerConfig config_;
  DepthController controller_;
  uint64_t taken_ = 0;  // tickets handed out
  uint64_t begun_ = 0;  // reads begun
  uint64_t ended_ = 0;  // reads ended (or reclaimed)
  uint64_t settling_ = 0;  // completions of reads begun before the last change of depth
  double last_event_ = 0;
  double interval_seconds_ = 0;  // measured time in this interval
  uint64_t interval_bytes_ = 0;  // bytes completed in measured time in this interval
  int64_t intervals_ = 0;
};

// A tuned gate for the threads of one process (a ThreadPool's reads).
class IoTuner final : public IoGate {
 public:
  struct Config : IoTunerConfig {
    std::function<double()> clock;  // seconds; null: the steady clock (tests give their own)
  };

  explicit IoTuner(Config config);

  IoTuner(const IoTuner&) = delete;
  IoTuner& operator=(const IoTuner&) = delete;

  void Acquire() override;
  void Release(uint64_t bytes) override;

  int depth() const override;
  // The best depth found so far (depth() differs from it while a neighbour is probed).
  int home_depth() const;
  int max_depth() const { return core_.max_depth(); }
  bool fixed() const { return core_.fixed(); }
  // The running mean throughput (bytes/s) measured at `depth`, 0 where never measured.
  double throughput(int depth) const;
  // Intervals measured so far.
  int64_t intervals() const;

 private:
  double Now() const;

  std::function<double()> clock_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  TunerCore core_;
};

// Seconds on the steady clock (CLOCK_MONOTONIC: the same in every process of a machine).
double SteadySeconds();

}  // namespace sp

#endif  // SHARDPOINT_EXEC_IO_TUNER_H_
