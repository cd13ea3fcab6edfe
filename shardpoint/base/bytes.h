// Byte views and an owned, aligned byte buffer.
//
// ByteView / MutableByteView are non-owning views of memory owned by someone else (often the
// caller's tensors). AlignedBuffer owns a heap block aligned for direct I/O. None of these types
// synchronize; share them across threads only for disjoint regions.
#ifndef SHARDPOINT_BASE_BYTES_H_
#define SHARDPOINT_BASE_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace sp {

using ByteView = std::span<const std::byte>;
using MutableByteView = std::span<std::byte>;

inline ByteView AsBytes(std::string_view s) {
  return ByteView(reinterpret_cast<const std::byte*>(s.data()), s.size());
}
inline ByteView AsBytes(const void* data, size_t size) {
  return ByteView(static_cast<const std::byte*>(data), size);
}
inline MutableByteView AsMutableBytes(void* data, size_t size) {
  return MutableByteView(static_cast<std::byte*>(data), size);
}
inline std::string_view AsStringView(ByteView bytes) {
  return std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// An owned byte block whose start is aligned to `alignment` (a power of two, default 4096).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size, size_t alignment = 4096);

  AlignedBuffer(AlignedBuffer&&) noexcept = default;
  AlignedBuffer& operator=(AlignedBuffer&&) noexcept = default;

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  MutableByteView view() { return MutableByteView(data_.get(), size_); }
  ByteView view() const { return ByteView(data_.get(), size_); }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// Formats a byte count for people: "1.50 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);

}  // namespace sp

#endif  // SHARDPOINT_BASE_BYTES_H_
