#include "shardpoint/base/random_id.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>

namespace sp {

std::string RandomHexId(size_t digits) {
  std::random_device rd;
  uint64_t bits = (uint64_t{rd()} << 32) ^ rd() ^
                  static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  static const char kHex[] = "0123456789abcdef";
  std::string id(std::min<size_t>(digits, 16), '0');
  for (char& c : id) {
    c = kHex[bits & 15];
    bits >>= 4;
  }
  return id;
}

}  // namespace sp
