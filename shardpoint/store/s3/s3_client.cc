#include "shardpoint/store/s3/s3_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
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

// One request, from its first attempt to its outcome.
struct S3Client::Call {
  Request request;
  Response response;
  Transfer transfer{&request, &response};
  Done done;
  std::string what;  // "GET s3://bucket/key", for messages
  int attempt = 0;
  std::chrono::milliseconds backoff{0};
  std::chrono::steady_clock::time_point deadline;
  std::chrono::steady_clock::time_point due;  // of the next attempt, while backing off
  // What the attempt on the loop hands to curl, kept alive until it ends.
  std::string url, range, sigv4, token;
  curl_slist* headers = nullptr;
  char error[CURL_ERROR_SIZE] = {0};

  ~Call() { FreeHeaders(); }
  void FreeHeaders() {
    if (headers != nullptr) curl_slist_free_all(headers);
    headers = nullptr;
  }
  // Ready for another attempt: nothing received, the body to be sent from its start.
  void Reset() {
    FreeHeaders();
    response = Response();
    transfer = Transfer{&request, &response};
    error[0] = '\0';
  }
};

// A thread driving a curl multi handle: it starts the calls handed to it (up to max_active at
// once, the rest in order after), collects their ends, retries after a backoff timer, and calls
// each call's `done` with its outcome.
class S3Client::Loop {
 public:
  Loop(S3Client& client, int max_active) : client_(client), max_active_(max_active) {
    multi_ = curl_multi_init();
    if (multi_ != nullptr) {
      curl_multi_setopt(multi_, CURLMOPT_MAXCONNECTS, static_cast<long>(max_active));
      thread_ = std::thread([this] { Run(); });
    }
  }

