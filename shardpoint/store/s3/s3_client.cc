#include "shardpoint/store/s3/s3_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "shardpoint/base/crc32c.h"

namespace sp {

struct S3Client::Request {
  std::string method = "GET";  // GET, HEAD, PUT, POST, DELETE
  std::string bucket;
  std::string key;
  std::vector<std::pair<std::string, std::string>> query;  // name -> value, unencoded
  std::vector<std::string> headers;                         // "Name: value"
  std::optional<ByteView> body;                             // PUT and POST
  std::vector<MutableByteView> out;  // GET: the body lands here, piece after piece (none: in body)
  std::optional<std::pair<uint64_t, uint64_t>> range;       // inclusive byte range
};

struct S3Client::Response {
  long status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // names lowercased
  uint64_t written = 0;                        // bytes written into Request::out's pieces
};

struct S3Client::Handle {
  CURL* curl = nullptr;
  ~Handle() {
    if (curl != nullptr) curl_easy_cleanup(curl);
  }
};

namespace {

std::once_flag g_curl_init;

void AddCondition(const S3Condition& condition, std::vector<std::string>* headers) {
  if (condition.if_none_match) headers->push_back("If-None-Match: *");
  if (!condition.if_match.empty()) headers->push_back("If-Match: " + condition.if_match);
}

S3Client::Request MakeRequest(std::string method, std::string_view bucket, std::string_view key) {
  S3Client::Request r;
  r.method = std::move(method);
  r.bucket = std::string(bucket);
  r.key = std::string(key);
  return r;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string ObjectUrl(std::string_view bucket, std::string_view key) {
  return "s3://" + std::string(bucket) + (key.empty() ? "" : "/" + std::string(key));
}

// The canonical query: names sorted, names and values URI-encoded ('/' too), as SigV4 signs it.
std::string QueryString(std::vector<std::pair<std::string, std::string>> query) {
  std::sort(query.begin(), query.end());
  std::string out;
  for (const auto& [name, value] : query) {
    if (!out.empty()) out += '&';
    out += UriEncode(name, true) + "=" + UriEncode(value, true);
  }
  return out;
}

bool Retryable(long status) { return status == 429 || status >= 500; }

bool RetryableTransport(CURLcode code) {
  switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
      return true;
    default:
      return false;
  }
}

// The Status of a final HTTP error: its code from the status, its message naming the request.
Status HttpError(const std::string& what, long status, const std::string& body) {
  std::vector<std::string> codes = XmlElements(body, "Code");
  std::vector<std::string> messages = XmlElements(body, "Message");
  std::string message = what + ": HTTP " + std::to_string(status);
  if (!codes.empty()) message += " " + codes.front();
  if (!messages.empty()) message += ": " + messages.front();
  if (status == 404) return NotFoundError(message);
  if (status == 403) return PermissionDeniedError(message);
  if (status == 412) return AlreadyExistsError(message);
  if (status == 429 || status >= 500) return UnavailableError(message);
  return InvalidArgumentError(message);
}

struct Transfer {
  const S3Client::Request* request;
  S3Client::Response* response;
  uint64_t read_at = 0;  // bytes of the body sent so far
  bool overflow = false;
  size_t piece = 0;       // the piece of Request::out the next received byte goes to
  uint64_t piece_at = 0;  // and its offset there
};

size_t OnWrite(char* data, size_t size, size_t count, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  const size_t n = size * count;
  if (!t.request->out.empty() && t.response->status / 100 == 2) {
    const std::vector<MutableByteView>& out = t.request->out;
    size_t done = 0;
    while (done < n) {
      while (t.piece < out.size() && t.piece_at == out[t.piece].size()) {
        ++t.piece;
        t.piece_at = 0;
      }
      if (t.piece == out.size()) {
        t.overflow = true;
        return 0;  // aborts the transfer
      }
      const size_t k =
          static_cast<size_t>(std::min<uint64_t>(n - done, out[t.piece].size() - t.piece_at));
      std::memcpy(out[t.piece].data() + t.piece_at, data + done, k);
      t.piece_at += k;
      done += k;
    }
    t.response->written += n;
  } else {
    t.response->body.append(data, n);
  }
  return n;
}

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  const size_t n = size * count;
  std::string_view line(data, n);
  if (line.rfind("HTTP/", 0) == 0) {  // a new response (after a redirect or 100-continue)
    t.response->headers.clear();
    const size_t space = line.find(' ');
    if (space != std::string_view::npos) t.response->status = std::atol(line.data() + space + 1);
    return n;
  }
  const size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) {
      value.remove_prefix(1);
    }
    while (!value.empty() && (value.back() == '\r' || value.back() == '\n')) value.remove_suffix(1);
    t.response->headers[Lower(line.substr(0, colon))] = std::string(value);
  }
  return n;
}

