#include "shardpoint/exec/io_tuner.h"

#include <algorithm>
#include <chrono>

namespace sp {

DepthController::DepthController(int max_depth, int start_depth, double tolerance,
                                 int probe_every)
    : max_depth_(std::clamp(max_depth, 1, kMaxIoDepth)),
      depth_(std::clamp(start_depth, 1, max_depth_)),
      home_(depth_),
      tolerance_(tolerance),
      probe_every_(std::max(1, probe_every)) {}

double DepthController::throughput(int depth) const {
  return depth >= 1 && depth <= max_depth_ ? smoothed_[depth] : 0.0;
}

int DepthController::Observe(double bytes_per_second) {
  // Home is measured again and again and smoothed; a probe's one fresh measurement replaces what
  // was measured there before (that may be long ago, on a device that has changed since).
  double& s = smoothed_[depth_];
  s = depth_ != home_ || s == 0 ? bytes_per_second : (s + bytes_per_second) / 2;
  auto in_range = [&](int d) { return d >= 1 && d <= max_depth_; };
  if (depth_ != home_) {
    // A probe ends. A deeper neighbour must beat home by more than the noise; a shallower one
    // (fewer threads and buffers busy) may be as good within the noise, unless that would drift
    // more than the noise below the best measured anywhere. The climb goes on the same way at
    // once; otherwise back home, and the other neighbour is probed next time.
    const double home = smoothed_[home_];
    const double best = *std::max_element(smoothed_ + 1, smoothed_ + max_depth_ + 1);
    const bool better = depth_ > home_ ? s > home * (1 + tolerance_)
                                       : s >= home * (1 - tolerance_) && s >= best * (1 - tolerance_);
    if (better) {
      home_ = depth_;
      steady_ = 0;
      if (in_range(home_ + direction_)) depth_ = home_ + direction_;
      return depth_;
    }
    depth_ = home_;
    direction_ = -direction_;
    steady_ = 0;
    return depth_;
  }
  // At home: probe a neighbour never measured at once, the others every probe_every intervals.
  ++steady_;
  int next = home_ + direction_;
  if (!in_range(next)) {
    direction_ = -direction_;
    next = home_ + direction_;
  }
  if (!in_range(next)) return depth_;  // max_depth 1: nothing to try
  const int other = home_ - direction_;
  if (smoothed_[next] != 0 && in_range(other) && smoothed_[other] == 0) {
    direction_ = -direction_;
    next = other;
  }
  if (smoothed_[next] == 0 || steady_ >= probe_every_) {
    steady_ = 0;
    depth_ = next;
  }
  return depth_;
}

namespace {

IoTunerConfig Normalized(IoTunerConfig config) {
  config.max_depth = std::clamp(config.max_depth, 1, kMaxIoDepth);
  if (config.start_depth <= 0) {
    config.start_depth = config.fixed ? config.max_depth : std::min(config.max_depth, 4);
  }
  config.start_depth = std::min(config.start_depth, config.max_depth);
  return config;
}

}  // namespace

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

TunerCore::TunerCore(IoTunerConfig config, double now)
    : config_(Normalized(config)),
      controller_(config_.max_depth, config_.start_depth, config_.tolerance, config_.probe_every),
      last_event_(now) {}

uint64_t TunerCore::Take(double now) {
  Account(now);
  return taken_++;
}

bool TunerCore::Full() const {
  return settling_ == 0 && taken_ - ended_ >= static_cast<uint64_t>(controller_.depth());
}

void TunerCore::Account(double now) {
  if (Full()) {
    interval_seconds_ += std::max(0.0, now - last_event_);
  }
  last_event_ = now;
}

void TunerCore::Begin(double now) {
  Account(now);
  ++begun_;
}

bool TunerCore::End(double now, uint64_t bytes) {
  const bool full = Full();
  Account(now);
  if (full) interval_bytes_ += bytes;
  if (settling_ > 0) --settling_;
  ++ended_;
  if (config_.fixed || interval_bytes_ < config_.interval_bytes ||
      interval_seconds_ < config_.interval_seconds) {
    return false;
  }
  const int before = controller_.depth();
  controller_.Observe(static_cast<double>(interval_bytes_) / interval_seconds_);
  ++intervals_;
  interval_bytes_ = 0;
  interval_seconds_ = 0;
  if (controller_.depth() == before) return false;
  // The reads running now began at the old depth: their completions are not measured.
  settling_ = begun_ - ended_;
  return true;
}

void TunerCore::Reclaim(uint64_t begun, uint64_t waiting) {
  const uint64_t settled = std::min(settling_, begun);
  settling_ -= settled;
  begun_ += waiting;
  ended_ += begun + waiting;
}

IoTuner::IoTuner(Config config)
    : clock_(std::move(config.clock)),
      core_(static_cast<const IoTunerConfig&>(config), clock_ ? clock_() : SteadySeconds()) {}

double IoTuner::Now() const { return clock_ ? clock_() : SteadySeconds(); }

int IoTuner::depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return core_.depth();
}

int IoTuner::home_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return core_.home_depth();
}

double IoTuner::throughput(int depth) const {
  std::lock_guard<std::mutex> lock(mu_);
  return core_.throughput(depth);
}

int64_t IoTuner::intervals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return core_.intervals();
}

void IoTuner::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = core_.Take(Now());
  cv_.wait(lock, [&] { return core_.Granted(ticket); });
  core_.Begin(Now());
}

void IoTuner::Release(uint64_t bytes) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    core_.End(Now(), bytes);
    wake = core_.waiting() > 0;
  }
  // Every waiter checks its own ticket: the next in line, and more when the depth grew.
  if (wake) cv_.notify_all();
}

}  // namespace sp
