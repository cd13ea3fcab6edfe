// Tests of Diff: slab splitting, key and value differences, tolerance, NaNs, integers, objects,
// and the same answers with tiny slabs as with large ones.
#include "shardpoint/manage/diff.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace spt = ::sp::testing;

TEST(SplitIntoSlabsTest, TilesTheBoxWithinTheLimit) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t rank = rng() % 4;
    Box box;
    for (size_t d = 0; d < rank; ++d) {
      box.offsets.push_back(static_cast<int64_t>(rng() % 5));
      box.sizes.push_back(1 + static_cast<int64_t>(rng() % 6));
    }
    const uint64_t item = 1u << (rng() % 4);
    const uint64_t max_bytes = 1 + rng() % 200;
    std::vector<Box> slabs = SplitIntoSlabs(box, item, max_bytes);
    // Row-major order, disjoint, inside the box, covering it: the slabs' elements enumerated in
    // order are exactly the box's elements in row-major order.
    std::vector<std::vector<int64_t>> seen;
    for (const Box& s : slabs) {
      ASSERT_TRUE(Contains(box, s)) << s.ToString() << " in " << box.ToString();
      if (s.volume() > 1) {
        EXPECT_LE(static_cast<uint64_t>(s.volume()) * item, max_bytes) << s.ToString();
      }
      for (int64_t e = 0; e < s.volume(); ++e) {
        std::vector<int64_t> idx(rank);
        int64_t rest = e;
        for (size_t d = rank; d-- > 0;) {
          idx[d] = s.offsets[d] + rest % s.sizes[d];
          rest /= s.sizes[d];
        }
        seen.push_back(idx);
      }
    }
    ASSERT_EQ(static_cast<int64_t>(seen.size()), box.volume()) << box.ToString();
    for (size_t i = 1; i < seen.size(); ++i) ASSERT_LT(seen[i - 1], seen[i]) << box.ToString();
  }
}

TEST(SplitIntoSlabsTest, CutsOutermostDimensionsFirst) {
  // 4 x 8 float32 = 128 bytes; 64 bytes per slab: two slabs of two rows.
  std::vector<Box> slabs = SplitIntoSlabs(Box({0, 0}, {4, 8}), 4, 64);
  EXPECT_THAT(slabs, ElementsAre(Box({0, 0}, {2, 8}), Box({2, 0}, {2, 8})));
  // A row is too big: each row is cut.
  slabs = SplitIntoSlabs(Box({10, 0}, {2, 8}), 4, 16);
  EXPECT_THAT(slabs, ElementsAre(Box({10, 0}, {1, 4}), Box({10, 4}, {1, 4}), Box({11, 0}, {1, 4}),
                                 Box({11, 4}, {1, 4})));
  EXPECT_TRUE(SplitIntoSlabs(Box({0}, {0}), 4, 16).empty());
}

class DiffTest : public ::testing::Test {
 protected:
  void Save(const std::string& path, const std::vector<spt::WholeTensor>& tensors,
            const std::vector<ObjectEntry>& objects = {}, int ranks = 2) {
    ASSERT_TRUE(store_.CreateDirs(path).ok());
    Status s = spt::SaveWhole(&store_, path, tensors, objects, ranks);
    ASSERT_TRUE(s.ok()) << s;
  }
  Result<DiffReport> Run(double atol = 0, uint64_t slab_bytes = uint64_t{64} << 20) {
    DiffOptions options;
    options.store_a = &store_;
    options.store_b = &store_;
    options.atol = atol;
    options.slab_bytes = slab_bytes;
    options.threads = 2;
    return Diff("/a", "/b", options);
  }
  MemoryStore store_;
};

TEST_F(DiffTest, SameValuesInDifferentLayoutsAreEqual) {
  std::vector<spt::WholeTensor> tensors = {
      spt::Iota("w", {12, 5}), spt::Iota("b", {7}, 3),
      spt::MakeTensor<int64_t>("step", DType::kInt64, {}, {42})};
  Save("/a", tensors, {{"cfg", ObjectEncoding::kJson, "{\"lr\":1}"}}, 2);
  Save("/b", tensors, {{"cfg", ObjectEncoding::kJson, "{\"lr\":1}"}}, 3);
  for (uint64_t slab : {uint64_t{64} << 20, uint64_t{12}, uint64_t{1}}) {
    Result<DiffReport> report = Run(0, slab);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->equal()) << slab;
    EXPECT_EQ(report->tensors_compared, 3u);
    EXPECT_EQ(report->elements_compared, 60u + 7u + 1u);
  }
}

