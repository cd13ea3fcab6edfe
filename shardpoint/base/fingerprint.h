// Fingerprint128: a 128-bit digest of a byte string, to tell whether two ranks hold the same bytes
// without sending them.
//
// Not cryptographic: it guards against accident (two different plans with equal digests happen
// with a probability near 2^-128 per pair), not against a rank forging a collision on purpose; the
// ranks of one job trust each other. Two independent 64-bit lanes, each a multiply-xorshift over
// 8-byte little-endian words with its own seed, finished by the SplitMix64 finaliser over the
// lane, the other lane and the length. The value depends only on the bytes (not on the machine's
// byte order or alignment), so it may travel between ranks of one build. Pure and thread-safe.
#ifndef SHARDPOINT_BASE_FINGERPRINT_H_
#define SHARDPOINT_BASE_FINGERPRINT_H_

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

namespace sp {

struct Fingerprint128 {
  uint64_t low = 0;
  uint64_t high = 0;

  // 32 lowercase hex digits, high lane first.
  std::string ToHex() const;
  friend bool operator==(const Fingerprint128&, const Fingerprint128&) = default;
  friend auto operator<=>(const Fingerprint128&, const Fingerprint128&) = default;
};

Fingerprint128 Fingerprint(std::string_view bytes);

}  // namespace sp

#endif  // SHARDPOINT_BASE_FINGERPRINT_H_
