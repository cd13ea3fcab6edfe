#include "shardpoint/exec/io_tuner.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace sp {

DepthController::DepthController(int max_depth, int start_depth, double tolerance,
                                 int probe_every, double confidence)
    : max_depth_(std::clamp(max_depth, 1, kMaxIoDepth)),
      depth_(std::clamp(start_depth, 1, max_depth_)),
      home_(depth_),
      tolerance_(tolerance),
      probe_every_(std::max(1, probe_every)),
      confidence_(std::max(0.0, confidence)) {}

double DepthController::throughput(int depth) const {
  return depth >= 1 && depth <= max_depth_ ? mean_[depth] : 0.0;
}

double DepthController::scatter() const { return std::sqrt(rel_variance_); }

double DepthController::Band(int probe) const {
  // Both means carry the scatter of one reading over the square root of their readings; the
  // scatter is relative, so the band is too.
  const double error =
      std::sqrt(rel_variance_ * (1.0 / readings_[home_] + 1.0 / readings_[probe]));
  return std::max(tolerance_, confidence_ * error);
}

int DepthController::Observe(double bytes_per_second) {
  // Every depth keeps a running mean in which a new reading weighs 1/kMeanWindow once there are
  // that many (older ones fade out, so a drifting device is followed). A reading at home, against
  // home's mean before it, also measures the scatter of one reading.
  if (depth_ == home_ && readings_[home_] > 0 && mean_[home_] > 0) {
    const double deviation = (bytes_per_second - mean_[home_]) / mean_[home_];
    deviations_ = std::min(deviations_ + 1, kScatterWindow);
    rel_variance_ += (deviation * deviation - rel_variance_) / deviations_;
  }
  readings_[depth_] = std::min(readings_[depth_] + 1, kMeanWindow);
  mean_[depth_] += (bytes_per_second - mean_[depth_]) / readings_[depth_];
  auto in_range = [&](int d) { return d >= 1 && d <= max_depth_; };
  if (depth_ != home_) {
    // A probe ends. A deeper neighbour must beat home by more than the band of noise. A shallower
    // one (fewer threads and buffers busy) may be up to the tolerance slower, once the noise
    // beyond the tolerance is counted against it, unless that would drift more than the
    // tolerance below the best measured anywhere. The climb goes on the same way at once;
    // otherwise back home, and the other neighbour is probed next time.
    const double s = mean_[depth_];
    const double home = mean_[home_];
    const double best = *std::max_element(mean_ + 1, mean_ + max_depth_ + 1);
    const double band = Band(depth_);
    const double excess = band - tolerance_;
    const bool better = depth_ > home_ ? s > home * (1 + band)
                                       : s >= home * (1 - tolerance_ + excess) &&
                                             s >= best * (1 - tolerance_);
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
  // At home: probe a neighbour never measured as soon as the scatter is known, the others every
  // probe_every intervals.
  ++steady_;
  int next = home_ + direction_;
  if (!in_range(next)) {
    direction_ = -direction_;
    next = home_ + direction_;
  }
  if (!in_range(next)) return depth_;  // max_depth 1: nothing to try
  const int other = home_ - direction_;
  if (mean_[next] != 0 && in_range(other) && mean_[other] == 0) {
    direction_ = -direction_;
    next = other;
  }
  const bool scatter_known = deviations_ >= kFirstProbeAfter - 1;
  if ((mean_[next] == 0 && scatter_known) || steady_ >= probe_every_) {
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
      controller_(config_.max_depth, config_.start_depth, config_.tolerance, config_.probe_every,
                  config_.confidence),
      last_event_(now) {}

uint64_t TunerCore::Take(double now) {
  Account(now);
  return taken_++;
}

bool TunerCore::Measuring() const { return settling_ == 0 && taken_ > ended_; }

void TunerCore::Account(double now) {
  if (Measuring()) interval_seconds_ += std::max(0.0, now - last_event_);
  last_event_ = now;
}

void TunerCore::Begin(double now) {
  Account(now);
  ++begun_;
}

bool TunerCore::End(double now, uint64_t bytes) {
  const bool measuring = Measuring();
  Account(now);
  if (measuring) interval_bytes_ += bytes;
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
