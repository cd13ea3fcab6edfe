#include "shardpoint/layout/index_set.h"

#include <algorithm>

namespace sp {
namespace layout_internal {

int64_t IndexSet::size() const {
  int64_t total = 0;
  for (const Interval& i : intervals_) total += i.end - i.begin;
  return total;
}

IndexSet IndexSet::Slice(int64_t begin, int64_t end) const {
  IndexSet out;
  int64_t position = 0;
  for (const Interval& i : intervals_) {
    const int64_t length = i.end - i.begin;
    const int64_t lo = std::max(begin, position);
    const int64_t hi = std::min(end, position + length);
    if (lo < hi) out.intervals_.push_back({i.begin + (lo - position), i.begin + (hi - position)});
    position += length;
  }
  return out;
}

void IndexSet::Append(const IndexSet& other) {
  for (const Interval& i : other.intervals_) {
    if (!intervals_.empty() && intervals_.back().end == i.begin) {
      intervals_.back().end = i.end;
    } else {
      intervals_.push_back(i);
    }
  }
}

bool IndexSet::AsRange(int64_t* begin, int64_t* size) const {
  if (intervals_.empty()) {
    *begin = 0;
    *size = 0;
    return true;
  }
  for (size_t k = 1; k < intervals_.size(); ++k) {
    if (intervals_[k].begin != intervals_[k - 1].end) return false;
  }
  *begin = intervals_.front().begin;
  *size = intervals_.back().end - intervals_.front().begin;
  return true;
}

std::string IndexSet::ToString() const {
  std::string out = "{";
  for (size_t k = 0; k < intervals_.size(); ++k) {
    if (k) out += ", ";
    out += "[" + std::to_string(intervals_[k].begin) + ", " + std::to_string(intervals_[k].end) + ")";
  }
  return out + "}";
}

void ChunkRange(int64_t length, int64_t count, int64_t index, int64_t* begin, int64_t* end) {
  const int64_t piece = (length + count - 1) / count;
  *begin = std::min(piece * index, length);
  *end = std::min(*begin + piece, length);
}

void BalancedRange(int64_t length, int64_t count, int64_t index, int64_t* begin, int64_t* end) {
  const int64_t piece = length / count;
  const int64_t remainder = length % count;
  *begin = index * piece + std::min(index, remainder);
  *end = *begin + piece + (index < remainder ? 1 : 0);
}

}  // namespace layout_internal
}  // namespace sp