size_t OnRead(char* buffer, size_t size, size_t count, void* user) {
  Transfer& t = *static_cast<Transfer*>(user);
  const ByteView body = *t.request->body;
  const size_t n = std::min<uint64_t>(size * count, body.size() - t.read_at);
  std::memcpy(buffer, body.data() + t.read_at, n);
  t.read_at += n;
  return n;
}

// Lets curl send a body again from its start (a retried or redirected request).
int OnSeek(void* user, curl_off_t offset, int origin) {
  Transfer& t = *static_cast<Transfer*>(user);
  if (origin != SEEK_SET || offset < 0 || static_cast<uint64_t>(offset) > t.request->body->size()) {
    return CURL_SEEKFUNC_FAIL;
  }
  t.read_at = static_cast<uint64_t>(offset);
  return CURL_SEEKFUNC_OK;
}

std::string Crc32cHeader(ByteView body) {
  const uint32_t crc = Crc32c(body.data(), body.size());
  const std::byte be[4] = {std::byte(crc >> 24), std::byte(crc >> 16), std::byte(crc >> 8),
                           std::byte(crc)};
  return "x-amz-checksum-crc32c: " + Base64(ByteView(be, 4));
}

}  // namespace

std::vector<std::string> XmlElements(std::string_view xml, std::string_view tag) {
  std::vector<std::string> out;
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  size_t at = 0;
  while ((at = xml.find(open, at)) != std::string_view::npos) {
    const size_t begin = at + open.size();
    const size_t end = xml.find(close, begin);
    if (end == std::string_view::npos) break;
    std::string_view text = xml.substr(begin, end - begin);
    std::string value;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] != '&') {
        value += text[i];
        continue;
      }
      const size_t semi = text.find(';', i);
      if (semi == std::string_view::npos) {
        value += text[i];
        continue;
      }
      const std::string_view entity = text.substr(i + 1, semi - i - 1);
      uint32_t code = 0;
      bool known = true;
      if (entity == "amp") code = '&';
      else if (entity == "lt") code = '<';
      else if (entity == "gt") code = '>';
      else if (entity == "quot") code = '"';
      else if (entity == "apos") code = '\'';
      else if (entity.size() > 1 && entity[0] == '#') {
        const bool hex = entity[1] == 'x' || entity[1] == 'X';
        const std::string digits(entity.substr(hex ? 2 : 1));
        char* end_digits = nullptr;
        const unsigned long v = std::strtoul(digits.c_str(), &end_digits, hex ? 16 : 10);
        known = !digits.empty() && *end_digits == '\0' && v <= 0x10FFFF;
        code = static_cast<uint32_t>(v);
      } else {
        known = false;
      }
      if (!known) {
        value += text[i];
        continue;
      }
      // UTF-8 of the code point.
      if (code < 0x80) {
        value += static_cast<char>(code);
      } else if (code < 0x800) {
        value += static_cast<char>(0xC0 | (code >> 6));
        value += static_cast<char>(0x80 | (code & 0x3F));
      } else if (code < 0x10000) {
        value += static_cast<char>(0xE0 | (code >> 12));
        value += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
        value += static_cast<char>(0x80 | (code & 0x3F));
      } else {
        value += static_cast<char>(0xF0 | (code >> 18));
        value += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
        value += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
        value += static_cast<char>(0x80 | (code & 0x3F));
      }
      i = semi;
    }
    out.push_back(std::move(value));
    at = end + close.size();
  }
  return out;
}

