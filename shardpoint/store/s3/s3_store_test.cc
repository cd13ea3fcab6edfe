// S3Store runs the store conformance suite against a real S3 server (SeaweedFS on 127.0.0.1,
// s3_test_server.h), each test in a fresh directory of one bucket, with parts of the minimum
// size so that multipart uploads are exercised by files of a few MiB.
#include "shardpoint/store/s3/s3_store.h"

#include <atomic>
#include <memory>

#include "shardpoint/store/s3/s3_test_server.h"
#include "shardpoint/store/store_conformance.h"

namespace sp {
namespace {

constexpr const char* kBucket = "conformance";

// The one server of this test binary, started on first use; null (with the reason) when absent.
testing::S3TestServer* Server(std::string* why) {
  static std::string reason;
  static testing::S3TestServer* server = [] {
    Result<std::unique_ptr<testing::S3TestServer>> started = testing::S3TestServer::Start();
    if (!started.ok()) {
      reason = std::string(started.status().message());
      return static_cast<testing::S3TestServer*>(nullptr);
    }
    S3Client client((*started)->config());
    Status created = client.CreateBucket(kBucket);
    if (!created.ok()) {
      reason = "bucket: " + std::string(created.message());
      return static_cast<testing::S3TestServer*>(nullptr);
    }
    return started->release();  // lives until the process ends (killed by its destructor never)
  }();
  if (why != nullptr) *why = reason;
  return server;
}

Result<StoreTestEnv> MakeS3Env() {
  static std::atomic<int> next{0};
  std::string why;
  testing::S3TestServer* server = Server(&why);
  if (server == nullptr) return UnavailableError(why);
  StoreTestEnv env;
  S3StoreOptions options;
  options.part_bytes = uint64_t{5} << 20;
  env.store = std::make_unique<S3Store>(std::make_shared<S3Client>(server->config()), kBucket,
                                        options);
  env.root = "/t" + std::to_string(next++);
  SP_RETURN_IF_ERROR(env.store->CreateDirs(env.root));
  return env;
}

StoreConformanceParam S3Param() {
  StoreConformanceParam param;
  param.name = "S3";
  param.make = MakeS3Env;
  param.handles_follow_renames = false;
  param.unavailable = []() -> std::optional<std::string> {
    std::string why;
    if (Server(&why) == nullptr) return why;
    return std::nullopt;
  };
  return param;
}

INSTANTIATE_TEST_SUITE_P(S3, StoreConformanceTest, ::testing::Values(S3Param()),
                         StoreConformanceParamName);

}  // namespace
}  // namespace sp
