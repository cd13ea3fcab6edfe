// An S3 client on libcurl: the requests an S3 store needs, signed with AWS Signature V4 by curl
// (CURLOPT_AWS_SIGV4), retried on throttling and transient failures.
//
// Requests. Object keys travel URI-encoded (every byte but unreserved characters and '/'), to
// `endpoint/bucket/key` (path-style) or `bucket.host/key` (virtual-hosted), per S3Config. Payloads
// are sent with `x-amz-content-sha256: UNSIGNED-PAYLOAD` and protected instead by
// `x-amz-checksum-crc32c`, which the server checks (a mismatch is its BadDigest, 400). A session
// token goes in `x-amz-security-token`.
//
// Transfers. Every request runs on one of the client's event loops: a thread driving a curl multi
// handle, with the transfers of every caller in flight on it at once (at most
// S3ClientOptions::max_connections over all loops; more wait their turn in order). A loop keeps
// its connections (and TLS sessions) open for the next requests to the same host. A blocking call
// hands its request to a loop and waits for its answer; GetRanges and UploadPartAsync put many
// requests in flight from one calling thread. Retries wait on the loop (a timer), not on a thread.
//
// Failures. 5xx, 429, connection failures, resets and timeouts are retried with exponential
// backoff and full jitter (the first wait S3ClientOptions::first_backoff, doubling to
// max_backoff) until max_attempts or the deadline; then, like any other error, the request fails
// with a Status naming the method, s3://bucket/key, the HTTP status and the server's error code
// and message: 404 (and NoSuchKey / NoSuchBucket) is kNotFound, 403 kPermissionDenied, 412
// kAlreadyExists (a conditional write that lost), 400 and other 4xx kInvalidArgument, 5xx and
// 429 after the retries kUnavailable, a transport failure kUnavailable with curl's message.
//
// Thread-safe.
#ifndef SHARDPOINT_STORE_S3_S3_CLIENT_H_
#define SHARDPOINT_STORE_S3_S3_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"
#include "shardpoint/store/s3/aws_config.h"

namespace sp {

struct S3ClientOptions {
  int max_attempts = 10;
  std::chrono::milliseconds first_backoff{50};
  std::chrono::milliseconds max_backoff{5000};
  std::chrono::seconds deadline{300};          // per request, over all its attempts
  std::chrono::seconds connect_timeout{10};
  // A transfer slower than low_speed_bytes per second for low_speed_time is a timeout (retried):
  // no request hangs on a server that went away.
  long low_speed_bytes = 1024;
  std::chrono::seconds low_speed_time{30};
  // Transfers in flight at once over all loops; more wait in order for one to end.
  int max_connections = 64;
  // Event-loop threads (each a curl multi handle); 0: one per four hardware threads, 1 to 8.
  int event_loops = 0;
};

// One ranged GET of GetRanges: bytes [offset, offset + the pieces' total) of the object, scattered
// into `pieces` in order.
struct S3RangeRead {
  uint64_t offset = 0;
  std::vector<MutableByteView> pieces;
};

struct S3Object {
  std::string key;
  uint64_t size = 0;
};

// What HEAD tells of an object.
struct S3ObjectInfo {
  uint64_t size = 0;
  std::string etag;  // as the server sends it, quotes included
};

// The condition of a conditional write (PutObject, CompleteMultipartUpload): with if_none_match,
// only if no object has the key (If-None-Match: *); with a non-empty if_match, only if the
// object's ETag is still that (If-Match). A write whose condition fails is kAlreadyExists (412).
struct S3Condition {
  bool if_none_match = false;
  std::string if_match;
};

// One page of ListObjectsV2.
struct S3Listing {
  std::vector<S3Object> objects;         // keys under the prefix, sorted
  std::vector<std::string> prefixes;     // with a delimiter: the common prefixes, sorted
  std::string next_continuation_token;   // empty on the last page
};

// A multipart upload begun and neither completed nor aborted.
struct S3Upload {
  std::string key;
  std::string upload_id;
};

// The parts of a completed multipart upload, by part number (from 1).
using S3Parts = std::vector<std::pair<int, std::string>>;  // (number, ETag)

class S3Client {
 public:
  explicit S3Client(S3Config config, S3ClientOptions options = {});
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  const S3Config& config() const { return config_; }