std::string UriEncode(std::string_view s, bool encode_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (c == '/' && !encode_slash)) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string Base64(ByteView bytes) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  auto at = [&](size_t k) { return static_cast<uint32_t>(bytes[k]); };
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = at(i) << 16 | at(i + 1) << 8 | at(i + 2);
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = at(i) << 16;
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = at(i) << 16 | at(i + 1) << 8;
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

S3Client::S3Client(S3Config config, S3ClientOptions options)
    : config_(std::move(config)), options_(options) {
  if (config_.max_attempts > 0) options_.max_attempts = config_.max_attempts;
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

S3Client::~S3Client() = default;

uint64_t S3Client::requests_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_sent_;
}

std::unique_ptr<S3Client::Handle> S3Client::TakeHandle() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_sent_;
    if (!idle_.empty()) {
      std::unique_ptr<Handle> handle = std::move(idle_.back());
      idle_.pop_back();
      return handle;
    }
  }
  auto handle = std::make_unique<Handle>();
  handle->curl = curl_easy_init();
  return handle;
}

void S3Client::ReturnHandle(std::unique_ptr<Handle> handle) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(std::move(handle));
}

Result<S3Client::Response> S3Client::SendOnce(const Request& request, Handle& handle) {
  CURL* curl = handle.curl;
  if (curl == nullptr) return InternalError("curl_easy_init failed");
  curl_easy_reset(curl);  // keeps the connection and session caches
  const std::string what = request.method + " " + ObjectUrl(request.bucket, request.key);

  // The URL: path-style or virtual-hosted.
  const size_t host_at = config_.endpoint.find("://") + 3;
  std::string url;
  const std::string path = request.key.empty() ? "" : "/" + UriEncode(request.key, false);
  if (config_.path_style || request.bucket.empty()) {
    url = config_.endpoint + (request.bucket.empty() ? "" : "/" + request.bucket) + path;
  } else {
    url = config_.endpoint.substr(0, host_at) + request.bucket + "." +
          config_.endpoint.substr(host_at) + path;
  }
  if (url.size() == config_.endpoint.size()) url += "/";
  if (!request.query.empty()) url += "?" + QueryString(request.query);

  Response response;
  Transfer transfer{&request, &response};
  curl_slist* headers = nullptr;
  for (const std::string& h : request.headers) headers = curl_slist_append(headers, h.c_str());
  // (No "Expect:" header to skip 100-continue: curl would sign the removed header.)
  curl_easy_setopt(curl, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
  std::string range;
  if (request.range) {
    range = "Range: bytes=" + std::to_string(request.range->first) + "-" +
            std::to_string(request.range->second);
    headers = curl_slist_append(headers, range.c_str());
  }
  std::string sigv4;
  std::string token;
  if (!config_.credentials.empty()) {
    sigv4 = "aws:amz:" + config_.region + ":s3";
    curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(curl, CURLOPT_USERNAME, config_.credentials.access_key_id.c_str());
    curl_easy_setopt(curl, CURLOPT_PASSWORD, config_.credentials.secret_access_key.c_str());
    headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!config_.credentials.session_token.empty()) {
      token = "x-amz-security-token: " + config_.credentials.session_token;
      headers = curl_slist_append(headers, token.c_str());
    }
  }
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  if (!config_.ca_bundle.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, config_.ca_bundle.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(options_.connect_timeout.count() * 1000));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, options_.low_speed_bytes);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   static_cast<long>(options_.low_speed_time.count()));
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, OnWrite);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &transfer);
  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, OnRead);
    curl_easy_setopt(curl, CURLOPT_READDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_SEEKFUNCTION, OnSeek);
    curl_easy_setopt(curl, CURLOPT_SEEKDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE,
                     static_cast<curl_off_t>(request.body ? request.body->size() : 0));
  } else if (request.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS,
                     request.body ? reinterpret_cast<const char*>(request.body->data()) : "");
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(request.body ? request.body->size() : 0));
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  const CURLcode code = curl_easy_perform(curl);
  curl_slist_free_all(headers);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  response.status = status;
  if (transfer.overflow) {
    uint64_t asked = 0;
    for (const MutableByteView& piece : request.out) asked += piece.size();
    return DataLossError(what + ": the server sent more than the " + std::to_string(asked) +
                         " bytes asked for");
  }
  if (code != CURLE_OK) {
    const std::string message = what + ": " + (error[0] ? error : curl_easy_strerror(code));
    if (RetryableTransport(code)) return UnavailableError(message);
    return UnknownError(message);
  }
  return response;
}

