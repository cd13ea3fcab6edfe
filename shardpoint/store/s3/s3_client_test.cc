// S3Client against a real S3 server (SeaweedFS on 127.0.0.1, s3_test_server.h), and its pure
// helpers on their own.
#include "shardpoint/store/s3/s3_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "shardpoint/store/s3/s3_fault_proxy.h"
#include "shardpoint/store/s3/s3_store.h"
#include "shardpoint/store/s3/s3_test_server.h"

namespace sp {
namespace {

using ::testing::HasSubstr;

TEST(S3HelpersTest, UriEncodingBase64AndXml) {
  EXPECT_EQ(UriEncode("a b/c~d_e.f-g+h%", false), "a%20b/c~d_e.f-g%2Bh%25");
  EXPECT_EQ(UriEncode("a/b", true), "a%2Fb");
  EXPECT_EQ(UriEncode("\xc3\xa9", false), "%C3%A9");
  EXPECT_EQ(Base64(AsBytes("")), "");
  EXPECT_EQ(Base64(AsBytes("f")), "Zg==");
  EXPECT_EQ(Base64(AsBytes("fo")), "Zm8=");
  EXPECT_EQ(Base64(AsBytes("foo")), "Zm9v");
  EXPECT_EQ(Base64(AsBytes("foobar")), "Zm9vYmFy");
  const std::string xml =
      "<R><Key>a&amp;b&lt;&gt;&quot;&apos;&#34;&#x41;&#233;</Key><Key></Key><Key>x&bogus;</Key>"
      "<Size>12</Size></R>";
  EXPECT_EQ(XmlElements(xml, "Key"),
            (std::vector<std::string>{"a&b<>\"'\"A\xc3\xa9", "", "x&bogus;"}));
  EXPECT_EQ(XmlElements(xml, "Size"), std::vector<std::string>{"12"});
  EXPECT_TRUE(XmlElements(xml, "None").empty());
  EXPECT_TRUE(XmlElements("<Key>unclosed", "Key").empty());
  // Store paths to keys: plain paths, the engine's URLs, and URLs as normalization leaves them.
  EXPECT_EQ(S3KeyOf("/run/./step-1//d.safetensors"), "run/step-1/d.safetensors");
  EXPECT_EQ(S3KeyOf("s3://bucket/run/step-1"), "run/step-1");
  EXPECT_EQ(S3KeyOf("s3:/bucket/run"), "run");
  EXPECT_EQ(S3KeyOf("s3://bucket"), "");
  EXPECT_EQ(S3KeyOf("/"), "");
}

class S3ClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<testing::S3TestServer>> server = testing::S3TestServer::Start();
    if (server.ok()) {
      server_ = std::move(*server).release();
    } else {
      failure_ = server.status();
    }
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (failure_.code() == StatusCode::kNotFound) GTEST_SKIP() << failure_.message();
    ASSERT_NE(server_, nullptr) << failure_;
    client_ = std::make_unique<S3Client>(server_->config());
    bucket_ = "bucket-" + std::to_string(next_bucket_++);
    Status created = client_->CreateBucket(bucket_);
    ASSERT_TRUE(created.ok()) << created;
  }

  static testing::S3TestServer* server_;
  static Status failure_;  // why no server started
  static int next_bucket_;
  std::unique_ptr<S3Client> client_;
  std::string bucket_;
};