  // The object's size; kNotFound when there is none.
  Result<uint64_t> HeadObject(std::string_view bucket, std::string_view key);
  // Its size and ETag; kNotFound when there is none.
  Result<S3ObjectInfo> StatObject(std::string_view bucket, std::string_view key);
  // Bytes [offset, offset + out.size()) of the object into `out`; kDataLoss when the object
  // holds fewer.
  Status GetRange(std::string_view bucket, std::string_view key, uint64_t offset,
                  MutableByteView out);
  // Bytes [offset, offset + the pieces' total) of the object in one ranged GET, scattered into
  // `pieces` in order as they arrive (no intermediate buffer); kDataLoss when the object holds
  // fewer.
  Status GetRangeV(std::string_view bucket, std::string_view key, uint64_t offset,
                   std::span<const MutableByteView> pieces);
  // The ranged GETs of `reads`, all in flight at once, each as GetRangeV; returns when every one
  // has ended, with the failure of the first (in the order of `reads`) that failed.
  Status GetRanges(std::string_view bucket, std::string_view key,
                   std::span<const S3RangeRead> reads);
  // The whole object.
  Result<std::string> GetObject(std::string_view bucket, std::string_view key);
  // Writes the object whole, where `condition` holds (kAlreadyExists when it does not).
  Status PutObject(std::string_view bucket, std::string_view key, ByteView body,
                   const S3Condition& condition = {});
  // Server-side copy of a whole object.
  Status CopyObject(std::string_view bucket, std::string_view from_key, std::string_view to_key);
  // Deletes the object; deleting a key that does not exist succeeds (as S3 answers).
  Status DeleteObject(std::string_view bucket, std::string_view key);
  // One page of the keys under `prefix`; with `delimiter` ("/"), the keys below the next
  // delimiter are grouped into `prefixes`.
  Result<S3Listing> ListObjects(std::string_view bucket, std::string_view prefix,
                                std::string_view delimiter, std::string_view continuation_token);
  Status CreateBucket(std::string_view bucket);

  // Multipart uploads: start one (its upload id), send parts (each at least 5 MiB but the last;
  // returns the part's ETag), complete it with every part in order, or abort it.
  Result<std::string> CreateMultipartUpload(std::string_view bucket, std::string_view key);
  Result<std::string> UploadPart(std::string_view bucket, std::string_view key,
                                 std::string_view upload_id, int part_number, ByteView body);
  // UploadPart without waiting: `done` is called once with the part's ETag or the failure, on a
  // loop thread, where it must not wait for another request of this client. `body` must stay
  // valid until then.
  void UploadPartAsync(std::string_view bucket, std::string_view key, std::string_view upload_id,
                       int part_number, ByteView body,
                       std::function<void(Result<std::string>)> done);
  Status CompleteMultipartUpload(std::string_view bucket, std::string_view key,
                                 std::string_view upload_id, const S3Parts& parts,
                                 const S3Condition& condition = {});
  Status AbortMultipartUpload(std::string_view bucket, std::string_view key,
                              std::string_view upload_id);
  // The multipart uploads in progress under `prefix`, all pages.
  Result<std::vector<S3Upload>> ListMultipartUploads(std::string_view bucket,
                                                     std::string_view prefix);

  // Requests sent so far, retries included (for tests and benchmarks).
  uint64_t requests_sent() const;

  struct Request;
  struct Response;

 private:
  struct Call;
  class Loop;
  using Done = std::function<void(Result<Response>)>;
  // Hands `request` to a loop; `done` gets its outcome (retries included) on that loop's thread.
  void SendAsync(Request request, Done done);
  // SendAsync, waiting for the outcome.
  Result<Response> Send(Request request);

  S3Config config_;
  S3ClientOptions options_;
  std::vector<std::unique_ptr<Loop>> loops_;
  std::atomic<uint64_t> next_loop_{0};
  std::atomic<uint64_t> requests_sent_{0};
};

// The text of every element <tag>...</tag> of `xml` in order, with the five XML entities and
// numeric character references decoded. Elements of that name must not nest (true of S3's
// responses).
std::vector<std::string> XmlElements(std::string_view xml, std::string_view tag);

// `s` URI-encoded as S3 keys are in request paths: unreserved characters (A-Z a-z 0-9 - _ . ~)
// and, unless `encode_slash`, '/' stay; every other byte becomes %XX.
std::string UriEncode(std::string_view s, bool encode_slash);

// Standard base64 (with padding) of `bytes`.
std::string Base64(ByteView bytes);

}  // namespace sp

#endif  // SHARDPOINT_STORE_S3_S3_CLIENT_H_
