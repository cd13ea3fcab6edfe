#include "shardpoint/base/bytes.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <new>

namespace sp {

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment) : size_(size) {
  if (size == 0) return;
  // Large buffers are aligned to 2 MiB and marked for transparent huge pages: one fault per
  // 2 MiB instead of per 4 KiB when they are first touched.
  constexpr size_t kHugePage = size_t{2} << 20;
  const bool huge = size >= kHugePage;
  if (huge) alignment = std::max(alignment, kHugePage);
  void* p = nullptr;
  size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (posix_memalign(&p, alignment, rounded) != 0) throw std::bad_alloc();
  if (huge) madvise(p, rounded, MADV_HUGEPAGE);
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