  ~Loop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    if (multi_ != nullptr) curl_multi_wakeup(multi_);
    if (thread_.joinable()) thread_.join();
    for (CURL* easy : idle_) curl_easy_cleanup(easy);
    if (multi_ != nullptr) curl_multi_cleanup(multi_);
  }

  void Submit(std::unique_ptr<Call> call) {
    if (multi_ == nullptr) {
      call->done(InternalError(call->what + ": curl_multi_init failed"));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitted_.push_back(std::move(call));
    }
    curl_multi_wakeup(multi_);
  }

 private:
  using Clock = std::chrono::steady_clock;

  void Run() {
    for (;;) {
      bool stop = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!submitted_.empty()) {
          waiting_.push_back(std::move(submitted_.front()));
          submitted_.pop_front();
        }
        stop = stop_;
      }
      if (stop) {
        FailAll("the S3 client was shut down");
        return;
      }
      // Calls whose backoff has passed go back in line.
      const Clock::time_point now = Clock::now();
      for (size_t i = 0; i < backing_off_.size();) {
        if (backing_off_[i]->due <= now) {
          waiting_.push_back(std::move(backing_off_[i]));
          backing_off_[i] = std::move(backing_off_.back());
          backing_off_.pop_back();
        } else {
          ++i;
        }
      }
      while (static_cast<int>(active_.size()) < max_active_ && !waiting_.empty()) {
        std::unique_ptr<Call> call = std::move(waiting_.front());
        waiting_.pop_front();
        Start(std::move(call));
      }
      int running = 0;
      curl_multi_perform(multi_, &running);
      int left = 0;
      while (CURLMsg* message = curl_multi_info_read(multi_, &left)) {
        if (message->msg == CURLMSG_DONE) End(message->easy_handle, message->data.result);
      }
      // Sleep until curl has work, a call is handed over, or the next backoff ends.
      int timeout_ms = 1000;
      if (!waiting_.empty() && static_cast<int>(active_.size()) < max_active_) timeout_ms = 0;
      for (const std::unique_ptr<Call>& call : backing_off_) {
        const auto wait = std::chrono::ceil<std::chrono::milliseconds>(call->due - Clock::now());
        timeout_ms = std::clamp<int>(static_cast<int>(wait.count()), 0, timeout_ms);
      }
      curl_multi_poll(multi_, nullptr, 0, timeout_ms, nullptr);
    }
  }

  // Fails every call not yet ended (the client is going away).
  void FailAll(const std::string& why) {
    std::vector<std::unique_ptr<Call>> calls;
    for (auto& [easy, call] : active_) {
      curl_multi_remove_handle(multi_, easy);
      idle_.push_back(easy);
      calls.push_back(std::move(call));
    }
    active_.clear();
    for (auto& call : waiting_) calls.push_back(std::move(call));
    waiting_.clear();
    for (auto& call : backing_off_) calls.push_back(std::move(call));
    backing_off_.clear();
    for (std::unique_ptr<Call>& call : calls) {
      call->done(UnavailableError(call->what + ": " + why));
    }
  }

  void Start(std::unique_ptr<Call> call) {
    CURL* easy = nullptr;
    if (!idle_.empty()) {
      easy = idle_.back();
      idle_.pop_back();
      curl_easy_reset(easy);
    } else {
      easy = curl_easy_init();
    }
    if (easy == nullptr) {
      call->done(InternalError(call->what + ": curl_easy_init failed"));
      return;
    }
    ++call->attempt;
    client_.requests_sent_.fetch_add(1, std::memory_order_relaxed);
    Prepare(*call, easy);
    if (curl_multi_add_handle(multi_, easy) != CURLM_OK) {
      idle_.push_back(easy);
      call->done(InternalError(call->what + ": curl_multi_add_handle failed"));
      return;
    }
    active_[easy] = std::move(call);
  }

  // Sets the easy handle up for the call's next attempt.
  void Prepare(Call& call, CURL* curl) {
    const S3Config& config = client_.config_;
    const S3ClientOptions& options = client_.options_;
    const Request& request = call.request;
    call.Reset();
    // The URL: path-style or virtual-hosted.
    const size_t host_at = config.endpoint.find("://") + 3;
    const std::string path = request.key.empty() ? "" : "/" + UriEncode(request.key, false);
    if (config.path_style || request.bucket.empty()) {
      call.url = config.endpoint + (request.bucket.empty() ? "" : "/" + request.bucket) + path;
    } else {
      call.url = config.endpoint.substr(0, host_at) + request.bucket + "." +
                 config.endpoint.substr(host_at) + path;
    }
    if (call.url.size() == config.endpoint.size()) call.url += "/";
    if (!request.query.empty()) call.url += "?" + QueryString(request.query);

    for (const std::string& h : request.headers) {
      call.headers = curl_slist_append(call.headers, h.c_str());
    }
    // The body follows "Expect: 100-continue" after 1 ms instead of waiting for the 100 (a header
    // removed with "Expect:" would still be signed by curl). 0 would mean the same to a blocking
    // transfer, but a multi handle sets no timer for it and waits for the 100.
    curl_easy_setopt(curl, CURLOPT_EXPECT_100_TIMEOUT_MS, 1L);
    if (request.range) {
      call.range = "Range: bytes=" + std::to_string(request.range->first) + "-" +
                   std::to_string(request.range->second);
      call.headers = curl_slist_append(call.headers, call.range.c_str());
    }
    if (!config.credentials.empty()) {
      call.sigv4 = "aws:amz:" + config.region + ":s3";
      curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, call.sigv4.c_str());
      curl_easy_setopt(curl, CURLOPT_USERNAME, config.credentials.access_key_id.c_str());
      curl_easy_setopt(curl, CURLOPT_PASSWORD, config.credentials.secret_access_key.c_str());
      call.headers = curl_slist_append(call.headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
      if (!config.credentials.session_token.empty()) {
        call.token = "x-amz-security-token: " + config.credentials.session_token;
        call.headers = curl_slist_append(call.headers, call.token.c_str());
      }
    }
    curl_easy_setopt(curl, CURLOPT_PRIVATE, &call);
    curl_easy_setopt(curl, CURLOPT_URL, call.url.c_str());
    if (!config.ca_bundle.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, config.ca_bundle.c_str());
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, call.headers);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, kReceiveBufferBytes);
    curl_easy_setopt(curl, CURLOPT_UPLOAD_BUFFERSIZE, kSendBufferBytes);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(options.connect_timeout.count() * 1000));
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, options.low_speed_bytes);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                     static_cast<long>(options.low_speed_time.count()));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, OnWrite);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &call.transfer);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, OnHeader);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &call.transfer);
    if (request.method == "HEAD") {
      curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
    } else if (request.method == "PUT") {
      curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(curl, CURLOPT_READFUNCTION, OnRead);
      curl_easy_setopt(curl, CURLOPT_READDATA, &call.transfer);
      curl_easy_setopt(curl, CURLOPT_SEEKFUNCTION, OnSeek);
      curl_easy_setopt(curl, CURLOPT_SEEKDATA, &call.transfer);
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
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, call.error);
  }

  // An attempt ended: its outcome, or another attempt after a backoff.
  void End(CURL* easy, CURLcode code) {
    auto it = active_.find(easy);
    if (it == active_.end()) return;
    std::unique_ptr<Call> call = std::move(it->second);
    active_.erase(it);
    curl_multi_remove_handle(multi_, easy);
    long status = 0;
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    idle_.push_back(easy);
    call->response.status = status;
    call->FreeHeaders();

    const S3ClientOptions& options = client_.options_;
    bool retry = false;
    Status failure;
    if (call->transfer.overflow) {
      uint64_t asked = 0;
      for (const MutableByteView& piece : call->request.out) asked += piece.size();
      failure = DataLossError(call->what + ": the server sent more than the " +
                              std::to_string(asked) + " bytes asked for");
    } else if (code != CURLE_OK) {
      const std::string message =
          call->what + ": " + (call->error[0] ? call->error : curl_easy_strerror(code));
      retry = RetryableTransport(code);
      failure = retry ? UnavailableError(message) : UnknownError(message);
    } else if (status / 100 != 2) {
      failure = HttpError(call->what, status, call->response.body);
      retry = Retryable(status);
    } else {
      Response response = std::move(call->response);
      call->done(std::move(response));
      return;
    }
    const auto wait = std::chrono::milliseconds(
        std::uniform_int_distribution<int64_t>(0, call->backoff.count())(rng_));
    const Clock::time_point now = Clock::now();
    if (!retry || call->attempt >= options.max_attempts || now + wait >= call->deadline) {
      if (retry) {
        failure = Status(failure.code(), std::string(failure.message()) + " (after " +
                                             std::to_string(call->attempt) + " attempts)");
      }
      call->done(std::move(failure));
      return;
    }
    call->backoff = std::min(call->backoff * 2, options.max_backoff);
    call->due = now + wait;
    backing_off_.push_back(std::move(call));
  }

  static constexpr long kReceiveBufferBytes = 256 << 10;
  static constexpr long kSendBufferBytes = 256 << 10;

  S3Client& client_;
  const int max_active_;
  CURLM* multi_ = nullptr;
  std::mutex mu_;
  std::deque<std::unique_ptr<Call>> submitted_;  // guarded by mu_
  bool stop_ = false;                            // guarded by mu_
  // The loop thread's own:
  std::deque<std::unique_ptr<Call>> waiting_;
  std::vector<std::unique_ptr<Call>> backing_off_;
  std::map<CURL*, std::unique_ptr<Call>> active_;
  std::vector<CURL*> idle_;
  std::mt19937_64 rng_{std::random_device{}()};
  std::thread thread_;  // last: starts once the members above exist
};