testing::S3TestServer* S3ClientTest::server_ = nullptr;
Status S3ClientTest::failure_;
int S3ClientTest::next_bucket_ = 1;

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST_F(S3ClientTest, PutGetRangeHeadListDelete) {
  const std::string bytes = RandomBytes(300000, 1);
  const std::string key = "dir/sub dir/obj+1.bin";  // a space and a '+' travel encoded
  ASSERT_TRUE(client_->PutObject(bucket_, key, AsBytes(bytes)).ok());
  ASSERT_TRUE(client_->PutObject(bucket_, "dir/b", AsBytes("small")).ok());
  ASSERT_TRUE(client_->PutObject(bucket_, "top", AsBytes("")).ok());
  Result<uint64_t> size = client_->HeadObject(bucket_, key);
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(*size, bytes.size());
  Result<std::string> whole = client_->GetObject(bucket_, key);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(*whole == bytes);
  std::string range(1000, '\0');
  ASSERT_TRUE(client_->GetRange(bucket_, key, 123457, MutableByteView(
                                    reinterpret_cast<std::byte*>(range.data()), range.size()))
                  .ok());
  EXPECT_TRUE(range == bytes.substr(123457, 1000));
  Status past = client_->GetRange(bucket_, key, bytes.size() - 10,
                                  MutableByteView(reinterpret_cast<std::byte*>(range.data()), 20));
  EXPECT_FALSE(past.ok());

  Result<S3Listing> all = client_->ListObjects(bucket_, "", "", "");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->objects.size(), 3u);
  EXPECT_EQ(all->objects[0].key, "dir/b");
  EXPECT_EQ(all->objects[1].key, key);
  EXPECT_EQ(all->objects[1].size, bytes.size());
  Result<S3Listing> top = client_->ListObjects(bucket_, "", "/", "");
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->prefixes, std::vector<std::string>{"dir/"});
  ASSERT_EQ(top->objects.size(), 1u);
  EXPECT_EQ(top->objects[0].key, "top");

  ASSERT_TRUE(client_->DeleteObject(bucket_, key).ok());
  EXPECT_TRUE(client_->DeleteObject(bucket_, key).ok()) << "deleting twice succeeds";
  Result<uint64_t> gone = client_->HeadObject(bucket_, key);
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound);
  Result<std::string> missing = client_->GetObject(bucket_, "no/such");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("GET s3://" + bucket_ + "/no/such: HTTP 404"));
}

TEST_F(S3ClientTest, ConditionalPutsAndCopies) {
  const S3Condition absent{.if_none_match = true, .if_match = {}};
  ASSERT_TRUE(client_->PutObject(bucket_, "m", AsBytes("first"), absent).ok());
  Status again = client_->PutObject(bucket_, "m", AsBytes("second"), absent);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again;
  EXPECT_THAT(again.message(), HasSubstr("PUT s3://" + bucket_ + "/m: HTTP 412"));
  EXPECT_EQ(client_->GetObject(bucket_, "m").value(), "first");
  // If-Match: replaced only while the ETag is the one read.
  Result<S3ObjectInfo> first = client_->StatObject(bucket_, "m");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->size, 5u);
  ASSERT_FALSE(first->etag.empty());
  ASSERT_TRUE(client_->PutObject(bucket_, "m", AsBytes("third"), {.if_match = first->etag}).ok());
  Result<S3ObjectInfo> third = client_->StatObject(bucket_, "m");
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_NE(third->etag, first->etag);
  Status stale = client_->PutObject(bucket_, "m", AsBytes("fourth"), {.if_match = first->etag});
  EXPECT_EQ(stale.code(), StatusCode::kAlreadyExists) << stale;
  EXPECT_EQ(client_->GetObject(bucket_, "m").value(), "third");
  Status nothing = client_->PutObject(bucket_, "none", AsBytes("x"), {.if_match = first->etag});
  EXPECT_FALSE(nothing.ok());
  EXPECT_EQ(client_->HeadObject(bucket_, "none").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(client_->CopyObject(bucket_, "m", "m2").ok());
  EXPECT_EQ(client_->GetObject(bucket_, "m2").value(), "third");
}

