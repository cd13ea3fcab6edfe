// Picks a Store by URL scheme. The one place where a scheme maps to an implementation.
//
//   "/ckpt/step-100", "ckpt", "file:///ckpt/step-100"  -> PosixStore
//   "memory://"                                        -> a new, empty MemoryStore
//   "s3://bucket/prefix/step-100"                      -> an S3Store on the bucket, configured
//                                                         from the environment and the AWS files
//                                                         (store/s3/aws_config.h)
//
// Anything else of the form "<scheme>://..." is kInvalidArgument naming the scheme. Thread-safe
// (no shared state).
#ifndef SHARDPOINT_STORE_OPEN_STORE_H_
#define SHARDPOINT_STORE_OPEN_STORE_H_

#include <memory>
#include <string>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/store/store.h"

namespace sp {

struct StoreUrl {
  std::string scheme;  // "file", "memory" or "s3"; a plain path gives "file"
  std::string path;    // the path inside the store: "file:///a/b" -> "/a/b"; "memory:///x" -> "/x";
                       // "s3://b/x/y" -> "/x/y"
  std::string bucket;  // s3 only
};

// Splits a URL into scheme and path. kInvalidArgument for an empty URL, an unsupported scheme, or
// a file URL that names a host ("file://host/x").
Result<StoreUrl> ParseStoreUrl(std::string_view url);

// Returns a new store for the URL's scheme (the caller owns it). Errors as ParseStoreUrl.
// `posix` configures the PosixStore of a file URL (allow_external_links).
Result<std::unique_ptr<Store>> OpenStore(std::string_view url, PosixStoreOptions posix = {});

}  // namespace sp

#endif  // SHARDPOINT_STORE_OPEN_STORE_H_
