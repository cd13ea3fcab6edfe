#include "shardpoint/base/fingerprint.h"

#include <cstring>

#include "shardpoint/base/coding.h"

namespace sp {
namespace {

constexpr uint64_t kSeedLow = 0x9E3779B97F4A7C15ull;   // 2^64 / golden ratio
constexpr uint64_t kSeedHigh = 0xC2B2AE3D27D4EB4Full;  // an odd 64-bit prime
constexpr uint64_t kMultiplyLow = 0xFF51AFD7ED558CCDull;
constexpr uint64_t kMultiplyHigh = 0xC4CEB9FE1A85EC53ull;

// SplitMix64's finaliser: every input bit affects every output bit.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Step(uint64_t lane, uint64_t word, uint64_t multiply) {
  lane ^= word * multiply;
  lane = (lane << 29) | (lane >> 35);
  return lane * multiply + 0x52DCE729ull;
}

}  // namespace

std::string Fingerprint128::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(high >> (4 * i)) & 15];
    out[31 - i] = kDigits[(low >> (4 * i)) & 15];
  }
  return out;
}

Fingerprint128 Fingerprint(std::string_view bytes) {
  uint64_t low = kSeedLow;
  uint64_t high = kSeedHigh;
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t word = DecodeFixed64(bytes.data() + i);
    low = Step(low, word, kMultiplyLow);
    high = Step(high, word ^ (word >> 32), kMultiplyHigh);
  }
  if (i < bytes.size()) {
    char tail[8] = {};
    std::memcpy(tail, bytes.data() + i, bytes.size() - i);
    const uint64_t word = DecodeFixed64(tail);
    low = Step(low, word, kMultiplyLow);
    high = Step(high, word ^ (word >> 32), kMultiplyHigh);
  }
  const uint64_t length = bytes.size();
  Fingerprint128 out;
  out.low = Mix(low ^ Mix(high + length));
  out.high = Mix(high ^ Mix(low + length * kSeedLow));
  return out;
}

}  // namespace sp