TEST_F(S3ClientTest, MultipartUploadsCompleteOrAbort) {
  const std::string a = RandomBytes(5 << 20, 2);
  const std::string b = RandomBytes(12345, 3);
  Result<std::string> id = client_->CreateMultipartUpload(bucket_, "big");
  ASSERT_TRUE(id.ok()) << id.status();
  // Parts sent from two threads at once, out of order.
  Result<std::string> etag2 = InternalError("unset");
  std::thread second([&] { etag2 = client_->UploadPart(bucket_, "big", *id, 2, AsBytes(b)); });
  Result<std::string> etag1 = client_->UploadPart(bucket_, "big", *id, 1, AsBytes(a));
  second.join();
  ASSERT_TRUE(etag1.ok()) << etag1.status();
  ASSERT_TRUE(etag2.ok()) << etag2.status();
  ASSERT_TRUE(client_->CompleteMultipartUpload(bucket_, "big", *id, {{1, *etag1}, {2, *etag2}})
                  .ok());
  Result<std::string> whole = client_->GetObject(bucket_, "big");
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(*whole == a + b);

  // Completing is the conditional step of a multipart write.
  Result<std::string> again = client_->CreateMultipartUpload(bucket_, "big");
  ASSERT_TRUE(again.ok()) << again.status();
  Result<std::string> part = client_->UploadPart(bucket_, "big", *again, 1, AsBytes(b));
  ASSERT_TRUE(part.ok()) << part.status();
  Status lost = client_->CompleteMultipartUpload(bucket_, "big", *again, {{1, *part}},
                                                 {.if_none_match = true, .if_match = {}});
  EXPECT_EQ(lost.code(), StatusCode::kAlreadyExists) << lost;
  EXPECT_TRUE(client_->GetObject(bucket_, "big").value() == a + b);
  Result<S3ObjectInfo> big = client_->StatObject(bucket_, "big");
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(client_->CompleteMultipartUpload(bucket_, "big", *again, {{1, *part}},
                                               {.if_match = big->etag})
                  .ok());
  EXPECT_TRUE(client_->GetObject(bucket_, "big").value() == b);

  Result<std::string> aborted = client_->CreateMultipartUpload(bucket_, "never");
  ASSERT_TRUE(aborted.ok());
  ASSERT_TRUE(client_->UploadPart(bucket_, "never", *aborted, 1, AsBytes(b)).ok());
  ASSERT_TRUE(client_->AbortMultipartUpload(bucket_, "never", *aborted).ok());
  EXPECT_EQ(client_->HeadObject(bucket_, "never").status().code(), StatusCode::kNotFound);
}

