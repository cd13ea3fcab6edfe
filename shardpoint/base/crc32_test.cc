#include "shardpoint/base/crc32.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace sp {
namespace {

TEST(Crc32, MatchesZlib) {
  EXPECT_EQ(Crc32(0, "123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32(Crc32(0, "1234", 4), "56789", 5), 0xCBF43926u);
  EXPECT_EQ(Crc32(0, "", 0), 0u);
}

TEST(Crc32CombineTest, EqualsTheCrcOfTheConcatenationForRandomSplits) {
  std::mt19937_64 rng(7);
  std::string data(3 << 20, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (int i = 0; i < 200; ++i) {
    const size_t a = rng() % data.size();
    const size_t b = a + rng() % (data.size() - a + 1);  // three pieces: [0,a) [a,b) [b,end)
    const uint32_t whole = Crc32(0, data.data(), data.size());
    uint32_t combined = Crc32(0, data.data(), a);
    combined = Crc32Combine(combined, Crc32(0, data.data() + a, b - a), b - a);
    combined = Crc32Combine(combined, Crc32(0, data.data() + b, data.size() - b), data.size() - b);
    ASSERT_EQ(combined, whole) << "split at " << a << " and " << b;
  }
}

TEST(Crc32CombineTest, EmptyPiecesChangeNothing) {
  const std::string data = "shardpoint";
  const uint32_t crc = Crc32(0, data.data(), data.size());
  EXPECT_EQ(Crc32Combine(crc, 0, 0), crc);
  EXPECT_EQ(Crc32Combine(0, crc, data.size()), crc);
  // The check value of CRC-32 (IEEE) over "123456789", assembled from two pieces.
  EXPECT_EQ(Crc32Combine(Crc32(0, "12345", 5), Crc32(0, "6789", 4), 4), 0xcbf43926u);
}

}  // namespace
}  // namespace sp
