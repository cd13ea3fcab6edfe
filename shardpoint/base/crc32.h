// CRC-32 (IEEE 802.3, the checksum of ZIP archives and zlib's crc32), distinct from the CRC32C
// of crc32c.h that shardpoint's own data files use.
//
// Uses ISA-L's crc32_gzip_refl when the build found it, otherwise a table. Both give identical
// results. Thread-safe. Crc32(0, "123456789", 9) == 0xCBF43926.
#ifndef SHARDPOINT_BASE_CRC32_H_
#define SHARDPOINT_BASE_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace sp {

// Extends `crc` (the CRC-32 of some prefix; 0 for none) with `size` more bytes.
uint32_t Crc32(uint32_t crc, const void* data, size_t size);

// The CRC-32 of A followed by B, from crc(A), crc(B) and B's length: pieces checksummed in
// parallel make the checksum of their concatenation (GF(2) polynomial arithmetic, O(log length)).
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

}  // namespace sp

#endif  // SHARDPOINT_BASE_CRC32_H_
