#include "shardpoint/geometry/dims.h"

#include <list>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

std::vector<int64_t> Values(const Dims& d) { return std::vector<int64_t>(d.begin(), d.end()); }

TEST(DimsTest, ConstructsFromEachSource) {
  EXPECT_TRUE(Dims().empty());
  EXPECT_EQ(Values(Dims(3, 7)), (std::vector<int64_t>{7, 7, 7}));
  EXPECT_EQ(Values(Dims{1, 2}), (std::vector<int64_t>{1, 2}));
  const std::vector<int64_t> six = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(Values(Dims(six)), six);
  EXPECT_EQ(Values(Dims(std::span<const int64_t>(six).subspan(1, 2))),
            (std::vector<int64_t>{2, 3}));
  const std::list<int64_t> listed = {9, 8, 7, 6, 5};
  EXPECT_EQ(Values(Dims(listed.begin(), listed.end())), (std::vector<int64_t>{9, 8, 7, 6, 5}));
  const std::vector<int64_t> back(Dims{4, 5, 6, 7, 8});  // explicit: it allocates
  EXPECT_EQ(back, (std::vector<int64_t>{4, 5, 6, 7, 8}));
}

TEST(DimsTest, StaysInlineUpToFourValues) {
  Dims d{1, 2, 3, 4};
  EXPECT_EQ(d.capacity(), Dims::kInline);
  const int64_t* inline_data = d.data();
  EXPECT_GE(reinterpret_cast<const char*>(inline_data), reinterpret_cast<const char*>(&d));
  EXPECT_LT(reinterpret_cast<const char*>(inline_data), reinterpret_cast<const char*>(&d + 1));
  d.push_back(5);  // now on the heap
  EXPECT_GT(d.capacity(), Dims::kInline);
  EXPECT_EQ(Values(d), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(sizeof(Dims), 40u);
}

// Copies and moves of inline and heap values leave both sides valid and independent.
TEST(DimsTest, CopiesAndMovesInlineAndHeapValues) {
  for (size_t n : {0u, 2u, 4u, 5u, 9u}) {
    Dims a;
    for (size_t i = 0; i < n; ++i) a.push_back(static_cast<int64_t>(10 * i + 1));
    const std::vector<int64_t> want = Values(a);
    Dims copy = a;
    copy.resize(copy.size() + 1, -1);
    EXPECT_EQ(Values(a), want);
    Dims moved = std::move(a);
    EXPECT_EQ(Values(moved), want);
    EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): a moved-from Dims is empty
    a = moved;
    EXPECT_EQ(Values(a), want);
    Dims target{7, 7, 7, 7, 7, 7};
    target = std::move(moved);
    EXPECT_EQ(Values(target), want);
    target = target;  // NOLINT: self-assignment keeps the values
    EXPECT_EQ(Values(target), want);
  }
}

// Every mutation agrees with std::vector over random sequences of operations.
TEST(DimsTest, RandomOperationsMatchAVector) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 300; ++trial) {
    Dims d;
    std::vector<int64_t> v;
    for (int step = 0; step < 40; ++step) {
      const int64_t x = static_cast<int64_t>(rng() % 1000) - 500;
      switch (rng() % 7) {
        case 0: d.push_back(x); v.push_back(x); break;
        case 1: if (!v.empty()) { d.pop_back(); v.pop_back(); } break;
        case 2: { const size_t n = rng() % 9; d.resize(n, x); v.resize(n, x); break; }
        case 3: { const size_t at = v.empty() ? 0 : rng() % (v.size() + 1);
                  d.insert(d.begin() + at, x); v.insert(v.begin() + static_cast<long>(at), x); break; }
        case 4: if (!v.empty()) { const size_t at = rng() % v.size();
                  d.erase(d.begin() + at); v.erase(v.begin() + static_cast<long>(at)); } break;
        case 5: { const size_t n = rng() % 7; d.assign(n, x); v.assign(n, x); break; }
        default: { Dims other = d; d = std::move(other); break; }
      }
      ASSERT_EQ(Values(d), v) << "trial " << trial << " step " << step;
      ASSERT_TRUE(d == v);
    }
  }
}

TEST(DimsTest, ComparesLikeVectors) {
  const std::vector<std::vector<int64_t>> cases = {{}, {0}, {0, 1}, {1}, {1, 0, 0, 0, 0}, {1, 0, 0, 0, 1}, {2}};
  for (const auto& a : cases) {
    for (const auto& b : cases) {
      EXPECT_EQ(Dims(a) == Dims(b), a == b);
      EXPECT_EQ(Dims(a) <=> Dims(b), a <=> b);
      EXPECT_EQ(Dims(a) == b, a == b);
      EXPECT_EQ(b == Dims(a), a == b);
    }
  }
}

}  // namespace
}  // namespace sp
