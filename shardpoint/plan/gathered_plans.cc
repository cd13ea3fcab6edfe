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
}

GatheredPlans::Tensor GatheredPlans::NewEntry(std::string_view name, DType dtype,
                                              std::span<const int64_t> shape) {
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

void GatheredPlans::AddTensorWithSharedBoxes(std::string_view name, DType dtype,
                                             std::span<const int64_t> shape, uint64_t first_value,
                                             uint32_t box_count) {
  Tensor tensor = NewEntry(name, dtype, shape);
  tensor.first_value = first_value;
  tensor.box_count = box_count;
  Append(tensor);
}

void GatheredPlans::AddTensor(std::string_view name, DType dtype, std::span<const int64_t> shape,
                              std::span<const Box> boxes) {
  Tensor tensor = NewEntry(name, dtype, shape);
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

void GatheredPlans::AddObject(ObjectEntry object) { objects_.back().push_back(std::move(object)); }

void GatheredPlans::AddRank(const LocalSavePlan& plan) {
  BeginRank();
  for (const LocalTensor& t : plan.tensors) AddTensor(t.name, t.dtype, t.shape, t.boxes);
  for (const ObjectEntry& o : plan.objects) AddObject(o);
}

}  // namespace sp
