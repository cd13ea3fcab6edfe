// A TCP proxy for fault tests of the S3 client: it listens on 127.0.0.1 and forwards each
// connection to an S3 server (S3TestServer), injecting what object storage does to clients under
// load, chosen per request at random with the probabilities set by SetFaults:
//  - throttling: the request is answered by the proxy itself, 503 SlowDown (or 429) with S3's XML
//    error body and `Connection: close`, without reaching the server;
//  - resets: the connection is forwarded until a random number of bytes (below reset_within_bytes,
//    counted in both directions from the request's start) has passed, then reset (RST) on both
//    sides, whether the request was still being sent or its answer was on the way back (so a
//    request may have taken effect on the server though its client saw only the reset).
// Requests not chosen are forwarded untouched.
//
// Thread-safe. Destruction stops the proxy, resetting every open connection.
#ifndef SHARDPOINT_STORE_S3_S3_FAULT_PROXY_H_
#define SHARDPOINT_STORE_S3_S3_FAULT_PROXY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/base/result.h"

namespace sp::testing {

struct ProxyFaults {
  double throttle = 0;        // probability that a connection is throttled
  int throttle_status = 503;  // 503 (SlowDown) or 429 (Too Many Requests)
  double reset = 0;           // probability that a connection is reset
  uint64_t reset_within_bytes = 1 << 20;
};

class S3FaultProxy {
 public:
  // Forwards to 127.0.0.1:`upstream_port`; `seed` makes the dice repeatable.
  static Result<std::unique_ptr<S3FaultProxy>> Start(int upstream_port, uint64_t seed = 1);
  ~S3FaultProxy();
  S3FaultProxy(const S3FaultProxy&) = delete;
  S3FaultProxy& operator=(const S3FaultProxy&) = delete;

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void SetFaults(const ProxyFaults& faults);

  uint64_t connections() const { return connections_.load(); }
  uint64_t throttled() const { return throttled_.load(); }
  uint64_t resets() const { return resets_.load(); }

 private:
  S3FaultProxy() = default;
  void Accept();
  void Serve(int client);
  void Throttle(int client, int status, std::string head);
  bool Register(int fd);  // false when stopping
  void Unregister(int fd);

  int port_ = 0;
  int upstream_port_ = 0;
  int listener_ = -1;
  int wake_[2] = {-1, -1};  // a pipe that wakes the accepting thread to stop
  std::thread acceptor_;
  std::mutex mu_;
  ProxyFaults faults_;
  std::mt19937_64 rng_;
  bool stopping_ = false;
  std::vector<int> open_;                  // every connection's sockets, reset on stop
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> connections_{0}, throttled_{0}, resets_{0};
};

}  // namespace sp::testing

#endif  // SHARDPOINT_STORE_S3_S3_FAULT_PROXY_H_
