#include "shardpoint/base/crc32c.h"

#include <cstring>

#include "shardpoint/base/crc_table.h"

#if defined(SP_HAVE_ISAL)
#include <isa-l/crc.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#endif

namespace sp {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr CrcTable kTable = MakeReflectedCrcTable(kPoly);

[[maybe_unused]] uint32_t TableExtend(uint32_t crc, const uint8_t* p, size_t n) {
  return TableCrcExtend(kTable, crc, p, n);
}

#if defined(__x86_64__)
[[maybe_unused]] __attribute__((target("sse4.2"))) uint32_t Sse42Extend(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

[[maybe_unused]] bool CpuHasSse42() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_SSE4_2) != 0;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(SP_HAVE_ISAL)
  // crc32_iscsi works on the un-inverted register and takes an int length.
  uint32_t c = ~crc;
  while (size > 0) {
    size_t n = size > (size_t{1} << 30) ? (size_t{1} << 30) : size;
    c = crc32_iscsi(const_cast<uint8_t*>(p), static_cast<int>(n), c);
    p += n;
    size -= n;
  }
  return ~c;
#else
#if defined(__x86_64__)
  static const bool has_sse42 = CpuHasSse42();
  if (has_sse42) return Sse42Extend(crc, p, size);
#endif
  return TableExtend(crc, p, size);
#endif
}

const char* Crc32cImplementation() {
#if defined(SP_HAVE_ISAL)
  return "isa-l";
#else
#if defined(__x86_64__)
  if (CpuHasSse42()) return "sse4.2";
#endif
  return "table";
#endif
}

}  // namespace sp
