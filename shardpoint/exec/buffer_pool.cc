#include "shardpoint/exec/buffer_pool.h"

#include <algorithm>
#include <utility>

namespace sp {

BufferPool::BufferPool(size_t capacity, size_t max_keep_bytes)
    : capacity_(capacity), max_keep_bytes_(max_keep_bytes) {}

AlignedBuffer BufferPool::Acquire(size_t size, size_t alignment) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    largest_asked_ = std::max<uint64_t>(largest_asked_, size);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const bool fits = free_[i].size() >= size &&
                        reinterpret_cast<uintptr_t>(free_[i].data()) % alignment == 0;
      if (fits && (best == free_.size() || free_[i].size() < free_[best].size())) best = i;
    }
    if (best < free_.size()) {
      AlignedBuffer out = std::move(free_[best]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
      return out;
    }
    ++allocated_;
  }
  return AlignedBuffer(size, std::max<size_t>(alignment, 4096));
}

void BufferPool::Release(AlignedBuffer buffer) {
  if (buffer.size() == 0 || buffer.size() > max_keep_bytes_) return;  // freed here
  AlignedBuffer dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (callers_ == 0) return;
    if (free_.size() >= capacity_) {
      // Full: keep the larger of the two (it serves more requests); the smallest kept goes.
      auto smallest = std::min_element(
          free_.begin(), free_.end(),
          [](const AlignedBuffer& a, const AlignedBuffer& b) { return a.size() < b.size(); });
      if (smallest == free_.end() || smallest->size() >= buffer.size()) return;
      dropped = std::move(*smallest);
      *smallest = std::move(buffer);
      return;
    }
    free_.push_back(std::move(buffer));
  }
}

void BufferPool::Enter() {
  std::lock_guard<std::mutex> lock(mu_);
  ++callers_;
}

void BufferPool::Leave() {
  std::vector<AlignedBuffer> freed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--callers_ == 0) freed.swap(free_);
  }
}

size_t BufferPool::kept() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

uint64_t BufferPool::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

uint64_t BufferPool::largest_asked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return largest_asked_;
}

}  // namespace sp
