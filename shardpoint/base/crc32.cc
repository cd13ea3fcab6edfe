#include "shardpoint/base/crc32.h"

#include "shardpoint/base/crc_table.h"

#if defined(SP_HAVE_ISAL)
#include <isa-l/crc.h>
#endif

namespace sp {

namespace {

constexpr uint32_t kCrc32Polynomial = 0xedb88320;  // reflected

#if !defined(SP_HAVE_ISAL)
constexpr CrcTable kTable = MakeReflectedCrcTable(kCrc32Polynomial);
#endif

// a * b modulo the CRC-32 polynomial, both in the reflected bit order (x^0 is bit 31).
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = uint32_t{1} << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kCrc32Polynomial : b >> 1;
  }
  return product;
}

// x^(8 * bytes) modulo the polynomial, by squaring.
uint32_t PowerOfXForBytes(uint64_t bytes) {
  uint32_t power = uint32_t{1} << 31;  // x^0
  uint32_t square = uint32_t{1} << 30;  // x^1
  for (uint64_t bits = bytes * 8; bits != 0; bits >>= 1) {
    if (bits & 1) power = MultiplyModP(square, power);
    square = MultiplyModP(square, square);
  }
  return power;
}

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t size) {
#if defined(SP_HAVE_ISAL)
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), size);
#else
  return TableCrcExtend(kTable, crc, static_cast<const uint8_t*>(data), size);
#endif
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return MultiplyModP(PowerOfXForBytes(length_b), crc_a) ^ crc_b;
}

}  // namespace sp