TEST_F(DiffTest, KeysOnlyOnOneSideAndMismatches) {
  Save("/a",
       {spt::Iota("both", {4}), spt::Iota("only.a", {2}), spt::Iota("shape", {4, 2}),
        spt::Iota("dtype", {3})},
       {{"o.a", ObjectEncoding::kJson, "1"}, {"o.same", ObjectEncoding::kJson, "2"}});
  Save("/b",
       {spt::Iota("both", {4}), spt::Iota("only.b", {2}), spt::Iota("shape", {2, 4}),
        spt::MakeTensor<double>("dtype", DType::kFloat64, {3}, {0, 1, 2})},
       {{"o.b", ObjectEncoding::kJson, "1"}, {"o.same", ObjectEncoding::kJson, "3"}});
  Result<DiffReport> report = Run();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->equal());
  EXPECT_THAT(report->tensors_only_in_a, ElementsAre("only.a"));
  EXPECT_THAT(report->tensors_only_in_b, ElementsAre("only.b"));
  EXPECT_THAT(report->objects_only_in_a, ElementsAre("o.a"));
  EXPECT_THAT(report->objects_only_in_b, ElementsAre("o.b"));
  EXPECT_THAT(report->objects_differ, ElementsAre("o.same"));
  ASSERT_EQ(report->mismatched.size(), 2u);
  EXPECT_EQ(report->mismatched[0].name, "dtype");
  EXPECT_EQ(report->mismatched[0].dtype_b, DType::kFloat64);
  EXPECT_EQ(report->mismatched[1].name, "shape");
  EXPECT_EQ(report->mismatched[1].shape_b, (Shape{2, 4}));
  EXPECT_TRUE(report->values_differ.empty());
  EXPECT_EQ(report->tensors_compared, 1u);
}

TEST_F(DiffTest, FloatDifferencesToleranceAndFirstIndex) {
  spt::WholeTensor a = spt::Iota("w", {6, 4});
  spt::WholeTensor b = a;
  float* v = reinterpret_cast<float*>(b.bytes.data());
  v[4 * 4 + 1] += 0.5f;   // (4, 1)
  v[1 * 4 + 2] += 0.25f;  // (1, 2): first in row-major order
  Save("/a", {a});
  Save("/b", {b});
  for (uint64_t slab : {uint64_t{1} << 20, uint64_t{8}}) {
    Result<DiffReport> report = Run(0, slab);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->values_differ.size(), 1u);
    const TensorValueDiff& d = report->values_differ[0];
    EXPECT_EQ(d.name, "w");
    EXPECT_EQ(d.elements_differing, 2u);
    EXPECT_DOUBLE_EQ(d.max_abs_diff, 0.5);
    EXPECT_EQ(d.first_index, (std::vector<int64_t>{1, 2})) << slab;
  }
  Result<DiffReport> tolerant = Run(0.3);
  ASSERT_TRUE(tolerant.ok());
  ASSERT_EQ(tolerant->values_differ.size(), 1u);
  EXPECT_EQ(tolerant->values_differ[0].elements_differing, 1u);
  EXPECT_EQ(tolerant->values_differ[0].first_index, (std::vector<int64_t>{4, 1}));
  Result<DiffReport> loose = Run(0.5);
  ASSERT_TRUE(loose.ok());
  EXPECT_TRUE(loose->equal());
}

TEST_F(DiffTest, NaNsAndIntegers) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  Save("/a", {spt::MakeTensor<double>("f", DType::kFloat64, {4}, {nan, 1, inf, nan}),
              spt::MakeTensor<int64_t>("i", DType::kInt64, {3}, {1, 2, int64_t{1} << 40}),
              spt::MakeTensor<uint8_t>("flag", DType::kBool, {2}, {0, 1})});
  Save("/b", {spt::MakeTensor<double>("f", DType::kFloat64, {4}, {nan, 1, inf, 2}),
              spt::MakeTensor<int64_t>("i", DType::kInt64, {3}, {1, 2, (int64_t{1} << 40) + 3}),
              spt::MakeTensor<uint8_t>("flag", DType::kBool, {2}, {0, 1})});
  Result<DiffReport> report = Run(1e9);  // atol does not apply to integers; NaN vs 2 always differs
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->values_differ.size(), 2u);
  EXPECT_EQ(report->values_differ[0].name, "f");
  EXPECT_EQ(report->values_differ[0].elements_differing, 1u);
  EXPECT_EQ(report->values_differ[0].max_abs_diff, inf);
  EXPECT_EQ(report->values_differ[0].first_index, (std::vector<int64_t>{3}));
  EXPECT_EQ(report->values_differ[1].name, "i");
  EXPECT_EQ(report->values_differ[1].max_abs_diff, 3.0);
  EXPECT_EQ(report->values_differ[1].first_index, (std::vector<int64_t>{2}));
}

TEST_F(DiffTest, Errors) {
  Save("/a", {spt::Iota("w", {2})});
  Result<DiffReport> missing = Run();
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/b"));
  Save("/b", {spt::Iota("w", {2})});
  EXPECT_THAT(Run(-1).status().message(), HasSubstr("atol must be a number >= 0"));
  EXPECT_THAT(Run(std::nan("")).status().message(), HasSubstr("atol"));
  EXPECT_THAT(Run(0, 0).status().message(), HasSubstr("slab_bytes must be positive"));
}

}  // namespace
}  // namespace sp
