#include "shardpoint/base/inline_vector.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace sp {
namespace {

// The checksum lists of stored chunks: two values inline in 16 bytes. (The rank-4 Dims of boxes
// are tested in geometry/dims_test.cc.)
using Checksums = InlineVector<uint32_t, 2>;

TEST(InlineVectorTest, TwoValuesInlineThenTheHeap) {
  EXPECT_EQ(sizeof(Checksums), 16u);
  Checksums c;
  c.push_back(7);
  c.push_back(8);
  EXPECT_EQ(c.capacity(), 2u);
  c.push_back(9);
  EXPECT_GT(c.capacity(), 2u);
  EXPECT_EQ(std::vector<uint32_t>(c), (std::vector<uint32_t>{7, 8, 9}));
  Checksums copy = c;
  c[0] = 1;
  EXPECT_EQ(copy[0], 7u);
  Checksums moved = std::move(copy);
  EXPECT_EQ(moved, (std::vector<uint32_t>{7, 8, 9}));
  EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from list is empty
}

TEST(InlineVectorTest, RandomResizesAndAssignmentsMatchAVector) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    Checksums c;
    std::vector<uint32_t> v;
    for (int step = 0; step < 30; ++step) {
      const uint32_t x = rng();
      switch (rng() % 4) {
        case 0: { const size_t n = rng() % 6; c.resize(n, x); v.resize(n, x); break; }
        case 1: c.push_back(x); v.push_back(x); break;
        case 2: { std::vector<uint32_t> values(rng() % 5, x);
                  c.assign(values.begin(), values.end()); v = values; break; }
        default: { Checksums other(c); c = other; break; }
      }
      ASSERT_EQ(std::vector<uint32_t>(c), v) << "trial " << trial << " step " << step;
    }
  }
}

}  // namespace
}  // namespace sp