S3Client::S3Client(S3Config config, S3ClientOptions options)
    : config_(std::move(config)), options_(options) {
  if (config_.max_attempts > 0) options_.max_attempts = config_.max_attempts;
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  int loops = options_.event_loops;
  if (loops <= 0) {
    loops = std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 4, 1, 8);
  }
  const int connections = std::max(options_.max_connections, loops);
  for (int i = 0; i < loops; ++i) {
    // The connections split between the loops, the first ones taking the remainder.
    const int share = connections / loops + (i < connections % loops ? 1 : 0);
    loops_.push_back(std::make_unique<Loop>(*this, share));
  }
}

S3Client::~S3Client() { loops_.clear(); }

uint64_t S3Client::requests_sent() const {
  return requests_sent_.load(std::memory_order_relaxed);
}

void S3Client::SendAsync(Request request, Done done) {
  auto call = std::make_unique<Call>();
  call->what = request.method + " " + ObjectUrl(request.bucket, request.key);
  call->request = std::move(request);
  call->done = std::move(done);
  call->backoff = options_.first_backoff;
  call->deadline = std::chrono::steady_clock::now() + options_.deadline;
  const uint64_t loop = next_loop_.fetch_add(1, std::memory_order_relaxed) % loops_.size();
  loops_[loop]->Submit(std::move(call));
}

