#include "shardpoint/plan/box_set.h"

#include <algorithm>
#include <limits>
#include <string>

namespace sp {
namespace {

// The dimension in which the non-empty boxes are narrowest relative to their common extent:
// sweeping along it keeps the set of boxes open at any sweep position small.
size_t ChooseSweepDim(std::span<const Box* const> a, std::span<const Box* const> b, size_t rank) {
  std::vector<int64_t> lo(rank, std::numeric_limits<int64_t>::max());
  std::vector<int64_t> hi(rank, std::numeric_limits<int64_t>::min());
  auto bound = [&](std::span<const Box* const> boxes) {
    for (const Box* box : boxes) {
      if (box->empty()) continue;
      for (size_t d = 0; d < rank; ++d) {
        lo[d] = std::min(lo[d], box->offsets[d]);
        hi[d] = std::max(hi[d], box->exclusive_max(d));
      }
    }
  };
  bound(a);
  bound(b);
  std::vector<double> score(rank, 0.0);
  auto accumulate = [&](std::span<const Box* const> boxes) {
    for (const Box* box : boxes) {
      if (box->empty()) continue;
      for (size_t d = 0; d < rank; ++d) {
        score[d] += static_cast<double>(box->sizes[d]) / static_cast<double>(hi[d] - lo[d]);
      }
    }
  };
  accumulate(a);
  accumulate(b);
  return static_cast<size_t>(std::min_element(score.begin(), score.end()) - score.begin());
}

size_t RankOf(std::span<const Box* const> a, std::span<const Box* const> b) {
  if (!a.empty()) return a.front()->rank();
  if (!b.empty()) return b.front()->rank();
  return 0;
}

// Removes from `active` the boxes whose interval in `dim` ends at or before `position`.
void Prune(std::span<const Box* const> boxes, size_t dim, int64_t position,
           std::vector<uint32_t>* active) {
  auto ended = [&](uint32_t i) { return boxes[i]->exclusive_max(dim) <= position; };
  active->erase(std::remove_if(active->begin(), active->end(), ended), active->end());
}

}  // namespace

bool BoxesOverlap(const Box& a, const Box& b) {
  if (a.rank() != b.rank() || a.empty() || b.empty()) return false;
  for (size_t d = 0; d < a.rank(); ++d) {
    if (a.offsets[d] >= b.exclusive_max(d) || b.offsets[d] >= a.exclusive_max(d)) return false;
  }
  return true;
}

std::optional<std::pair<size_t, size_t>> FindOverlappingPair(std::span<const Box* const> boxes) {
  std::vector<uint32_t> order;
  order.reserve(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (!boxes[i]->empty()) order.push_back(static_cast<uint32_t>(i));
  }
  if (order.size() < 2) return std::nullopt;
  const size_t rank = boxes[order[0]]->rank();
  if (rank == 0) return std::make_pair<size_t, size_t>(order[0], order[1]);
  const size_t dim = ChooseSweepDim(boxes, {}, rank);
  std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
    int64_t ox = boxes[x]->offsets[dim], oy = boxes[y]->offsets[dim];
    return ox != oy ? ox < oy : x < y;
  });
  std::vector<uint32_t> active;
  for (uint32_t i : order) {
    Prune(boxes, dim, boxes[i]->offsets[dim], &active);
    for (uint32_t j : active) {
      if (BoxesOverlap(*boxes[i], *boxes[j])) {
        return std::make_pair<size_t, size_t>(std::min(i, j), std::max(i, j));
      }
    }
    active.push_back(i);
  }
  return std::nullopt;
}

std::vector<std::pair<uint32_t, uint32_t>> IntersectingPairs(std::span<const Box* const> a,
                                                             std::span<const Box* const> b) {
  std::vector<std::pair<uint32_t, uint32_t>> pairs;
  const size_t rank = RankOf(a, b);
  if (rank == 0) {
    for (uint32_t i = 0; i < a.size(); ++i) {
      for (uint32_t j = 0; j < b.size(); ++j) {
        if (BoxesOverlap(*a[i], *b[j])) pairs.emplace_back(i, j);
      }
    }
    return pairs;
  }
  const size_t dim = ChooseSweepDim(a, b, rank);
  struct Event {
    int64_t position;
    uint32_t side;  // 0: a, 1: b
    uint32_t index;
  };
  std::vector<Event> events;
  events.reserve(a.size() + b.size());
  for (uint32_t i = 0; i < a.size(); ++i) {
    if (!a[i]->empty()) events.push_back({a[i]->offsets[dim], 0, i});
  }
  for (uint32_t j = 0; j < b.size(); ++j) {
    if (!b[j]->empty()) events.push_back({b[j]->offsets[dim], 1, j});
  }
  std::sort(events.begin(), events.end(), [](const Event& x, const Event& y) {
    if (x.position != y.position) return x.position < y.position;
    return x.side != y.side ? x.side < y.side : x.index < y.index;
  });
  std::vector<uint32_t> active[2];
  const std::span<const Box* const> sides[2] = {a, b};
  for (const Event& event : events) {
    const uint32_t other = 1 - event.side;
    Prune(sides[other], dim, event.position, &active[other]);
    const Box& box = *sides[event.side][event.index];
    for (uint32_t k : active[other]) {
      if (!BoxesOverlap(box, *sides[other][k])) continue;
      pairs.push_back(event.side == 0 ? std::make_pair(event.index, k)
                                      : std::make_pair(k, event.index));
    }
    active[event.side].push_back(event.index);
  }
  return pairs;
}

std::optional<std::vector<int64_t>> FindUncoveredPoint(std::span<const Box* const> boxes,
                                                       const Shape& shape, uint64_t max_box_tests) {
  if (ShapeVolume(shape) == 0) return std::nullopt;
  uint64_t tests = 0;
  bool over_budget = false;
  auto uncovered = [&](const std::vector<int64_t>& point) {
    for (const Box* box : boxes) {
      if (++tests > max_box_tests) {
        over_budget = true;
        return false;
      }
      bool inside = !box->empty();
      for (size_t d = 0; inside && d < point.size(); ++d) {
        inside = box->offsets[d] <= point[d] && point[d] < box->exclusive_max(d);
      }
      if (inside) return false;
    }
    return true;
  };
  std::vector<int64_t> point(shape.size(), 0);
  if (uncovered(point)) return point;
  for (const Box* box : boxes) {
    if (box->empty()) continue;
    for (size_t d = 0; d < shape.size() && !over_budget; ++d) {
      if (box->exclusive_max(d) >= shape[d]) continue;
      point.assign(box->offsets.begin(), box->offsets.end());
      point[d] = box->exclusive_max(d);
      if (uncovered(point)) return point;
    }
    if (over_budget) break;
  }
  return std::nullopt;
}

std::string PointToString(const std::vector<int64_t>& point) {
  std::string out = "(";
  for (size_t i = 0; i < point.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(point[i]);
  }
  return out + ")";
}

}  // namespace sp