Result<S3Client::Response> S3Client::Send(const Request& request) {
  const auto deadline = std::chrono::steady_clock::now() + options_.deadline;
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::chrono::milliseconds backoff = options_.first_backoff;
  const std::string what = request.method + " " + ObjectUrl(request.bucket, request.key);
  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<Handle> handle = TakeHandle();
    Result<Response> response = SendOnce(request, *handle);
    ReturnHandle(std::move(handle));
    bool retry = false;
    Status failure;
    if (!response.ok()) {
      failure = response.status();
      retry = failure.code() == StatusCode::kUnavailable;
    } else if (response->status / 100 != 2) {
      failure = HttpError(what, response->status, response->body);
      retry = Retryable(response->status);
    } else {
      return response;
    }
    const auto wait = std::chrono::milliseconds(
        std::uniform_int_distribution<int64_t>(0, backoff.count())(rng));
    if (!retry || attempt >= options_.max_attempts ||
        std::chrono::steady_clock::now() + wait >= deadline) {
      if (retry) {
        return Status(failure.code(), std::string(failure.message()) + " (after " +
                                          std::to_string(attempt) + " attempts)");
      }
      return failure;
    }
    std::this_thread::sleep_for(wait);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

Result<uint64_t> S3Client::HeadObject(std::string_view bucket, std::string_view key) {
  SP_ASSIGN_OR_RETURN(S3ObjectInfo info, StatObject(bucket, key));
  return info.size;
}

Result<S3ObjectInfo> S3Client::StatObject(std::string_view bucket, std::string_view key) {
  Request r = MakeRequest("HEAD", bucket, key);
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  auto it = response.headers.find("content-length");
  if (it == response.headers.end()) {
    return DataLossError("HEAD " + ObjectUrl(bucket, key) + ": no Content-Length in the answer");
  }
  S3ObjectInfo info;
  info.size = static_cast<uint64_t>(std::strtoull(it->second.c_str(), nullptr, 10));
  auto etag = response.headers.find("etag");
  if (etag != response.headers.end()) info.etag = etag->second;
  return info;
}

Status S3Client::GetRange(std::string_view bucket, std::string_view key, uint64_t offset,
                          MutableByteView out) {
  return GetRangeV(bucket, key, offset, std::span<const MutableByteView>(&out, 1));
}

Status S3Client::GetRangeV(std::string_view bucket, std::string_view key, uint64_t offset,
                           std::span<const MutableByteView> pieces) {
  uint64_t total = 0;
  for (const MutableByteView& piece : pieces) total += piece.size();
  if (total == 0) return OkStatus();
  Request r = MakeRequest("GET", bucket, key);
  r.range = {offset, offset + total - 1};
  for (const MutableByteView& piece : pieces) {
    if (!piece.empty()) r.out.push_back(piece);
  }
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  if (response.written != total) {
    return DataLossError("GET " + ObjectUrl(bucket, key) + " bytes " + std::to_string(offset) +
                         ".." + std::to_string(offset + total) + ": got " +
                         std::to_string(response.written) + " bytes");
  }
  return OkStatus();
}

Result<std::string> S3Client::GetObject(std::string_view bucket, std::string_view key) {
  Request r = MakeRequest("GET", bucket, key);
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  return std::move(response.body);
}

Status S3Client::PutObject(std::string_view bucket, std::string_view key, ByteView body,
                           const S3Condition& condition) {
  Request r = MakeRequest("PUT", bucket, key);
  r.body = body;
  r.headers.push_back(Crc32cHeader(body));
  AddCondition(condition, &r.headers);
  return Send(r).status();
}

Status S3Client::CopyObject(std::string_view bucket, std::string_view from_key,
                            std::string_view to_key) {
  Request r = MakeRequest("PUT", bucket, to_key);
  r.body = ByteView();
  r.headers.push_back("x-amz-copy-source: /" + std::string(bucket) + "/" +
                      UriEncode(from_key, false));
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  // A copy can fail after its 200 has been sent: the error is then in the body.
  if (!XmlElements(response.body, "Code").empty()) {
    return HttpError("PUT " + ObjectUrl(bucket, to_key) + " (copy of " + std::string(from_key) +
                         ")",
                     500, response.body);
  }
  return OkStatus();
}

Status S3Client::DeleteObject(std::string_view bucket, std::string_view key) {
  Request r = MakeRequest("DELETE", bucket, key);
  Result<Response> response = Send(r);
  if (!response.ok() && response.status().code() == StatusCode::kNotFound) return OkStatus();
  return response.status();
}

Result<S3Listing> S3Client::ListObjects(std::string_view bucket, std::string_view prefix,
                                        std::string_view delimiter,
                                        std::string_view continuation_token) {
  Request r = MakeRequest("GET", bucket, "");
  r.query = {{"list-type", "2"}, {"prefix", std::string(prefix)}};
  if (!delimiter.empty()) r.query.emplace_back("delimiter", std::string(delimiter));
  if (!continuation_token.empty()) {
    r.query.emplace_back("continuation-token", std::string(continuation_token));
  }
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  S3Listing listing;
  for (const std::string& contents : XmlElements(response.body, "Contents")) {
    std::vector<std::string> keys = XmlElements(contents, "Key");
    std::vector<std::string> sizes = XmlElements(contents, "Size");
    if (keys.size() != 1 || sizes.size() != 1) {
      return DataLossError("list of " + ObjectUrl(bucket, prefix) +
                           ": an entry without one Key and one Size");
    }
    listing.objects.push_back(S3Object{keys[0], std::strtoull(sizes[0].c_str(), nullptr, 10)});
  }
  for (const std::string& common : XmlElements(response.body, "CommonPrefixes")) {
    for (std::string& p : XmlElements(common, "Prefix")) listing.prefixes.push_back(std::move(p));
  }
  std::vector<std::string> truncated = XmlElements(response.body, "IsTruncated");
  if (!truncated.empty() && truncated[0] == "true") {
    std::vector<std::string> next = XmlElements(response.body, "NextContinuationToken");
    if (next.empty() || next[0].empty()) {
      return DataLossError("list of " + ObjectUrl(bucket, prefix) +
                           ": truncated without a continuation token");
    }
    listing.next_continuation_token = next[0];
  }
  return listing;
}

Result<std::vector<S3Upload>> S3Client::ListMultipartUploads(std::string_view bucket,
                                                             std::string_view prefix) {
  std::vector<S3Upload> uploads;
  std::string key_marker, upload_id_marker;
  for (int page = 0; page < 100000; ++page) {
    Request r = MakeRequest("GET", bucket, "");
    r.query = {{"uploads", ""}, {"prefix", std::string(prefix)}};
    if (!key_marker.empty()) {
      r.query.emplace_back("key-marker", key_marker);
      r.query.emplace_back("upload-id-marker", upload_id_marker);
    }
    SP_ASSIGN_OR_RETURN(Response response, Send(r));
    for (const std::string& upload : XmlElements(response.body, "Upload")) {
      std::vector<std::string> keys = XmlElements(upload, "Key");
      std::vector<std::string> ids = XmlElements(upload, "UploadId");
      if (keys.size() != 1 || ids.size() != 1) {
        return DataLossError("list of the uploads of " + ObjectUrl(bucket, prefix) +
                             ": an entry without one Key and one UploadId");
      }
      uploads.push_back(S3Upload{keys[0], ids[0]});
    }
    std::vector<std::string> truncated = XmlElements(response.body, "IsTruncated");
    if (truncated.empty() || truncated[0] != "true") return uploads;
    std::vector<std::string> next_key = XmlElements(response.body, "NextKeyMarker");
    std::vector<std::string> next_id = XmlElements(response.body, "NextUploadIdMarker");
    if (next_key.empty() || next_key[0].empty() ||
        (next_key[0] == key_marker && (next_id.empty() || next_id[0] == upload_id_marker))) {
      return DataLossError("list of the uploads of " + ObjectUrl(bucket, prefix) +
                           ": truncated without a marker that moves on");
    }
    key_marker = next_key[0];
    upload_id_marker = next_id.empty() ? "" : next_id[0];
  }
  return DataLossError("list of the uploads of " + ObjectUrl(bucket, prefix) +
                       ": more than 100000 pages");
}

Status S3Client::CreateBucket(std::string_view bucket) {
  Request r = MakeRequest("PUT", bucket, "");
  r.body = ByteView();
  return Send(r).status();
}

Result<std::string> S3Client::CreateMultipartUpload(std::string_view bucket,
                                                    std::string_view key) {
  Request r = MakeRequest("POST", bucket, key);
  r.query = {{"uploads", ""}};
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  std::vector<std::string> id = XmlElements(response.body, "UploadId");
  if (id.size() != 1 || id[0].empty()) {
    return DataLossError("POST " + ObjectUrl(bucket, key) + "?uploads: no UploadId in the answer");
  }
  return id[0];
}

Result<std::string> S3Client::UploadPart(std::string_view bucket, std::string_view key,
                                         std::string_view upload_id, int part_number,
                                         ByteView body) {
  Request r = MakeRequest("PUT", bucket, key);
  r.query = {{"partNumber", std::to_string(part_number)}, {"uploadId", std::string(upload_id)}};
  r.body = body;
  r.headers.push_back(Crc32cHeader(body));
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  auto it = response.headers.find("etag");
  if (it == response.headers.end() || it->second.empty()) {
    return DataLossError("PUT " + ObjectUrl(bucket, key) + " part " + std::to_string(part_number) +
                         ": no ETag in the answer");
  }
  return it->second;
}

Status S3Client::CompleteMultipartUpload(std::string_view bucket, std::string_view key,
                                         std::string_view upload_id, const S3Parts& parts,
                                         const S3Condition& condition) {
  std::string xml = "<CompleteMultipartUpload>";
  for (const auto& [number, etag] : parts) {
    std::string escaped;
    for (char c : etag) escaped += c == '"' ? std::string("&quot;") : std::string(1, c);
    xml += "<Part><PartNumber>" + std::to_string(number) + "</PartNumber><ETag>" + escaped +
           "</ETag></Part>";
  }
  xml += "</CompleteMultipartUpload>";
  Request r = MakeRequest("POST", bucket, key);
  r.query = {{"uploadId", std::string(upload_id)}};
  r.body = AsBytes(xml);
  r.headers.push_back("Content-Type: application/xml");
  AddCondition(condition, &r.headers);
  SP_ASSIGN_OR_RETURN(Response response, Send(r));
  if (!XmlElements(response.body, "Code").empty()) {  // an error after the 200
    return HttpError("POST " + ObjectUrl(bucket, key) + "?uploadId", 500, response.body);
  }
  return OkStatus();
}

Status S3Client::AbortMultipartUpload(std::string_view bucket, std::string_view key,
                                      std::string_view upload_id) {
  Request r = MakeRequest("DELETE", bucket, key);
  r.query = {{"uploadId", std::string(upload_id)}};
  Result<Response> response = Send(r);
  if (!response.ok() && response.status().code() == StatusCode::kNotFound) return OkStatus();
  return response.status();
}

}  // namespace sp
