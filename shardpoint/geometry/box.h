// Box: an N-dimensional region of a tensor, given by per-dimension offsets and sizes.
//
// A box is a value type in global (tensor) coordinates unless a function says otherwise. Rank 0
// boxes (scalars) have volume 1. A box with any size 0 is empty (volume 0) and intersects nothing.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_GEOMETRY_BOX_H_
#define SHARDPOINT_GEOMETRY_BOX_H_

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/geometry/dims.h"

namespace sp {

using Shape = std::vector<int64_t>;

// Product of the dimensions; 1 for rank 0. Callers validate sizes are non-negative.
int64_t ShapeVolume(const Shape& shape);
int64_t ShapeVolume(const Dims& sizes);

// "[4, 8]"
std::string ShapeToString(const Shape& shape);
std::string ShapeToString(const Dims& values);

// Offsets and sizes are Dims: inline up to rank 4, so most boxes own no heap memory.
struct Box {
  Dims offsets;
  Dims sizes;

  Box() = default;
  Box(Dims offsets_in, Dims sizes_in) : offsets(std::move(offsets_in)), sizes(std::move(sizes_in)) {}

  // The box [0, shape) covering a whole tensor.
  static Box Whole(const Shape& shape);

  size_t rank() const { return sizes.size(); }
  int64_t volume() const { return ShapeVolume(sizes); }
  bool empty() const { return volume() == 0; }
  int64_t exclusive_max(size_t dim) const { return offsets[dim] + sizes[dim]; }

  // "[0:4, 8:16]" (inclusive_min:exclusive_max per dimension); "[]" for rank 0.
  std::string ToString() const;

  friend bool operator==(const Box&, const Box&) = default;
  friend auto operator<=>(const Box& a, const Box& b) {
    if (auto c = a.offsets <=> b.offsets; c != 0) return c;
    return a.sizes <=> b.sizes;
  }
};

// The common region of two boxes of equal rank, or nullopt when it is empty.
std::optional<Box> Intersect(const Box& a, const Box& b);

// True when every point of `inner` lies in `outer` (an empty inner is contained anywhere).
bool Contains(const Box& outer, const Box& inner);

// True when the box has the shape's rank, non-negative offsets and sizes, and lies in [0, shape).
bool WithinShape(const Box& box, const Shape& shape);

// `box` expressed relative to `origin.offsets` (origin must contain box).
Box RelativeTo(const Box& box, const Box& origin);

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_BOX_H_
