#include "shardpoint/plan/gathered_plans.h"

#include <algorithm>
#include <utility>

namespace sp {

uint32_t GatheredPlans::NameId(std::string_view name) {
  auto it = name_ids_.find(name);
  if (it != name_ids_.end()) return it->second;
  const uint32_t id = static_cast<uint32_t>(names_.size());
  names_.emplace_back(name);
  name_ids_.emplace(names_.back(), id);
  return id;
}

uint32_t GatheredPlans::ShapeId(std::span<const int64_t> shape) {
  Shape key(shape.begin(), shape.end());
  auto [it, inserted] = shape_ids_.try_emplace(std::move(key), static_cast<uint32_t>(shapes_.size()));
  if (inserted) shapes_.push_back(&it->first);
  return it->second;
}

void GatheredPlans::BeginRank() {
  if (world_size() == 1 && expected_ranks_ > 1) {
    tensors_.reserve(tensors_.size() * expected_ranks_);
    values_.reserve(values_.size() + own_values_ * (expected_ranks_ - 1));
  }
  rank_begin_.push_back(tensors_.size());
  objects_.emplace_back();
  part_of_rank_.push_back(kNoPart);
  next_local_ = 0;
}

GatheredPlans::Tensor GatheredPlans::NewEntry(std::string_view name, DType dtype,
                                              std::span<const int64_t> shape, uint32_t local) {
  const size_t position = tensors_.size() - rank_begin_[rank_begin_.size() - 2];
  if (previous_name_.size() <= position) {
    previous_name_.resize(position + 1, kUnset);
    previous_shape_.resize(position + 1, kUnset);
  }
  Tensor tensor;
  uint32_t& name_id = previous_name_[position];
  if (name_id == kUnset || names_[name_id] != name) name_id = NameId(name);
  uint32_t& shape_id = previous_shape_[position];
  if (shape_id == kUnset || !std::ranges::equal(*shapes_[shape_id], shape)) {
    shape_id = ShapeId(shape);
  }
  tensor.name = name_id;
  tensor.shape = shape_id;
  tensor.dtype = dtype;
  tensor.local = local == kUnset ? next_local_ : local;
  next_local_ = tensor.local + 1;
  return tensor;
}

void GatheredPlans::Append(const Tensor& tensor) {
  tensors_.push_back(tensor);
  rank_begin_.back() = tensors_.size();
}

uint64_t GatheredPlans::AddSharedBoxes(std::span<const Box> boxes) {
  const uint64_t first = values_.size();
  for (const Box& box : boxes) {
    values_.insert(values_.end(), box.offsets.begin(), box.offsets.end());
    values_.insert(values_.end(), box.sizes.begin(), box.sizes.end());
  }
  return first;
}

void GatheredPlans::AddTensor(std::string_view name, DType dtype, std::span<const int64_t> shape,
                              std::span<const Box> boxes, uint32_t local) {
  Tensor tensor = NewEntry(name, dtype, shape, local);
  tensor.first_value = values_.size();
  const Shape& tensor_shape = *shapes_[tensor.shape];
  for (const Box& box : boxes) {
    if (box.offsets.size() == box.sizes.size() && WithinShape(box, tensor_shape)) continue;
    // The error PlanSave returns (save_plan.h) when it reaches this tensor of this rank.
    const std::string where = "tensor '" + std::string(name) + "': rank " +
                              std::to_string(world_size() - 1);
    tensor.error = static_cast<uint32_t>(errors_.size());
    if (box.offsets.size() != box.sizes.size()) {
      errors_.push_back(InvalidArgumentError(where + " holds a box with " +
                                             std::to_string(box.offsets.size()) + " offsets and " +
                                             std::to_string(box.sizes.size()) + " sizes"));
    } else {
      errors_.push_back(InvalidArgumentError(where + " holds box " + box.ToString() +
                                             ", which is not within shape " +
                                             ShapeToString(tensor_shape)));
    }
    Append(tensor);
    return;
  }
  const uint64_t before = values_.size();
  AddSharedBoxes(boxes);
  own_values_ += world_size() == 1 ? values_.size() - before : 0;
  tensor.box_count = static_cast<uint32_t>(boxes.size());
  Append(tensor);
}

int64_t GatheredPlans::Rule::PositionOf(int64_t rank) const {
  auto it = std::lower_bound(by_rank.begin(), by_rank.end(), std::pair<int64_t, int64_t>{rank, -1});
  return it != by_rank.end() && it->first == rank ? it->second : -1;
}

uint32_t GatheredPlans::AddPart(std::vector<Rule> rules) {
  for (Rule& rule : rules) {
    rule.by_rank.resize(rule.rank_at.size());
    for (size_t p = 0; p < rule.rank_at.size(); ++p) {
      rule.by_rank[p] = {rule.rank_at[p], static_cast<int64_t>(p)};
    }
    std::sort(rule.by_rank.begin(), rule.by_rank.end());
  }
  parts_.push_back(Part{std::move(rules), {}, {}});
  return static_cast<uint32_t>(parts_.size() - 1);
}

void GatheredPlans::AddRuledTensor(uint32_t part, std::string_view name, DType dtype,
                                   std::span<const int64_t> shape, uint32_t local, uint32_t rule,
                                   uint64_t chunks) {
  RuledTensor tensor;
  tensor.chunks = chunks;
  tensor.name = NameId(name);
  tensor.shape = ShapeId(shape);
  tensor.local = local;
  tensor.rule = rule;
  tensor.dtype = dtype;
  parts_[part].tensors.push_back(tensor);
}

void GatheredPlans::UsePart(uint32_t part) {
  part_of_rank_.back() = part;
  parts_[part].ranks.push_back(static_cast<uint32_t>(world_size() - 1));
}

void GatheredPlans::AddObject(ObjectEntry object) { objects_.back().push_back(std::move(object)); }

void GatheredPlans::AddRank(const LocalSavePlan& plan) {
  BeginRank();
  for (const LocalTensor& t : plan.tensors) AddTensor(t.name, t.dtype, t.shape, t.boxes);
  for (const ObjectEntry& o : plan.objects) AddObject(o);
}

}  // namespace sp
