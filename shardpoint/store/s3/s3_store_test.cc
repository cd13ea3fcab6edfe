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

// The one server of this test binary, started on first use; null when it could not be, with
// why in `failure` (kNotFound: no weed binary, so the tests skip; anything else fails them).
testing::S3TestServer* Server(Status* failure) {
  static Status why;
  // Destroyed (the server killed) when the process exits.
  using Server = std::unique_ptr<testing::S3TestServer>;
  static Server server = []() -> Server {
    Result<std::unique_ptr<testing::S3TestServer>> started = testing::S3TestServer::Start();
    if (!started.ok()) {
      why = started.status();
      return nullptr;
    }
    S3Client client((*started)->config());
    why = client.CreateBucket(kBucket);
    if (!why.ok()) return nullptr;
    return std::move(*started);
  }();
  if (failure != nullptr) *failure = why;
  return server.get();
}

Result<StoreTestEnv> MakeS3Env() {
  static std::atomic<int> next{0};
  Status why;
  testing::S3TestServer* server = Server(&why);
  if (server == nullptr) return why;
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
    Status why;
    if (Server(&why) == nullptr && why.code() == StatusCode::kNotFound) {
      return std::string(why.message());
    }
    return std::nullopt;
  };
  return param;
}

INSTANTIATE_TEST_SUITE_P(S3, StoreConformanceTest, ::testing::Values(S3Param()),
                         StoreConformanceParamName);

}  // namespace
}  // namespace sp
