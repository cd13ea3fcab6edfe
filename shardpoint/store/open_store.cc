#include "shardpoint/store/open_store.h"

#include <cctype>

#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/store/s3/s3_store.h"

namespace sp {
namespace {

// RFC 3986: ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ).
bool IsScheme(std::string_view s) {
  if (s.empty() || !std::isalpha(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') {
      return false;
    }
  }
  return true;
}

StoreUrl Url(std::string scheme, std::string path, std::string bucket = "") {
  StoreUrl url;
  url.scheme = std::move(scheme);
  url.path = std::move(path);
  url.bucket = std::move(bucket);
  return url;
}

// S3's rules for bucket names (the common subset every S3-compatible server accepts).
bool ValidBucketName(std::string_view name) {
  if (name.size() < 3 || name.size() > 63) return false;
  for (char ch : name) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (!(std::islower(c) || std::isdigit(c) || c == '.' || c == '-')) return false;
  }
  return std::isalnum(static_cast<unsigned char>(name.front())) &&
         std::isalnum(static_cast<unsigned char>(name.back()));
}

}  // namespace

Result<StoreUrl> ParseStoreUrl(std::string_view url) {
  if (url.empty()) return InvalidArgumentError("store URL is empty");
  size_t sep = url.find("://");
  if (sep == std::string_view::npos || !IsScheme(url.substr(0, sep))) {
    return Url("file", std::string(url));  // a plain path
  }
  std::string scheme(url.substr(0, sep));
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view rest = url.substr(sep + 3);
  if (scheme == "file") {
    if (rest.empty() || rest.front() != '/') {
      return InvalidArgumentError("store URL '" + std::string(url) +
                                  "': a file URL needs an absolute path and no host "
                                  "(expected file:///path)");
    }
    return Url("file", std::string(rest));
  }
  if (scheme == "memory") return Url("memory", std::string(rest));
  if (scheme == "s3") {
    const std::string_view bucket = rest.substr(0, rest.find('/'));
    if (!ValidBucketName(bucket)) {
      return InvalidArgumentError("store URL '" + std::string(url) + "': '" + std::string(bucket) +
                                  "' is not an S3 bucket name (3 to 63 lowercase letters, digits, "
                                  "'.' and '-'; expected s3://bucket/prefix)");
    }
    const size_t slash = rest.find('/');
    return Url("s3", slash == std::string_view::npos ? "/" : std::string(rest.substr(slash)),
               std::string(bucket));
  }
  return InvalidArgumentError("store URL '" + std::string(url) + "': unsupported scheme '" +
                              scheme + "' (supported: file, memory, s3, or a plain path)");
}

Result<std::unique_ptr<Store>> OpenStore(std::string_view url, PosixStoreOptions posix) {
  SP_ASSIGN_OR_RETURN(StoreUrl parsed, ParseStoreUrl(url));
  if (parsed.scheme == "memory") return std::unique_ptr<Store>(std::make_unique<MemoryStore>());
  if (parsed.scheme == "s3") {
    SP_ASSIGN_OR_RETURN(S3Config config, ResolveS3Config(ProcessEnvironment()));
    return std::unique_ptr<Store>(
        std::make_unique<S3Store>(std::make_shared<S3Client>(std::move(config)), parsed.bucket));
  }
  return std::unique_ptr<Store>(std::make_unique<PosixStore>(posix));
}

}  // namespace sp
