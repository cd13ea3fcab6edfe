// ZIP record signatures, sizes and little-endian helpers shared by the ZIP reader and writer.
// Internal to shardpoint/format/torch_dcp.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_FORMAT_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_FORMAT_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace sp::torch_save::zipfmt {

inline constexpr uint32_t kLocalSig = 0x04034b50;
inline constexpr uint32_t kDescriptorSig = 0x08074b50;
inline constexpr uint32_t kCentralSig = 0x02014b50;
inline constexpr uint32_t kZip64EocdSig = 0x06064b50;
inline constexpr uint32_t kZip64LocatorSig = 0x07064b50;
inline constexpr uint32_t kEocdSig = 0x06054b50;
inline constexpr uint16_t kZip64ExtraId = 0x0001;

inline constexpr uint64_t kLocalHeaderSize = 30;
inline constexpr uint64_t kCentralHeaderSize = 46;
inline constexpr uint64_t kZip64EocdSize = 56;
inline constexpr uint64_t kZip64LocatorSize = 20;
inline constexpr uint64_t kEocdSize = 22;
inline constexpr uint64_t kMax32 = 0xFFFFFFFFu;

inline uint16_t Le16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) | (static_cast<uint8_t>(p[1]) << 8));
}
inline uint32_t Le32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);  // x86-64 / little-endian hosts only, like shardpoint/base/coding.h
  return v;
}
inline uint64_t Le64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void Put16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v));
  out->push_back(static_cast<char>(v >> 8));
}
inline void Put32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
inline void Put64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

}  // namespace sp::torch_save::zipfmt

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_FORMAT_H_
