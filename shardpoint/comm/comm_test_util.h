// Payloads for communicator tests: deterministic pseudo-random bytes that can be checked
// against their seed without keeping a second copy of a large buffer.
#ifndef SHARDPOINT_COMM_COMM_TEST_UTIL_H_
#define SHARDPOINT_COMM_COMM_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace sp::testing {

inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// `size` bytes determined by `seed`.
inline std::string MakePayload(size_t size, uint64_t seed) {
  std::string out(size, '\0');
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = SplitMix64(state);
    std::memcpy(&out[i], &word, 8);
  }
  const uint64_t tail = SplitMix64(state);
  std::memcpy(&out[i], &tail, size - i);
  return out;
}

// True when `bytes` equals MakePayload(size, seed), byte for byte.
inline bool MatchesPayload(const std::string& bytes, size_t size, uint64_t seed) {
  if (bytes.size() != size) return false;
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = SplitMix64(state);
    if (std::memcmp(&bytes[i], &word, 8) != 0) return false;
  }
  const uint64_t tail = SplitMix64(state);
  return std::memcmp(&bytes[i], &tail, size - i) == 0;
}

}  // namespace sp::testing

#endif  // SHARDPOINT_COMM_COMM_TEST_UTIL_H_
