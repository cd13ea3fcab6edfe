#include "shardpoint/plan/gathered_plans.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardpoint/plan/plan_codec.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {
namespace {

LocalTensor Rows(std::string name, int64_t rows, int64_t rank, int64_t world) {
  const int64_t per = rows / world;
  return LocalTensor{std::move(name), DType::kFloat32, {rows, 8}, {Box({rank * per, 0}, {per, 8})}};
}

TEST(GatheredPlansTest, NamesAndShapesAreStoredOnceAndBoxesAsValues) {
  constexpr int64_t kWorld = 64;
  GatheredPlans plans;
  for (int64_t r = 0; r < kWorld; ++r) {
    LocalSavePlan local;
    local.tensors = {Rows("a", 128, r, kWorld), Rows("b", 64, r, kWorld)};
    if (r % 2) std::swap(local.tensors[0], local.tensors[1]);  // another order on odd ranks
    local.tensors.push_back(LocalTensor{"c", DType::kInt8, {3}, {Box({0}, {3}), Box({1}, {0})}});
    local.objects = {{"step", ObjectEncoding::kJson, std::to_string(r)}};
    plans.AddRank(local);
  }
  ASSERT_EQ(plans.world_size(), static_cast<size_t>(kWorld));
  EXPECT_EQ(plans.name_count(), 3u);
  EXPECT_EQ(sizeof(GatheredPlans::Tensor), 32u);
  for (int64_t r = 0; r < kWorld; ++r) {
    std::span<const GatheredPlans::Tensor> tensors = plans.tensors(r);
    ASSERT_EQ(tensors.size(), 3u);
    const GatheredPlans::Tensor& a = tensors[r % 2];
    EXPECT_EQ(plans.name(a.name), "a");
    EXPECT_EQ(plans.shape(a.shape), (Shape{128, 8}));
    ASSERT_EQ(a.box_count, 1u);
    const int64_t* v = plans.box_values(a, 0);
    EXPECT_EQ(std::vector<int64_t>(v, v + 4), (std::vector<int64_t>{2 * r, 0, 2, 8}));
    const GatheredPlans::Tensor& c = tensors[2];
    EXPECT_EQ(c.dtype, DType::kInt8);
    ASSERT_EQ(c.box_count, 2u);  // the empty box is kept: box numbers are the rank's own
    EXPECT_EQ(plans.box_values(c, 1)[1], 0);
    ASSERT_EQ(plans.objects(r).size(), 1u);
    EXPECT_EQ(plans.objects(r)[0].payload, std::to_string(r));
  }
  // Same name and same shape on every rank: one id each.
  EXPECT_EQ(plans.tensors(0)[0].shape, plans.tensors(kWorld - 2)[0].shape);
  EXPECT_EQ(plans.tensors(1)[1].name, plans.tensors(kWorld - 1)[1].name);
}

// A box outside its shape is reported where PlanSave reaches it: after what an earlier tensor
// of the same rank, or an earlier rank, got wrong.
TEST(GatheredPlansTest, ABadBoxIsReportedInTheOrderOfTheLists) {
  const LocalTensor bad{"b", DType::kFloat32, {4}, {Box({2}, {4})}};
  const LocalTensor mismatched{"a", DType::kFloat32, {5}, {Box({0}, {5})}};
  std::vector<LocalSavePlan> locals(2);
  locals[0].tensors = {LocalTensor{"a", DType::kFloat32, {4}, {Box({0}, {4})}},
                       LocalTensor{"b", DType::kFloat32, {4}, {Box({0}, {4})}}};
  locals[1].tensors = {mismatched, bad};
  SavePlanOptions options;
  Result<GlobalSavePlan> plan = PlanSave(locals, options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(), "tensor 'a': rank 0 has shape [4] but rank 1 has [5]");
  locals[1].tensors = {bad, mismatched};
  plan = PlanSave(locals, options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "tensor 'b': rank 1 holds box [2:6], which is not within shape [4]");
}

TEST(GatheredPlansTest, MessagesDecodeIntoTheSamePlanAsLocalPlans) {
  constexpr int64_t kWorld = 8;
  std::vector<LocalSavePlan> locals(kWorld);
  GatheredPlans plans;
  for (int64_t r = 0; r < kWorld; ++r) {
    locals[r].tensors = {Rows("w", 32, r, kWorld),
                         LocalTensor{"bias", DType::kBFloat16, {8}, {Box({0}, {8})}}};
    locals[r].objects = {{"cfg", ObjectEncoding::kJson, "{}"}};
    ASSERT_TRUE(DecodeLocalSavePlanInto(EncodeLocalSavePlan(locals[r]), &plans).ok());
  }
  SavePlanOptions options;
  options.save_id = "g";
  Result<GlobalSavePlan> from_locals = PlanSave(locals, options);
  Result<GlobalSavePlan> from_messages = PlanSave(plans, options);
  ASSERT_TRUE(from_locals.ok()) << from_locals.status();
  ASSERT_TRUE(from_messages.ok()) << from_messages.status();
  EXPECT_EQ(from_messages->metadata, from_locals->metadata);
  EXPECT_EQ(from_messages->ranks, from_locals->ranks);
  ASSERT_EQ(from_messages->metadata.tensors.size(), 2u);
  EXPECT_EQ(from_messages->metadata.tensors[1].chunks.size(), static_cast<size_t>(kWorld));

  // A damaged message is refused with DecodeLocalSavePlan's error.
  const std::string message = EncodeLocalSavePlan(locals[0]);
  const std::string_view cut = std::string_view(message).substr(0, message.size() - 1);
  GatheredPlans more;
  const Status status = DecodeLocalSavePlanInto(cut, &more);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status, DecodeLocalSavePlan(cut).status());
}

}  // namespace
}  // namespace sp
