#include "shardpoint/store/open_store.h"

#include <cctype>

#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/posix_store.h"

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

}  // namespace

Result<StoreUrl> ParseStoreUrl(std::string_view url) {
  if (url.empty()) return InvalidArgumentError("store URL is empty");
  size_t sep = url.find("://");
  if (sep == std::string_view::npos || !IsScheme(url.substr(0, sep))) {
    return StoreUrl{"file", std::string(url)};  // a plain path
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
    return StoreUrl{"file", std::string(rest)};
  }
  if (scheme == "memory") return StoreUrl{"memory", std::string(rest)};
  return InvalidArgumentError("store URL '" + std::string(url) + "': unsupported scheme '" +
                              scheme + "' (supported: file, memory, or a plain path)");
}

Result<std::unique_ptr<Store>> OpenStore(std::string_view url, PosixStoreOptions posix) {
  SP_ASSIGN_OR_RETURN(StoreUrl parsed, ParseStoreUrl(url));
  if (parsed.scheme == "memory") return std::unique_ptr<Store>(std::make_unique<MemoryStore>());
  return std::unique_ptr<Store>(std::make_unique<PosixStore>(posix));
}

}  // namespace sp
