// Box sets: the geometry that planning needs over many boxes at once.
//
// A save plan must prove that the distinct chunks of a tensor neither overlap nor leave a hole,
// and a load plan must pair every destination box with the stored chunks it intersects. Done
// naively both are quadratic in the number of boxes; at 1,024 ranks that is a million box tests
// per tensor. These functions sweep along one dimension instead: boxes are sorted by their
// offset in the sweep dimension and only boxes whose intervals in that dimension overlap are
// compared. The sweep dimension is the one in which the boxes are narrowest relative to their
// common extent, which for the usual layouts (row-, column- or grid-sharded) makes the number of
// comparisons close to the number of true intersections.
//
// Boxes are passed as pointers so callers can index boxes that live inside other structures
// without copying them. All boxes given to one call must have the same rank; empty boxes are
// ignored. Every function is pure, deterministic (results depend only on the inputs and their
// order) and thread-safe.
#ifndef SHARDPOINT_PLAN_BOX_SET_H_
#define SHARDPOINT_PLAN_BOX_SET_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "shardpoint/geometry/box.h"

namespace sp {

// True when `a` and `b` (same rank) share at least one point. Allocation-free.
bool BoxesOverlap(const Box& a, const Box& b);

// Returns the positions (first < second) in `boxes` of two non-empty boxes that share a point,
// or nullopt when the non-empty boxes are pairwise disjoint. When several pairs overlap, which
// one is returned depends only on the input.
std::optional<std::pair<size_t, size_t>> FindOverlappingPair(std::span<const Box* const> boxes);

// Every pair (i, j) such that a[i] and b[j] share a point, in an order that depends only on the
// inputs. Cost: O((|a| + |b|) log(|a| + |b|)) plus the number of pairs whose intervals overlap
// in the sweep dimension.
std::vector<std::pair<uint32_t, uint32_t>> IntersectingPairs(std::span<const Box* const> a,
                                                             std::span<const Box* const> b);

// Looks for a point of `shape` that no box in `boxes` contains, testing at most `max_box_tests`
// (candidate point, box) pairs. Candidates are the origin and, for every box and dimension, the
// point just past the box's end in that dimension; for gaps between or after boxes (the usual
// kind: a missing shard) one of them is uncovered. Returns nullopt when no candidate is
// uncovered or the budget runs out; a nullopt therefore does not prove coverage.
std::optional<std::vector<int64_t>> FindUncoveredPoint(std::span<const Box* const> boxes,
                                                       const Shape& shape,
                                                       uint64_t max_box_tests = uint64_t{1} << 24);

// "(2, 0)"; "()" for rank 0.
std::string PointToString(const std::vector<int64_t>& point);

}  // namespace sp

#endif  // SHARDPOINT_PLAN_BOX_SET_H_