// The requests of one caller run at once on one event loop, and a connection outlives its
// request. Counted by a proxy in front of the server: sequential GETs reuse one connection, so a
// second connection opened by GetRanges means two of its GETs were in flight together.
TEST_F(S3ClientTest, RangesOfOneCallRunAtOnceOnOneLoopAndConnectionsAreReused) {
  const std::string bytes = RandomBytes(16 << 20, 21);
  ASSERT_TRUE(client_->PutObject(bucket_, "ranges", AsBytes(bytes)).ok());
  Result<std::unique_ptr<testing::S3FaultProxy>> proxy =
      testing::S3FaultProxy::Start(server_->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  S3Config via = server_->config();
  via.endpoint = (*proxy)->endpoint();
  S3ClientOptions one_loop;
  one_loop.event_loops = 1;
  S3Client client(via, one_loop);

  std::string got(bytes.size(), '\0');
  auto view = [&](uint64_t at, uint64_t n) {
    return MutableByteView(reinterpret_cast<std::byte*>(got.data()) + at, n);
  };
  constexpr uint64_t kPiece = 1 << 20;
  for (uint64_t at = 0; at < 4 * kPiece; at += kPiece) {
    ASSERT_TRUE(client.GetRange(bucket_, "ranges", at, view(at, kPiece)).ok());
  }
  EXPECT_EQ((*proxy)->connections(), 1u) << "one caller's GETs one after the other share one";

  // Sixteen GETs from this one thread, each split over two pieces at an odd point.
  std::vector<S3RangeRead> reads;
  for (uint64_t at = 0; at < bytes.size(); at += kPiece) {
    reads.push_back(S3RangeRead{at, {view(at, 1001), view(at + 1001, kPiece - 1001)}});
  }
  std::fill(got.begin(), got.end(), '\0');
  Status read = client.GetRanges(bucket_, "ranges", reads);
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_TRUE(got == bytes);
  EXPECT_GT((*proxy)->connections(), 1u) << "the GETs of one call did not overlap";
  EXPECT_LE((*proxy)->connections(), 1u + reads.size());

  // A read past the end fails, named, and the others' bytes still arrive.
  reads = {S3RangeRead{0, {view(0, kPiece)}},
           S3RangeRead{bytes.size() - 10, {view(kPiece, 20)}}};
  Status past = client.GetRanges(bucket_, "ranges", reads);
  EXPECT_FALSE(past.ok());
  EXPECT_THAT(past.message(), HasSubstr("s3://" + bucket_ + "/ranges"));
}

// Parts sent without waiting, from one thread, complete an object; a part of an upload that does
// not exist reaches its callback as an error naming the object.
TEST_F(S3ClientTest, PartsSentWithoutWaitingCompleteAnObject) {
  const std::string a = RandomBytes(5 << 20, 4), b = RandomBytes(5 << 20, 5),
                    c = RandomBytes(777, 6);
  Result<std::string> id = client_->CreateMultipartUpload(bucket_, "async");
  ASSERT_TRUE(id.ok()) << id.status();
  std::mutex mu;
  std::condition_variable ended;
  std::map<int, Result<std::string>> etags;
  const std::string* parts[] = {&a, &b, &c};
  for (int n = 3; n >= 1; --n) {  // out of order
    client_->UploadPartAsync(bucket_, "async", *id, n, AsBytes(*parts[n - 1]),
                             [&, n](Result<std::string> etag) {
                               std::lock_guard<std::mutex> lock(mu);
                               etags.emplace(n, std::move(etag));
                               ended.notify_all();
                             });
  }
  client_->UploadPartAsync(bucket_, "async", "no-such-upload", 1, AsBytes(c),
                           [&](Result<std::string> etag) {
                             std::lock_guard<std::mutex> lock(mu);
                             etags.emplace(0, std::move(etag));
                             ended.notify_all();
                           });
  {
    std::unique_lock<std::mutex> lock(mu);
    ended.wait(lock, [&] { return etags.size() == 4; });
  }
  S3Parts list;
  for (int n = 1; n <= 3; ++n) {
    ASSERT_TRUE(etags.at(n).ok()) << etags.at(n).status();
    list.emplace_back(n, *etags.at(n));
  }
  EXPECT_FALSE(etags.at(0).ok());
  EXPECT_THAT(etags.at(0).status().message(), HasSubstr("PUT s3://" + bucket_ + "/async"));
  ASSERT_TRUE(client_->CompleteMultipartUpload(bucket_, "async", *id, list).ok());
  EXPECT_TRUE(client_->GetObject(bucket_, "async").value() == a + b + c);
}

// An https:// endpoint: its certificate is checked against the CA bundle (AWS_CA_BUNDLE, the
// profile's ca_bundle), and refused when it does not chain to one the client trusts.
TEST_F(S3ClientTest, HttpsEndpointsAreVerifiedAgainstTheCaBundle) {
  S3Config tls = server_->config();
  tls.endpoint = server_->https_endpoint();
  tls.ca_bundle = server_->ca_file();
  S3Client client(tls);
  const std::string bytes = RandomBytes(3 << 20, 11);
  ASSERT_TRUE(client.PutObject(bucket_, "tls/object", AsBytes(bytes)).ok());
  Result<std::string> back = client.GetObject(bucket_, "tls/object");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == bytes);

  tls.ca_bundle.clear();  // the system's certificates: a self-signed one is not among them
  S3ClientOptions once;
  once.max_attempts = 1;
  S3Client untrusting(tls, once);
  Result<std::string> refused = untrusting.GetObject(bucket_, "tls/object");
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("GET s3://" + bucket_ + "/tls/object: SSL certificate problem"));
}

TEST_F(S3ClientTest, WrongCredentialsArePermissionDeniedNamingTheObject) {
  S3Config wrong = server_->config();
  wrong.credentials.secret_access_key = "not-the-secret";
  S3Client client(wrong);
  Status put = client.PutObject(bucket_, "x", AsBytes("x"));
  EXPECT_EQ(put.code(), StatusCode::kPermissionDenied) << put;
  EXPECT_THAT(put.message(), HasSubstr("PUT s3://" + bucket_ + "/x: HTTP 403"));
}

TEST_F(S3ClientTest, AServerThatIsGoneFailsAfterTheRetriesWithoutHanging) {
  S3Config nowhere = server_->config();
  nowhere.endpoint = "http://127.0.0.1:9";  // discard: nothing listens
  S3ClientOptions options;
  options.max_attempts = 3;
  options.first_backoff = std::chrono::milliseconds(10);
  S3Client client(nowhere, options);
  Status put = client.PutObject(bucket_, "x", AsBytes("x"));
  EXPECT_EQ(put.code(), StatusCode::kUnavailable) << put;
  EXPECT_THAT(put.message(), HasSubstr("(after 3 attempts)"));
  EXPECT_EQ(client.requests_sent(), 3u);
}

}  // namespace
}  // namespace sp
