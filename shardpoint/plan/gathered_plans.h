// GatheredPlans: what every rank of a save holds, in one compact table (the coordinator's input
// to PlanSave).
//
// A save's coordinator receives one LocalSavePlan per rank. Decoded one by one, R ranks x T
// tensors are R * T strings, shapes and box lists: at 8,192 ranks x 1,000 tensors, 8 million of
// each and about 2 GB. Here each distinct name and shape is stored once, every box is a run of
// integers in one array, and a (rank, tensor) entry is 32 bytes; plan_codec.h decodes the
// ranks' messages straight into it (DecodeLocalSavePlanInto).
//
// Tensors laid out by a device-mesh rule (plan/ruled_plan.h) are not stored per rank at all: the
// ranks that send the same shared part use one Part, which lists its ruled tensors once with the
// chunk of every mesh position, and each rank records only which part it uses. PlanSave plans a
// tensor that every rank of its mesh lists through one part from the rule's holders directly.
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
#include <utility>
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
  static constexpr uint32_t kUnset = UINT32_MAX;

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
    uint32_t local = 0;        // its index in the rank's list (LocalSavePlan::tensors)
    DType dtype = DType::kFloat32;
  };

  static constexpr uint32_t kNoPart = UINT32_MAX;

  // The mesh of one layout rule: the rank at every position.
  struct Rule {
    std::vector<int64_t> rank_at;                        // by position
    std::vector<std::pair<int64_t, int64_t>> by_rank;    // (rank, position), sorted
    // The first position of `rank`, or -1 when the mesh does not hold it.
    int64_t PositionOf(int64_t rank) const;
  };
  // A tensor of a part with a rule: every rank of the part lists it, with the chunk the rule gives
  // at the rank's position (which may be empty).
  struct RuledTensor {
    uint64_t chunks = 0;  // position p's box at values()[chunks + p * 2 * rank, ...)
    uint32_t name = 0;
    uint32_t shape = 0;
    uint32_t local = 0;   // its index in the lists of the part's ranks
    uint32_t rule = 0;    // index into Part::rules
    DType dtype = DType::kFloat32;
  };
  // What a group of ranks shares: its rules and ruled tensors, and the ranks that use it.
  struct Part {
    std::vector<Rule> rules;
    std::vector<RuledTensor> tensors;
    std::vector<uint32_t> ranks;  // ascending
  };

  // Appends the next rank's plan.
  void AddRank(const LocalSavePlan& plan);

  // The same in parts, for decoders: BeginRank, then the rank's tensors and objects in order.
  void BeginRank();
  // `local`: the tensor's index in the rank's list; by default, the number of tensors added to
  // the rank before it.
  void AddTensor(std::string_view name, DType dtype, std::span<const int64_t> shape,
                 std::span<const Box> boxes, uint32_t local = kUnset);
  // Boxes that many tensors share (a layout rule's chunk of every mesh position, plan/
  // ruled_plan.h), stored once: appends them to the values and returns where the first begins
  // (box i at that + i * 2 * its rank). They must be within the shape of the tensors that use
  // them (not checked here).
  uint64_t AddSharedBoxes(std::span<const Box> boxes);
  void AddObject(ObjectEntry object);

  // Parts: AddPart, then its tensors; each rank that lists them calls UsePart (between its
  // BeginRank and the next). `rules[i].by_rank` need not be set: AddPart builds it.
  uint32_t AddPart(std::vector<Rule> rules);
  // `chunks` from AddSharedBoxes: the box of every position of the rule's mesh, in the shape.
  void AddRuledTensor(uint32_t part, std::string_view name, DType dtype,
                      std::span<const int64_t> shape, uint32_t local, uint32_t rule,
                      uint64_t chunks);
  void UsePart(uint32_t part);
  uint32_t part_of(size_t rank) const { return part_of_rank_[rank]; }
  const Part& part(uint32_t id) const { return parts_[id]; }

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
  uint32_t NameId(std::string_view name);
  uint32_t ShapeId(std::span<const int64_t> shape);
  // An entry of the current rank with its name and shape ids set (not yet appended).
  Tensor NewEntry(std::string_view name, DType dtype, std::span<const int64_t> shape,
                  uint32_t local);
  void Append(const Tensor& tensor);

  size_t expected_ranks_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<uint64_t> rank_begin_ = {0};  // rank r's tensors: [rank_begin_[r], rank_begin_[r+1])
  std::vector<std::vector<ObjectEntry>> objects_;
  std::vector<uint32_t> part_of_rank_;
  uint32_t next_local_ = 0;  // the current rank's next list index
  std::vector<Part> parts_;
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
