// Table-driven CRC over a reflected 32-bit polynomial: the portable path of crc32.cc (CRC-32,
// 0xEDB88320) and crc32c.cc (CRC32C, 0x82F63B78) when no faster one is available. Internal to
// base/; use crc32.h and crc32c.h.
#ifndef SHARDPOINT_BASE_CRC_TABLE_H_
#define SHARDPOINT_BASE_CRC_TABLE_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace sp {

using CrcTable = std::array<uint32_t, 256>;

// The byte-at-a-time table of the reflected polynomial `poly`.
constexpr CrcTable MakeReflectedCrcTable(uint32_t poly) {
  CrcTable table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    table[i] = c;
  }
  return table;
}

// Extends `crc` (of some prefix; 0 for none) with `n` bytes at `p`, through `table`.
inline uint32_t TableCrcExtend(const CrcTable& table, uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

}  // namespace sp

#endif  // SHARDPOINT_BASE_CRC_TABLE_H_
