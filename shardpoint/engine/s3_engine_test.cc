// Checkpoints on S3 (store/s3/): the engine given an s3:// URL saves, loads into another layout,
// overwrites and verifies against a real S3 server (SeaweedFS on 127.0.0.1, configured through
// the AWS environment variables as a job would be). Skips when no server can be started.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/manage/retention.h"
#include "shardpoint/store/open_store.h"
#include "shardpoint/store/s3/s3_client.h"
#include "shardpoint/store/s3/s3_test_server.h"
#include "shardpoint/testing/hook_store.h"
#include "shardpoint/testing/split_matrix.h"

namespace sp {
namespace {

class S3EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<testing::S3TestServer>> server = testing::S3TestServer::Start();
    if (!server.ok()) {
      failure_ = server.status();
      return;
    }
    server_ = std::move(*server).release();
    ::setenv("AWS_ENDPOINT_URL", server_->endpoint().c_str(), 1);
    ::setenv("AWS_ACCESS_KEY_ID", testing::S3TestServer::kAccessKey, 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", testing::S3TestServer::kSecretKey, 1);
    ::setenv("AWS_CONFIG_FILE", "/nonexistent", 1);
    ::setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent", 1);
    S3Client client(server_->config());
    failure_ = client.CreateBucket("ckpts");
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (failure_.code() == StatusCode::kNotFound) GTEST_SKIP() << failure_.message();
    ASSERT_TRUE(failure_.ok()) << failure_;
  }

