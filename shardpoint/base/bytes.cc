#include "shardpoint/base/bytes.h"

#include <cstdio>
#include <new>

namespace sp {

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment) : size_(size) {
  if (size == 0) return;
  void* p = nullptr;
  size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (posix_memalign(&p, alignment, rounded) != 0) throw std::bad_alloc();
  data_.reset(static_cast<std::byte*>(p));
}

std::string HumanBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char out[32];
  if (unit == 0) {
    std::snprintf(out, sizeof(out), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(out, sizeof(out), "%.2f %s", value, kUnits[unit]);
  }
  return out;
}

}  // namespace sp
