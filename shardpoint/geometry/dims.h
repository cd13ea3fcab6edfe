// Dims: the per-dimension values of a box (its offsets or its sizes).
//
// A checkpoint of a large job holds millions of boxes (one per stored chunk and per local piece),
// and as two std::vectors each box cost two heap allocations. Dims keeps up to kInline values in
// the object itself, which covers tensors of rank 4 and below, and moves to the heap only beyond.
// It has the parts of the std::vector interface that boxes use, converts to and from
// std::vector<int64_t> (a Shape), and compares with either.
#ifndef SHARDPOINT_GEOMETRY_DIMS_H_
#define SHARDPOINT_GEOMETRY_DIMS_H_

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <vector>

namespace sp {

class Dims {
 public:
  static constexpr size_t kInline = 4;

  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  Dims() noexcept : inline_{} {}
  explicit Dims(size_t n, int64_t value = 0) : inline_{} { assign(n, value); }
  Dims(std::initializer_list<int64_t> values) : inline_{} { assign(values.begin(), values.end()); }
  template <std::input_iterator It>
  Dims(It first, It last) : inline_{} {
    assign(first, last);
  }
  Dims(const std::vector<int64_t>& values) : inline_{} {  // NOLINT: a Shape converts implicitly
    assign(values.begin(), values.end());
  }
  Dims(std::span<const int64_t> values) : inline_{} { assign(values.begin(), values.end()); }
  Dims(const Dims& other) : inline_{} {
    if (other.OnHeap()) {
      assign(other.begin(), other.end());
    } else {
      std::copy(other.inline_, other.inline_ + kInline, inline_);  // fixed size: no call
      size_ = other.size_;
    }
  }
  Dims(Dims&& other) noexcept : inline_{} { TakeFrom(other); }
  ~Dims() { Release(); }

  Dims& operator=(const Dims& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  Dims& operator=(Dims&& other) noexcept {
    if (this != &other) {
      Release();
      TakeFrom(other);
    }
    return *this;
  }
  Dims& operator=(const std::vector<int64_t>& values) {
    assign(values.begin(), values.end());
    return *this;
  }
  Dims& operator=(std::initializer_list<int64_t> values) {
    assign(values.begin(), values.end());
    return *this;
  }

  // A Shape (std::vector<int64_t>) with the same values.
  explicit operator std::vector<int64_t>() const { return std::vector<int64_t>(begin(), end()); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  int64_t* data() { return OnHeap() ? heap_ : inline_; }
  const int64_t* data() const { return OnHeap() ? heap_ : inline_; }
  int64_t* begin() { return data(); }
  int64_t* end() { return data() + size_; }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + size_; }
  int64_t& operator[](size_t i) { return data()[i]; }
  const int64_t& operator[](size_t i) const { return data()[i]; }
  int64_t& front() { return data()[0]; }
  const int64_t& front() const { return data()[0]; }
  int64_t& back() { return data()[size_ - 1]; }
  const int64_t& back() const { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n <= capacity_) return;
    int64_t* grown = new int64_t[n];
    std::copy(begin(), end(), grown);
    const uint32_t size = size_;
    Release();
    heap_ = grown;
    size_ = size;
    capacity_ = static_cast<uint32_t>(n);
  }
  void clear() { size_ = 0; }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    if (n > size_) std::fill(data() + size_, data() + n, value);
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, int64_t value) {
    size_ = 0;
    resize(n, value);
  }
  template <std::input_iterator It>
  void assign(It first, It last) {
    if constexpr (std::contiguous_iterator<It>) {
      const size_t n = static_cast<size_t>(last - first);
      size_ = 0;
      reserve(n);
      CopyValues(std::to_address(first), n, data());
      size_ = static_cast<uint32_t>(n);
    } else if constexpr (std::forward_iterator<It>) {
      const size_t n = static_cast<size_t>(std::distance(first, last));
      size_ = 0;
      reserve(n);
      std::copy(first, last, data());
      size_ = static_cast<uint32_t>(n);
    } else {
      size_ = 0;
      for (; first != last; ++first) push_back(*first);
    }
  }
  void push_back(int64_t value) {
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = value;
  }
  void pop_back() { --size_; }
  iterator insert(const_iterator position, int64_t value) {
    const size_t at = static_cast<size_t>(position - begin());
    push_back(value);
    std::rotate(begin() + at, end() - 1, end());
    return begin() + at;
  }
  iterator erase(const_iterator position) {
    const size_t at = static_cast<size_t>(position - begin());
    std::copy(begin() + at + 1, end(), begin() + at);
    --size_;
    return begin() + at;
  }

  friend bool operator==(const Dims& a, const Dims& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const Dims& a, const std::vector<int64_t>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::strong_ordering operator<=>(const Dims& a, const Dims& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::strong_ordering operator<=>(const Dims& a, const std::vector<int64_t>& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool OnHeap() const { return capacity_ > kInline; }
  // Boxes have a few dimensions: copied one by one, not through a call to memmove.
  static void CopyValues(const int64_t* from, size_t n, int64_t* to) {
    switch (n) {
      case 4: to[3] = from[3]; [[fallthrough]];
      case 3: to[2] = from[2]; [[fallthrough]];
      case 2: to[1] = from[1]; [[fallthrough]];
      case 1: to[0] = from[0]; [[fallthrough]];
      case 0: return;
      default: std::copy(from, from + n, to);
    }
  }
  void Release() {
    if (OnHeap()) delete[] heap_;
    capacity_ = kInline;
    size_ = 0;
  }
  // Takes `other`'s values (its heap block, if any) and leaves it empty.
  void TakeFrom(Dims& other) noexcept {
    size_ = other.size_;
    capacity_ = other.capacity_;
    if (other.OnHeap()) {
      heap_ = other.heap_;
    } else {
      std::copy(other.inline_, other.inline_ + kInline, inline_);
    }
    other.size_ = 0;
    other.capacity_ = kInline;
  }

  uint32_t size_ = 0;
  uint32_t capacity_ = kInline;
  union {
    int64_t inline_[kInline];
    int64_t* heap_;
  };
};

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_DIMS_H_
