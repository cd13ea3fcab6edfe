#include "shardpoint/base/crc32c.h"

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

uint32_t Reference(const std::string& s) {
  uint32_t c = ~0u;
  for (unsigned char ch : s) {
    c ^= ch;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);  // RFC 3720 B.4
}

TEST(Crc32cTest, ExtendEqualsWholeAndMatchesBitwiseReference) {
  std::mt19937_64 rng(42);
  for (int len : {1, 7, 8, 63, 64, 1000, 65537}) {
    std::string s(len, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    uint32_t whole = Crc32c(s);
    EXPECT_EQ(whole, Reference(s)) << len << " via " << Crc32cImplementation();
    size_t cut = len / 3;
    uint32_t part = Crc32cExtend(Crc32c(s.data(), cut), s.data() + cut, len - cut);
    EXPECT_EQ(part, whole);
  }
}

}  // namespace
}  // namespace sp
