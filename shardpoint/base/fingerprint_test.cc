#include "shardpoint/base/fingerprint.h"

#include <bit>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

namespace sp {
namespace {

std::string RandomBytes(std::mt19937_64& rng, size_t size) {
  std::string out(size, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

int BitsChanged(const Fingerprint128& a, const Fingerprint128& b) {
  return std::popcount(a.low ^ b.low) + std::popcount(a.high ^ b.high);
}

TEST(FingerprintTest, EqualBytesEqualDigestsAndNoCollisionsAmongManyStrings) {
  std::mt19937_64 rng(7);
  std::set<std::string> inputs;
  std::set<uint64_t> lows, highs;
  for (int i = 0; i < 20000; ++i) {
    const std::string bytes = RandomBytes(rng, rng() % 64);
    EXPECT_EQ(Fingerprint(bytes), Fingerprint(std::string(bytes)));
    inputs.insert(bytes);
    lows.insert(Fingerprint(bytes).low);
    highs.insert(Fingerprint(bytes).high);
  }
  // Short strings repeat (there are only 256 of one byte); each lane alone tells apart the
  // distinct ones.
  EXPECT_GT(inputs.size(), 19000u);
  EXPECT_EQ(lows.size(), inputs.size());
  EXPECT_EQ(highs.size(), inputs.size());
}

TEST(FingerprintTest, OneFlippedBitChangesAboutHalfOfBothLanes) {
  std::mt19937_64 rng(11);
  int total = 0;
  int trials = 0;
  for (size_t size : {1, 7, 8, 9, 16, 100, 4096}) {
    for (int t = 0; t < 200; ++t) {
      std::string bytes = RandomBytes(rng, size);
      const Fingerprint128 before = Fingerprint(bytes);
      bytes[rng() % size] ^= static_cast<char>(1 << (rng() % 8));
      const Fingerprint128 after = Fingerprint(bytes);
      ASSERT_NE(before.low, after.low) << size;
      ASSERT_NE(before.high, after.high) << size;
      const int changed = BitsChanged(before, after);
      EXPECT_GT(changed, 30) << size;
      total += changed;
      ++trials;
    }
  }
  const double mean = static_cast<double>(total) / trials;
  EXPECT_GT(mean, 60.0);
  EXPECT_LT(mean, 68.0);
}

TEST(FingerprintTest, TrailingZerosAndLengthMatter) {
  const std::string a("abc", 3);
  const std::string b("abc\0", 4);
  const std::string c("abc\0\0\0\0\0", 8);
  EXPECT_NE(Fingerprint(a), Fingerprint(b));
  EXPECT_NE(Fingerprint(b), Fingerprint(c));
  EXPECT_NE(Fingerprint(""), Fingerprint(std::string(1, '\0')));
  EXPECT_NE(Fingerprint(std::string(8, '\0')), Fingerprint(std::string(16, '\0')));
}

TEST(FingerprintTest, ValueIsFixedAcrossBuilds) {
  // Ranks of one job compare digests computed on different machines: the value must not depend
  // on anything but the bytes. These are the digests this definition gives.
  EXPECT_EQ(Fingerprint("shardpoint layout").ToHex(), "6ce75ebb8c7a681e4ba469c2517e2e8d");
  EXPECT_EQ(Fingerprint("").ToHex(), "5908d5698a8f5aa3ccd8a7449c0ac4ba");
}

}  // namespace
}  // namespace sp
