// Checks of the state a caller hands to Save or Load, before any collective step.
#ifndef SHARDPOINT_ENGINE_LOCAL_STATE_H_
#define SHARDPOINT_ENGINE_LOCAL_STATE_H_

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/status.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

// Turns one rank's tensor (its pieces of a global tensor) into the planner's LocalTensor, after
// checking the name is new to this rank (`names`), the shape has no negative dimension, every
// piece fits in the shape, and non-empty pieces have memory. kInvalidArgument names the tensor,
// the piece and the shape. Piece is ConstPieceView or PieceView. With `data_optional`, pieces
// may have no memory (a save whose SaveOptions::fill_piece or fill_range provides their bytes).
template <typename Tensor>
Result<LocalTensor> ToLocalTensor(const Tensor& t, std::set<std::string_view>& names,
                                  bool data_optional = false) {
  if (t.name.empty()) return InvalidArgumentError("a tensor has an empty name");
  if (!names.insert(t.name).second) {
    return InvalidArgumentError("tensor '" + t.name + "' appears twice in the state of one rank");
  }
  for (int64_t d : t.shape) {
    if (d < 0) {
      return InvalidArgumentError("tensor '" + t.name + "' has a negative dimension in shape " +
                                  ShapeToString(t.shape));
    }
  }
  LocalTensor local{t.name, t.dtype, t.shape, {}};
  local.boxes.reserve(t.pieces.size());
  for (const auto& piece : t.pieces) {
    if (!WithinShape(piece.box, t.shape)) {
      return InvalidArgumentError("tensor '" + t.name + "': piece " + piece.box.ToString() +
                                  " does not fit in shape " + ShapeToString(t.shape));
    }
    if (piece.data == nullptr && !piece.box.empty() && !data_optional) {
      return InvalidArgumentError("tensor '" + t.name + "': piece " + piece.box.ToString() +
                                  " has no memory");
    }
    local.boxes.push_back(piece.box);
  }
  return local;
}

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_LOCAL_STATE_H_
