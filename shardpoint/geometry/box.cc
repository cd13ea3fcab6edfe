#include "shardpoint/geometry/box.h"

#include <algorithm>
#include <span>

namespace sp {

namespace {

int64_t Volume(std::span<const int64_t> sizes) {
  int64_t v = 1;
  for (int64_t d : sizes) v *= d;
  return v;
}

std::string ValuesToString(std::span<const int64_t> values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

}  // namespace

int64_t ShapeVolume(const Shape& shape) { return Volume(shape); }
int64_t ShapeVolume(const Dims& sizes) { return Volume(sizes); }

std::string ShapeToString(const Shape& shape) { return ValuesToString(shape); }
std::string ShapeToString(const Dims& values) { return ValuesToString(values); }

Box Box::Whole(const Shape& shape) { return Box(Dims(shape.size(), 0), Dims(shape)); }

std::string Box::ToString() const {
  std::string out = "[";
  for (size_t i = 0; i < rank(); ++i) {
    if (i) out += ", ";
    int64_t end = 0;
    if (__builtin_add_overflow(offsets[i], sizes[i], &end)) {  // hostile: "offset:offset+size"
      out += std::to_string(offsets[i]) + ":" + std::to_string(offsets[i]) + "+" +
             std::to_string(sizes[i]);
    } else {
      out += std::to_string(offsets[i]) + ":" + std::to_string(end);
    }
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
