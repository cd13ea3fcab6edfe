#include "shardpoint/geometry/box.h"

#include <algorithm>

namespace sp {

int64_t ShapeVolume(const Shape& shape) {
  int64_t v = 1;
  for (int64_t d : shape) v *= d;
  return v;
}

std::string ShapeToString(const Shape& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

Box Box::Whole(const Shape& shape) { return Box(std::vector<int64_t>(shape.size(), 0), shape); }

std::string Box::ToString() const {
  std::string out = "[";
  for (size_t i = 0; i < rank(); ++i) {
    if (i) out += ", ";
    out += std::to_string(offsets[i]) + ":" + std::to_string(offsets[i] + sizes[i]);
  }
  return out + "]";
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Box out;
  out.offsets.resize(a.rank());
  out.sizes.resize(a.rank());
  for (size_t d = 0; d < a.rank(); ++d) {
    int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    int64_t hi = std::min(a.exclusive_max(d), b.exclusive_max(d));
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.sizes[d] = hi - lo;
  }
  return out;
}

bool Contains(const Box& outer, const Box& inner) {
  if (outer.rank() != inner.rank()) return false;
  if (inner.empty()) return true;
  for (size_t d = 0; d < outer.rank(); ++d) {
    if (inner.offsets[d] < outer.offsets[d]) return false;
    if (inner.exclusive_max(d) > outer.exclusive_max(d)) return false;
  }
  return true;
}

bool WithinShape(const Box& box, const Shape& shape) {
  if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) return false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (box.offsets[d] < 0 || box.sizes[d] < 0) return false;
    if (box.offsets[d] > shape[d] || box.sizes[d] > shape[d] - box.offsets[d]) return false;
  }
  return true;
}

Box RelativeTo(const Box& box, const Box& origin) {
  Box out = box;
  for (size_t d = 0; d < box.rank(); ++d) out.offsets[d] -= origin.offsets[d];
  return out;
}

}  // namespace sp
