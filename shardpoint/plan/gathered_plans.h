// GatheredPlans: what every rank of a save holds, in one compact table (the coordinator's input
// to PlanSave).
//
// A save's coordinator receives one LocalSavePlan per rank. Decoded one by one, R ranks x T
// tensors are R * T strings, shapes and box lists: at 8,192 ranks x 1,000 tensors, 8 million of
// each and about 2 GB. Here each distinct name and shape is stored once, every box is a run of
// integers in one array, and a (rank, tensor) entry is 32 bytes; plan_codec.h decodes the
// ranks' messages straight into it (DecodeLocalSavePlanInto).
//
// Ranks are appended in order (rank 0 first). Nothing is checked against other ranks here;
// PlanSave does that, and also reports a box that is not within its tensor's shape. Such a box
// is not stored (its tensor records the error, which PlanSave returns when it reaches that
// tensor, just as it would for a LocalSavePlan).
#ifndef SHARDPOINT_PLAN_GATHERED_PLANS_H_
#define SHARDPOINT_PLAN_GATHERED_PLANS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/status.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

class GatheredPlans {
 public:
  static constexpr uint32_t kNoError = UINT32_MAX;

  GatheredPlans() = default;
  // `expected_ranks`: how many ranks will be added. Once the first is in, room is made for that
  // many ranks like it, so that the tables are not copied over and over as they grow.
  explicit GatheredPlans(size_t expected_ranks) : expected_ranks_(expected_ranks) {}
  // Moves keep the tables' nodes (so the views into them stay valid); a copy would not.
  GatheredPlans(GatheredPlans&&) = default;
  GatheredPlans& operator=(GatheredPlans&&) = default;
  GatheredPlans(const GatheredPlans&) = delete;
  GatheredPlans& operator=(const GatheredPlans&) = delete;

  // One tensor as one rank lists it.
  struct Tensor {
    uint64_t first_value = 0;  // its boxes: values()[first_value, + box_count * 2 * rank)
    uint32_t name = 0;         // name(name)
    uint32_t shape = 0;        // shape(shape): equal ids are equal shapes
    uint32_t box_count = 0;    // 0 when error != kNoError
    uint32_t error = kNoError; // error(error): a box of it is not within its shape
    DType dtype = DType::kFloat32;
  };

  // Appends the next rank's plan.
  void AddRank(const LocalSavePlan& plan);

  // The same in parts, for decoders: BeginRank, then the rank's tensors and objects in order.
  void BeginRank();
  void AddTensor(std::string_view name, DType dtype, std::span<const int64_t> shape,
                 std::span<const Box> boxes);
  // Boxes that many entries share (a layout rule's chunk of every mesh position, plan/
  // ruled_plan.h), stored once: appends them to the values and returns where the first begins
  // (box i at that + i * 2 * its rank). They must be within the shape of the tensors that use
  // them (not checked here).
  uint64_t AddSharedBoxes(std::span<const Box> boxes);
  // Appends a tensor of the current rank whose `box_count` boxes are at `first_value` in the
  // values (from AddSharedBoxes): nothing is copied.
  void AddTensorWithSharedBoxes(std::string_view name, DType dtype, std::span<const int64_t> shape,
                                uint64_t first_value, uint32_t box_count);
  void AddObject(ObjectEntry object);

  size_t world_size() const { return objects_.size(); }
  std::span<const Tensor> tensors(size_t rank) const {
    return std::span<const Tensor>(tensors_).subspan(rank_begin_[rank],
                                                     rank_begin_[rank + 1] - rank_begin_[rank]);
  }
  std::span<const ObjectEntry> objects(size_t rank) const { return objects_[rank]; }
  const std::string& name(uint32_t id) const { return names_[id]; }
  size_t name_count() const { return names_.size(); }
  const Shape& shape(uint32_t id) const { return *shapes_[id]; }
  const Status& error(uint32_t id) const { return errors_[id]; }
  // Offsets then sizes of box `b` of `tensor`: 2 * shape(tensor.shape).size() values.
  const int64_t* box_values(const Tensor& tensor, uint32_t b) const {
    return values_.data() + tensor.first_value + uint64_t{b} * 2 * shapes_[tensor.shape]->size();
  }
  const int64_t* values() const { return values_.data(); }

 private:
  static constexpr uint32_t kUnset = UINT32_MAX;

  uint32_t NameId(std::string_view name);
  uint32_t ShapeId(std::span<const int64_t> shape);
  // An entry of the current rank with its name and shape ids set (not yet appended).
  Tensor NewEntry(std::string_view name, DType dtype, std::span<const int64_t> shape);
  void Append(const Tensor& tensor);

  size_t expected_ranks_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<uint64_t> rank_begin_ = {0};  // rank r's tensors: [rank_begin_[r], rank_begin_[r+1])
  std::vector<std::vector<ObjectEntry>> objects_;
  std::vector<int64_t> values_;
  uint64_t own_values_ = 0;  // values added by AddTensor (not shared): sizes the reservation
  std::deque<std::string> names_;  // stable addresses: name_ids_ keys view them
  std::unordered_map<std::string_view, uint32_t> name_ids_;
  std::map<Shape, uint32_t> shape_ids_;
  std::vector<const Shape*> shapes_;  // by id: the keys of shape_ids_
  std::vector<Status> errors_;
  // Per list position, the name and shape ids the previous rank had there: ranks usually list
  // the same tensors in the same order, so most lookups are one comparison.
  std::vector<uint32_t> previous_name_, previous_shape_;
};

// PlanSave on the gathered plans (save_plan.h describes the plan and its errors).
Result<GlobalSavePlan> PlanSave(const GatheredPlans& plans, const SavePlanOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_PLAN_GATHERED_PLANS_H_
