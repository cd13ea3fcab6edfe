// IndexSet: the ordered set of global indices one rank holds on one tensor dim, as the layout
// functions split it. Internal to shardpoint/layout.
//
// The set is a list of half-open intervals in local order (the order in which the rank stores the
// elements); positions are counted along that order. Pure value type.
#ifndef SHARDPOINT_LAYOUT_INDEX_SET_H_
#define SHARDPOINT_LAYOUT_INDEX_SET_H_

#include <cstdint>
#include <string>
#include <vector>

namespace sp {
namespace layout_internal {

struct Interval {
  int64_t begin;
  int64_t end;
};

class IndexSet {
 public:
  explicit IndexSet(int64_t size) {
    if (size > 0) intervals_.push_back({0, size});
  }

  int64_t size() const;

  // The elements at local positions [begin, end), in order.
  IndexSet Slice(int64_t begin, int64_t end) const;

  // Appends the elements of `other` after this set's.
  void Append(const IndexSet& other);

  // When the set is one contiguous range (or empty), stores it and returns true.
  bool AsRange(int64_t* begin, int64_t* size) const;

  // "{[0, 2), [4, 6)}"
  std::string ToString() const;

 private:
  IndexSet() = default;
  std::vector<Interval> intervals_;
};

// torch.chunk: piece `index` of `count` pieces of ceil(length / count) elements, as positions
// [*begin, *end) (trailing pieces short or empty).
void ChunkRange(int64_t length, int64_t count, int64_t index, int64_t* begin, int64_t* end);

// Balanced split (hyper_parallel's default): the first length % count pieces get one more.
void BalancedRange(int64_t length, int64_t count, int64_t index, int64_t* begin, int64_t* end);

}  // namespace layout_internal
}  // namespace sp

#endif  // SHARDPOINT_LAYOUT_INDEX_SET_H_