Result<S3Client::Response> S3Client::Send(Request request) {
  // Shared with the loop's callback: the caller may return (and drop its reference) while the
  // loop thread is still inside set_value.
  auto promise = std::make_shared<std::promise<Result<Response>>>();
  std::future<Result<Response>> outcome = promise->get_future();
  SendAsync(std::move(request),
            [promise](Result<Response> response) { promise->set_value(std::move(response)); });
  return outcome.get();
}

Result<uint64_t> S3Client::HeadObject(std::string_view bucket, std::string_view key) {
  SP_ASSIGN_OR_RETURN(S3ObjectInfo info, StatObject(bucket, key));
  return info.size;
}

Result<S3ObjectInfo> S3Client::StatObject(std::string_view bucket, std::string_view key) {
  Request r = MakeRequest("HEAD", bucket, key);
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
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
  S3RangeRead read;
  read.offset = offset;
  read.pieces.assign(pieces.begin(), pieces.end());
  return GetRanges(bucket, key, std::span<const S3RangeRead>(&read, 1));
}

Status S3Client::GetRanges(std::string_view bucket, std::string_view key,
                           std::span<const S3RangeRead> reads) {
  struct Outcomes {
    std::mutex mu;
    std::condition_variable ended;
    size_t left = 0;
    std::vector<Status> status;
  };
  auto outcomes = std::make_shared<Outcomes>();
  outcomes->status.resize(reads.size());
  std::vector<std::pair<size_t, Request>> requests;
  for (size_t i = 0; i < reads.size(); ++i) {
    uint64_t total = 0;
    for (const MutableByteView& piece : reads[i].pieces) total += piece.size();
    if (total == 0) continue;
    Request r = MakeRequest("GET", bucket, key);
    r.range = {reads[i].offset, reads[i].offset + total - 1};
    for (const MutableByteView& piece : reads[i].pieces) {
      if (!piece.empty()) r.out.push_back(piece);
    }
    requests.emplace_back(i, std::move(r));
  }
  outcomes->left = requests.size();
  for (auto& [i, r] : requests) {
    const uint64_t offset = r.range->first;
    const uint64_t total = r.range->second + 1 - offset;
    SendAsync(std::move(r), [outcomes, i = i, offset, total, url = ObjectUrl(bucket, key)](
                                Result<Response> response) {
      Status status = response.status();
      if (status.ok() && response->written != total) {
        status = DataLossError("GET " + url + " bytes " + std::to_string(offset) + ".." +
                               std::to_string(offset + total) + ": got " +
                               std::to_string(response->written) + " bytes");
      }
      std::lock_guard<std::mutex> lock(outcomes->mu);
      outcomes->status[i] = std::move(status);
      if (--outcomes->left == 0) outcomes->ended.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(outcomes->mu);
  outcomes->ended.wait(lock, [&] { return outcomes->left == 0; });
  for (const Status& status : outcomes->status) SP_RETURN_IF_ERROR(status);
  return OkStatus();
}

Result<std::string> S3Client::GetObject(std::string_view bucket, std::string_view key) {
  Request r = MakeRequest("GET", bucket, key);
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
  return std::move(response.body);
}

Status S3Client::PutObject(std::string_view bucket, std::string_view key, ByteView body,
                           const S3Condition& condition) {
  Request r = MakeRequest("PUT", bucket, key);
  r.body = body;
  r.headers.push_back(Crc32cHeader(body));
  AddCondition(condition, &r.headers);
  return Send(std::move(r)).status();
}

Status S3Client::CopyObject(std::string_view bucket, std::string_view from_key,
                            std::string_view to_key) {
  Request r = MakeRequest("PUT", bucket, to_key);
  r.body = ByteView();
  r.headers.push_back("x-amz-copy-source: /" + std::string(bucket) + "/" +
                      UriEncode(from_key, false));
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
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
  Result<Response> response = Send(std::move(r));
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
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
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
    SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
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
  return Send(std::move(r)).status();
}

Result<std::string> S3Client::CreateMultipartUpload(std::string_view bucket,
                                                    std::string_view key) {
  Request r = MakeRequest("POST", bucket, key);
  r.query = {{"uploads", ""}};
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
  std::vector<std::string> id = XmlElements(response.body, "UploadId");
  if (id.size() != 1 || id[0].empty()) {
    return DataLossError("POST " + ObjectUrl(bucket, key) + "?uploads: no UploadId in the answer");
  }
  return id[0];
}

namespace {

// The ETag of an answered part upload.
Result<std::string> PartETag(const std::string& url, int part_number,
                             const Result<S3Client::Response>& response) {
  if (!response.ok()) return response.status();
  auto it = response->headers.find("etag");
  if (it == response->headers.end() || it->second.empty()) {
    return DataLossError("PUT " + url + " part " + std::to_string(part_number) +
                         ": no ETag in the answer");
  }
  return it->second;
}

S3Client::Request PartRequest(std::string_view bucket, std::string_view key,
                              std::string_view upload_id, int part_number, ByteView body) {
  S3Client::Request r = MakeRequest("PUT", bucket, key);
  r.query = {{"partNumber", std::to_string(part_number)}, {"uploadId", std::string(upload_id)}};
  r.body = body;
  r.headers.push_back(Crc32cHeader(body));
  return r;
}

}  // namespace

Result<std::string> S3Client::UploadPart(std::string_view bucket, std::string_view key,
                                         std::string_view upload_id, int part_number,
                                         ByteView body) {
  return PartETag(ObjectUrl(bucket, key), part_number,
                  Send(PartRequest(bucket, key, upload_id, part_number, body)));
}

void S3Client::UploadPartAsync(std::string_view bucket, std::string_view key,
                               std::string_view upload_id, int part_number, ByteView body,
                               std::function<void(Result<std::string>)> done) {
  SendAsync(PartRequest(bucket, key, upload_id, part_number, body),
            [done = std::move(done), url = ObjectUrl(bucket, key),
             part_number](Result<Response> response) {
              done(PartETag(url, part_number, response));
            });
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
  SP_ASSIGN_OR_RETURN(Response response, Send(std::move(r)));
  if (!XmlElements(response.body, "Code").empty()) {  // an error after the 200
    return HttpError("POST " + ObjectUrl(bucket, key) + "?uploadId", 500, response.body);
  }
  return OkStatus();
}

Status S3Client::AbortMultipartUpload(std::string_view bucket, std::string_view key,
                                      std::string_view upload_id) {
  Request r = MakeRequest("DELETE", bucket, key);
  r.query = {{"uploadId", std::string(upload_id)}};
  Result<Response> response = Send(std::move(r));
  if (!response.ok() && response.status().code() == StatusCode::kNotFound) return OkStatus();
  return response.status();
}

}  // namespace sp