  static testing::S3TestServer* server_;
  static Status failure_;  // why no server serves (kNotFound: no weed binary)
};

testing::S3TestServer* S3EngineTest::server_ = nullptr;
Status S3EngineTest::failure_;

constexpr int64_t kRows = 96, kCols = 1000;

// w [96, 1000] row-split over 4 ranks, as step `step`.
Status SaveStep(const std::string& url, int step, bool overwrite) {
  return testing::FirstError(testing::SaveRowSplit(url, step, kRows, kCols, 4, nullptr, overwrite));
}

// Loads w column-split over 3 ranks and checks every element of step `step`.
Status LoadAndCheck(const std::string& url, int step) {
  return testing::LoadColumnSplitAndCheck(url, step, kRows, kCols, 3, nullptr);
}

TEST_F(S3EngineTest, SaveLoadReshardedOverwriteAndVerify) {
  const std::string url = "s3://ckpts/run-1/step-100";
  ASSERT_TRUE(SaveStep(url, 100, false).ok());
  Status loaded = LoadAndCheck(url, 100);
  ASSERT_TRUE(loaded.ok()) << loaded;
  Status again = SaveStep(url, 101, false);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again;
  ASSERT_TRUE(SaveStep(url, 101, true).ok());
  loaded = LoadAndCheck(url, 101);
  ASSERT_TRUE(loaded.ok()) << loaded;
  Result<VerifyReport> report = Verify(url);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << (report->defects.empty() ? "" : report->defects.front());
  EXPECT_GT(report->bytes_checked, static_cast<uint64_t>(kRows * kCols * 4) - 1);
}

// A load into another layout reads each stored byte once, although its ranks run on one machine:
// on object storage every read is a request and no page cache serves a second one, so the rank
// that reads a chunk sends the others their columns. Reading for themselves, each of the 3 ranks
// reads every row whole for its third of the columns.
TEST_F(S3EngineTest, AReshardedLoadReadsEachStoredByteOnce) {
  const std::string url = "s3://ckpts/shared-reads";
  ASSERT_TRUE(SaveStep(url, 7, false).ok());
  const uint64_t stored = kRows * kCols * sizeof(float);
  std::vector<uint64_t> shared, alone;
  Status loaded = testing::LoadColumnSplitAndCheck(url, 7, kRows, kCols, 3, nullptr, &shared);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(shared[0] + shared[1] + shared[2], stored);
  loaded = testing::LoadColumnSplitAndCheck(url, 7, kRows, kCols, 3, nullptr, &alone, false);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(alone[0] + alone[1] + alone[2], 3 * stored);
}

// The same load by ranks on separate machines: the reader of each chunk sends the others their
// columns through the communicator, round by round, and each stored byte is still read once.
TEST_F(S3EngineTest, AReshardedLoadAcrossMachinesReadsEachStoredByteOnce) {
  const std::string url = "s3://ckpts/shared-reads-across-machines";
  ASSERT_TRUE(SaveStep(url, 8, false).ok());
  std::vector<uint64_t> read;
  Status loaded = testing::LoadColumnSplitAndCheck(url, 8, kRows, kCols, 3, nullptr, &read,
                                                   std::nullopt, /*across_machines=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(read[0] + read[1] + read[2], kRows * kCols * sizeof(float));
}

// Saves w of step `step` from one rank through `store` (the URL's own when null).
Status SaveOneRank(const std::string& url, int step, bool overwrite, Store* store) {
  return testing::FirstError(testing::SaveRowSplit(url, step, kRows, kCols, 1, store, overwrite));
}

// Two saves racing to one path: the one that checked first but commits second loses, whether the
// path was empty (If-None-Match) or held a checkpoint both replace (If-Match on its ETag), and the
// winner's checkpoint is the one that loads.
TEST_F(S3EngineTest, OfTwoRacingSavesOnlyOneCommits) {
  for (bool overwrite : {false, true}) {
    SCOPED_TRACE(overwrite ? "overwrite" : "new path");
    const std::string url = std::string("s3://ckpts/race/") + (overwrite ? "old" : "new");
    if (overwrite) {
      ASSERT_TRUE(SaveOneRank(url, 1, false, nullptr).ok());
    }
    Result<std::unique_ptr<Store>> s3 = OpenStore(url);
    ASSERT_TRUE(s3.ok()) << s3.status();
    Status other;
    // The other save runs whole after this one planned (and read what it must replace).
    testing::HookStore racing(s3->get(), [&] { other = SaveOneRank(url, 3, overwrite, nullptr); });
    Status lost = SaveOneRank(url, 2, overwrite, &racing);
    ASSERT_TRUE(other.ok()) << other;
    EXPECT_EQ(lost.code(), StatusCode::kAlreadyExists) << lost;
    EXPECT_THAT(lost.message(),
                ::testing::HasSubstr(
                    "the save to " + url + " was not committed: another save " +
                    (overwrite ? "replaced the checkpoint there" : "committed a checkpoint there") +
                    " while this one was writing"));
    EXPECT_THAT(lost.message(), ::testing::HasSubstr("HTTP 412"));
    Status loaded = LoadAndCheck(url, 3);
    EXPECT_TRUE(loaded.ok()) << loaded;
    Result<VerifyReport> report = Verify(url);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->ok()) << (report->defects.empty() ? "" : report->defects.front());
    // The next save there removes what the lost one left.
    ASSERT_TRUE(SaveOneRank(url, 4, true, nullptr).ok());
    Result<std::vector<DirEntry>> files = (*s3)->ListDir(url);
    ASSERT_TRUE(files.ok()) << files.status();
    EXPECT_EQ(files->size(), 2u);  // the metadata and one data file
    EXPECT_TRUE(LoadAndCheck(url, 4).ok());
  }
}

// Uploads that a killed save left unfinished (invisible, but kept and billed by the bucket) are
// aborted by the next save that commits in their directory, and by deleting the checkpoint;
// those of a directory below it are left alone.
TEST_F(S3EngineTest, UnfinishedUploadsAreAbortedByTheNextCommitAndByDeletion) {
  S3Client client(server_->config());
  auto leave_upload = [&](const std::string& key) {
    Result<std::string> id = client.CreateMultipartUpload("ckpts", key);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(client.UploadPart("ckpts", key, *id, 1, AsBytes(std::string(1000, 'x'))).ok());
  };
  auto unfinished = [&](const std::string& prefix) {
    Result<std::vector<S3Upload>> uploads = client.ListMultipartUploads("ckpts", prefix);
    EXPECT_TRUE(uploads.ok()) << uploads.status();
    std::vector<std::string> keys;
    if (uploads.ok()) {
      for (const S3Upload& u : *uploads) keys.push_back(u.key);
    }
    return keys;
  };
  leave_upload("left/step-1/d-killed-r00000-f000.safetensors");
  leave_upload("left/step-1/sub/other.bin");
  leave_upload("left/step-10/d-killed-r00000-f000.safetensors");
  ASSERT_EQ(unfinished("left/").size(), 3u);
  ASSERT_TRUE(SaveOneRank("s3://ckpts/left/step-1", 1, false, nullptr).ok());
  EXPECT_THAT(unfinished("left/"),
              ::testing::UnorderedElementsAre("left/step-1/sub/other.bin",
                                              "left/step-10/d-killed-r00000-f000.safetensors"));
  leave_upload("left/step-1/d-killed-again-r00000-f000.safetensors");
  ASSERT_TRUE(DeleteCheckpoint("s3://ckpts/left/step-1").ok());
  EXPECT_THAT(unfinished("left/"),
              ::testing::UnorderedElementsAre("left/step-1/sub/other.bin",
                                              "left/step-10/d-killed-r00000-f000.safetensors"));
}

TEST_F(S3EngineTest, MissingCheckpointAndBadUrlsAreClearErrors) {
  LoadState state;
  Result<LoadResult> missing = Load(state, "s3://ckpts/none/step-1", LoadOptions{});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status();
  Result<std::unique_ptr<Store>> bad = OpenStore("s3://A_Bucket/x");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("'A_Bucket' is not an S3 bucket name"));
}

}  // namespace
}  // namespace sp
