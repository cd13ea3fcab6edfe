// Random identifiers for names that must not collide across saves: a save's id (data file names
// carry it) and the tag of files a prune rewrites.
#ifndef SHARDPOINT_BASE_RANDOM_ID_H_
#define SHARDPOINT_BASE_RANDOM_ID_H_

#include <cstddef>
#include <string>

namespace sp {

// `digits` (at most 16) lowercase hex digits from std::random_device mixed with the steady clock,
// so that two processes started at once, or a random_device with little entropy, still differ.
// Thread-safe.
std::string RandomHexId(size_t digits);

}  // namespace sp

#endif  // SHARDPOINT_BASE_RANDOM_ID_H_
