#include "shardpoint/layout/pieces.h"

#include "shardpoint/geometry/flat_range.h"

namespace sp {

Status ValidateBoxes(const std::string& tensor, const Shape& shape, std::span<const Box> boxes) {
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& box = boxes[i];
    if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) {
      return InvalidArgumentError("tensor \"" + tensor + "\": box " + std::to_string(i) + " " +
                                  box.ToString() + " has rank " +
                                  std::to_string(box.sizes.size()) + ", expected the rank " +
                                  std::to_string(shape.size()) + " of shape " +
                                  ShapeToString(shape));
    }
    if (!WithinShape(box, shape)) {
      return InvalidArgumentError("tensor \"" + tensor + "\": box " + std::to_string(i) + " " +
                                  box.ToString() + " is out of bounds of shape " +
                                  ShapeToString(shape));
    }
  }
  return OkStatus();
}

Result<std::vector<Piece>> FlatRangePieces(const Shape& global_shape, const Box& box,
                                           int64_t flat_begin, int64_t flat_end) {
  if (!WithinShape(box, global_shape)) {
    return InvalidArgumentError("flat range box " + box.ToString() + " is out of bounds of shape " +
                                ShapeToString(global_shape));
  }
  SP_ASSIGN_OR_RETURN(std::vector<Box> boxes, DecomposeFlatRange(box, flat_begin, flat_end));
  std::vector<Piece> pieces;
  pieces.reserve(boxes.size());
  int64_t offset = 0;
  for (Box& b : boxes) {
    const int64_t volume = b.volume();
    pieces.push_back(Piece{std::move(b), offset});
    offset += volume;
  }
  return pieces;
}

}  // namespace sp
