// InlineVector<T, N>: a vector of trivially copyable values that keeps up to N of them in the
// object itself and moves to the heap only beyond.
//
// A checkpoint of a large job holds millions of small lists, a few per stored chunk (its box's
// offsets and sizes, its block checksums), and as std::vectors each cost a heap allocation.
// InlineVector has the parts of the std::vector interface those lists use, converts to a
// std::vector<T> only explicitly (so no hot path allocates by accident), and compares with
// itself and with std::vector<T>.
#ifndef SHARDPOINT_BASE_INLINE_VECTOR_H_
#define SHARDPOINT_BASE_INLINE_VECTOR_H_

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <type_traits>
#include <vector>

namespace sp {

template <typename T, size_t N>
class InlineVector {
  static_assert(std::is_trivially_copyable_v<T> && N > 0);

 public:
  static constexpr size_t kInline = N;

  using value_type = T;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = T&;
  using const_reference = const T&;
  using pointer = T*;
  using const_pointer = const T*;
  using iterator = T*;
  using const_iterator = const T*;

  InlineVector() noexcept : inline_{} {}
  explicit InlineVector(size_t n, T value = T()) : inline_{} { assign(n, value); }
  InlineVector(std::initializer_list<T> values) : inline_{} { assign(values.begin(), values.end()); }
  template <std::input_iterator It>
  InlineVector(It first, It last) : inline_{} {
    assign(first, last);
  }
  InlineVector(const std::vector<T>& values) : inline_{} {  // NOLINT: converts implicitly
    assign(values.begin(), values.end());
  }
  InlineVector(std::span<const T> values) : inline_{} { assign(values.begin(), values.end()); }
  InlineVector(const InlineVector& other) : inline_{} {
    if (other.OnHeap()) {
      assign(other.begin(), other.end());
    } else {
      std::copy(other.inline_, other.inline_ + kInline, inline_);  // fixed size: no call
      size_ = other.size_;
    }
  }
  InlineVector(InlineVector&& other) noexcept : inline_{} { TakeFrom(other); }
  ~InlineVector() { Release(); }

  InlineVector& operator=(const InlineVector& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  InlineVector& operator=(InlineVector&& other) noexcept {
    if (this != &other) {
      Release();
      TakeFrom(other);
    }
    return *this;
  }
  InlineVector& operator=(const std::vector<T>& values) {
    assign(values.begin(), values.end());
    return *this;
  }
  InlineVector& operator=(std::initializer_list<T> values) {
    assign(values.begin(), values.end());
    return *this;
  }

  // A std::vector<T> with the same values.
  explicit operator std::vector<T>() const { return std::vector<T>(begin(), end()); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  T* data() { return OnHeap() ? heap_ : inline_; }
  const T* data() const { return OnHeap() ? heap_ : inline_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& front() { return data()[0]; }
  const T& front() const { return data()[0]; }
  T& back() { return data()[size_ - 1]; }
  const T& back() const { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n <= capacity_) return;
    T* grown = new T[n];
    std::copy(begin(), end(), grown);
    const uint32_t size = size_;
    Release();
    heap_ = grown;
    size_ = size;
    capacity_ = static_cast<uint32_t>(n);
  }
  void clear() { size_ = 0; }
  void resize(size_t n, T value = T()) {
    reserve(n);
    if (n > size_) std::fill(data() + size_, data() + n, value);
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, T value) {
    size_ = 0;
    resize(n, value);
  }
  template <std::input_iterator It>
  void assign(It first, It last) {
    if constexpr (std::forward_iterator<It>) {
      const size_t n = static_cast<size_t>(std::distance(first, last));
      size_ = 0;
      reserve(n);
      if constexpr (std::contiguous_iterator<It>) {
        CopyValues(std::to_address(first), n, data());
      } else {
        std::copy(first, last, data());
      }
      size_ = static_cast<uint32_t>(n);
    } else {
      size_ = 0;
      for (; first != last; ++first) push_back(*first);
    }
  }
  void push_back(T value) {
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = value;
  }
  void pop_back() { --size_; }
  iterator insert(const_iterator position, T value) {
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

  friend bool operator==(const InlineVector& a, const InlineVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const InlineVector& a, const std::vector<T>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::strong_ordering operator<=>(const InlineVector& a, const InlineVector& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::strong_ordering operator<=>(const InlineVector& a, const std::vector<T>& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool OnHeap() const { return capacity_ > kInline; }
  // Short lists are copied value by value, not through a call to memmove.
  static void CopyValues(const T* from, size_t n, T* to) {
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
  void TakeFrom(InlineVector& other) noexcept {
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
    T inline_[kInline];
    T* heap_;
  };
};

}  // namespace sp

#endif  // SHARDPOINT_BASE_INLINE_VECTOR_H_
