#include "shardpoint/store/s3/s3_fault_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string_view>

namespace sp::testing {
namespace {

// Closes with an RST rather than a FIN.
void ResetSocket(int fd) {
  struct linger abort_close = {1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof(abort_close));
  ::close(fd);
}

bool SendAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t sent = ::send(fd, data, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    data += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

// Waits up to `ms` for `fd` to be readable, then reads; <= 0 on end, error or timeout.
ssize_t ReadSome(int fd, char* buffer, size_t n, int ms) {
  pollfd p = {fd, POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&p, 1, ms);
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0) return -1;
  ssize_t got;
  do {
    got = ::recv(fd, buffer, n, 0);
  } while (got < 0 && errno == EINTR);
  return got;
}

// The Content-Length of a request head (0 when it has none).
uint64_t ContentLength(std::string head) {
  std::transform(head.begin(), head.end(), head.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const size_t at = head.find("\r\ncontent-length:");
  if (at == std::string::npos) return 0;
  return std::strtoull(head.c_str() + at + 17, nullptr, 10);
}

}  // namespace

Result<std::unique_ptr<S3FaultProxy>> S3FaultProxy::Start(int upstream_port, uint64_t seed) {
  std::unique_ptr<S3FaultProxy> proxy(new S3FaultProxy());
  proxy->upstream_port_ = upstream_port;
  proxy->rng_.seed(seed);
  proxy->listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (proxy->listener_ < 0) return UnavailableError("fault proxy: socket: " + std::string(std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (::bind(proxy->listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(proxy->listener_, 128) != 0 ||
      ::getsockname(proxy->listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0 ||
      ::pipe2(proxy->wake_, O_CLOEXEC) != 0) {
    return UnavailableError("fault proxy: listen: " + std::string(std::strerror(errno)));
  }
  proxy->port_ = ntohs(address.sin_port);
  proxy->acceptor_ = std::thread([p = proxy.get()] { p->Accept(); });
  return proxy;
}

S3FaultProxy::~S3FaultProxy() {
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
  }
  if (wake_[1] >= 0) {
    const char byte = 0;
    [[maybe_unused]] ssize_t n = ::write(wake_[1], &byte, 1);
  }
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers.swap(workers_);
  }
  for (std::thread& t : workers) t.join();
  for (int fd : {listener_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void S3FaultProxy::SetFaults(const ProxyFaults& faults) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_ = faults;
}

bool S3FaultProxy::Register(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  open_.push_back(fd);
  return true;
}

void S3FaultProxy::Unregister(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  open_.erase(std::remove(open_.begin(), open_.end(), fd), open_.end());
}

void S3FaultProxy::Accept() {
  while (true) {
    pollfd fds[2] = {{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    if (!Register(client)) {
      ::close(client);
      return;
    }
    ++connections_;
    std::lock_guard<std::mutex> lock(mu_);
    workers_.emplace_back([this, client] { Serve(client); });
  }
}

// Each request meets the dice when its first bytes arrive: a client sends its next request on a
// connection only once the answer to the previous one has come (HTTP/1.1 without pipelining, as
// curl sends), so new bytes from the client after bytes from the server start a new request,
// unless those were an interim "HTTP/1.1 1xx" answer (100 Continue, after which the client sends
// the body of the same request).
void S3FaultProxy::Serve(int client) {
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(upstream_port_));
  if (server < 0 || !Register(server) ||
      ::connect(server, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (server >= 0) {
      Unregister(server);
      ::close(server);
    }
    Unregister(client);
    ResetSocket(client);  // the server is down: the client sees its connection reset
    return;
  }
  uint64_t passed = 0;
  uint64_t reset_after = std::numeric_limits<uint64_t>::max();
  bool new_request = true;
  bool client_open = true, server_open = true;  // each side still sending
  char buffer[65536];
  bool reset = false;
  while ((client_open || server_open) && !reset) {
    pollfd fds[2] = {{client, static_cast<short>(client_open ? POLLIN : 0), 0},
                     {server, static_cast<short>(server_open ? POLLIN : 0), 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int side = 0; side < 2 && !reset; ++side) {
      if (fds[side].revents == 0) continue;
      const int from = side == 0 ? client : server;
      const int to = side == 0 ? server : client;
      const ssize_t got = ::recv(from, buffer, sizeof(buffer), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        (side == 0 ? client_open : server_open) = false;
        ::shutdown(to, SHUT_WR);
        continue;
      }
      size_t n = static_cast<size_t>(got);
      // An interim answer (100 Continue) comes before the body of the same request.
      if (side == 1 && std::string_view(buffer, n).rfind("HTTP/1.1 1", 0) != 0) {
        new_request = true;
      }
      if (side == 0 && new_request) {
        new_request = false;
        ProxyFaults faults;
        double dice = 0;
        uint64_t at = 0;
        {
          std::lock_guard<std::mutex> lock(mu_);
          faults = faults_;
          dice = std::uniform_real_distribution<double>(0, 1)(rng_);
          at = std::uniform_int_distribution<uint64_t>(
              0, std::max<uint64_t>(faults.reset_within_bytes, 1) - 1)(rng_);
        }
        if (dice < faults.throttle) {
          Unregister(server);
          ::close(server);
          Throttle(client, faults.throttle_status, std::string(buffer, n));
          return;
        }
        reset_after = dice < faults.throttle + faults.reset
                          ? passed + at
                          : std::numeric_limits<uint64_t>::max();
      }
      if (passed + n >= reset_after) {
        n = static_cast<size_t>(reset_after - passed);
        reset = true;
      }
      passed += n;
      if (n > 0 && !SendAll(to, buffer, n)) client_open = server_open = false;
    }
  }
  Unregister(client);
  Unregister(server);
  if (reset) {
    ++resets_;
    ResetSocket(client);
    ResetSocket(server);
  } else {
    ::close(client);
    ::close(server);
  }
}

// Reads the rest of the request that began with `head` (its head, then as many body bytes as it
// declares), answers it and closes the connection.
void S3FaultProxy::Throttle(int client, int status, std::string head) {
  ++throttled_;
  char buffer[65536];
  size_t end = head.find("\r\n\r\n");
  while (end == std::string::npos && head.size() < (1 << 20)) {
    const ssize_t got = ReadSome(client, buffer, sizeof(buffer), 10000);
    if (got <= 0) break;
    head.append(buffer, static_cast<size_t>(got));
    end = head.find("\r\n\r\n");
  }
  if (end != std::string::npos) {
    uint64_t body_left = ContentLength(head.substr(0, end + 2));
    const uint64_t have = head.size() - (end + 4);
    body_left -= std::min(body_left, have);
    while (body_left > 0) {
      const ssize_t got =
          ReadSome(client, buffer, std::min<uint64_t>(sizeof(buffer), body_left), 10000);
      if (got <= 0) break;
      body_left -= static_cast<uint64_t>(got);
    }
    const std::string body =
        status == 429 ? "<Error><Code>TooManyRequests</Code><Message>Please reduce your request "
                        "rate.</Message></Error>"
                      : "<Error><Code>SlowDown</Code><Message>Please reduce your request "
                        "rate.</Message></Error>";
    const std::string answer =
        std::string(status == 429 ? "HTTP/1.1 429 Too Many Requests" : "HTTP/1.1 503 Slow Down") +
        "\r\nContent-Type: application/xml\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\nConnection: close\r\n\r\n" + body;
    SendAll(client, answer.data(), answer.size());
  }
  Unregister(client);
  ::shutdown(client, SHUT_WR);
  ::close(client);
}

}  // namespace sp::testing
