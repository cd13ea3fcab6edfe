// CRC32C (Castagnoli), as used by iSCSI, ext4 and S3's x-amz-checksum-crc32c.
//
// Uses ISA-L's runtime-dispatched crc32_iscsi when the build found it, otherwise the SSE4.2
// instruction when the CPU has it, otherwise a table. All paths give identical results.
// Thread-safe. Crc32c("123456789") == 0xE3069283.
#ifndef SHARDPOINT_BASE_CRC32C_H_
#define SHARDPOINT_BASE_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace sp {

// Extends `crc` (the CRC32C of some prefix; 0 for none) with `size` more bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
inline uint32_t Crc32c(std::string_view s) { return Crc32cExtend(0, s.data(), s.size()); }

// Which implementation is in use: "isa-l", "sse4.2" or "table".
const char* Crc32cImplementation();

}  // namespace sp

#endif  // SHARDPOINT_BASE_CRC32C_H_
