#include "shardpoint/geometry/flat_range.h"

#include <string>

namespace sp {
namespace {

// Appends the boxes covering flat range [begin, end) (relative to the sub-block whose dims < dim
// are fixed at prefix) of `box`. `strides[d]` is the number of elements of one step on dim d.
// Requires 0 <= begin < end <= box.sizes[dim] * strides[dim].
class FlatRangeDecomposer {
 public:
  FlatRangeDecomposer(const Box& box, std::vector<Box>* out) : box_(box), out_(out) {
    strides_.assign(box.rank(), 1);
    for (size_t d = box.rank(); d-- > 1;) strides_[d - 1] = strides_[d] * box.sizes[d];
    prefix_.assign(box.offsets.begin(), box.offsets.end());
  }

  void Decompose(size_t dim, int64_t begin, int64_t end) {
    const int64_t stride = strides_[dim];
    const int64_t first_row = begin / stride;
    const int64_t last_row = end / stride;  // exclusive of a partial tail row
    const int64_t head = begin % stride;
    const int64_t tail = end % stride;
    if (first_row == last_row) {  // the range lies within one row of `dim`
      prefix_[dim] = box_.offsets[dim] + first_row;
      Decompose(dim + 1, head, tail);
      return;
    }
    int64_t full_begin = first_row;
    if (head != 0) {
      prefix_[dim] = box_.offsets[dim] + first_row;
      Decompose(dim + 1, head, stride);
      ++full_begin;
    }
    if (last_row > full_begin) Emit(dim, full_begin, last_row);
    if (tail != 0) {
      prefix_[dim] = box_.offsets[dim] + last_row;
      Decompose(dim + 1, 0, tail);
    }
  }

 private:
  // Emits the box: prefix on dims < dim, rows [row_begin, row_end) on dim, full beyond.
  void Emit(size_t dim, int64_t row_begin, int64_t row_end) {
    Box piece = box_;
    for (size_t d = 0; d < dim; ++d) {
      piece.offsets[d] = prefix_[d];
      piece.sizes[d] = 1;
    }
    piece.offsets[dim] = box_.offsets[dim] + row_begin;
    piece.sizes[dim] = row_end - row_begin;
    out_->push_back(std::move(piece));
  }

  const Box& box_;
  std::vector<Box>* out_;
  std::vector<int64_t> strides_;
  std::vector<int64_t> prefix_;
};

}  // namespace

Result<std::vector<Box>> DecomposeFlatRange(const Box& box, int64_t flat_begin, int64_t flat_end) {
  if (box.offsets.size() != box.sizes.size()) {
    return InvalidArgumentError("flat range of box " + box.ToString() + ": offsets and sizes differ in rank");
  }
  for (int64_t size : box.sizes) {
    if (size < 0) return InvalidArgumentError("flat range of box " + box.ToString() + ": negative size");
  }
  const int64_t volume = box.volume();
  if (flat_begin < 0 || flat_begin > flat_end || flat_end > volume) {
    return InvalidArgumentError("flat range [" + std::to_string(flat_begin) + ", " +
                                std::to_string(flat_end) + ") of box " + box.ToString() +
                                ": expected 0 <= begin <= end <= volume " + std::to_string(volume));
  }
  std::vector<Box> out;
  if (flat_begin == flat_end) return out;
  if (box.rank() == 0) {
    out.push_back(box);
    return out;
  }
  FlatRangeDecomposer decomposer(box, &out);
  decomposer.Decompose(0, flat_begin, flat_end);
  return out;
}

}  // namespace sp
