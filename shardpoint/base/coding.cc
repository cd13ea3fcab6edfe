#include "shardpoint/base/coding.h"

namespace sp {

Status ByteReader::Short(size_t needed) const {
  return DataLossError(what_ + ": truncated at byte " + std::to_string(pos_) + " (needed " +
                       std::to_string(needed) + " more bytes, " + std::to_string(remaining()) +
                       " remain)");
}

Result<std::string_view> ByteReader::ReadRaw(size_t n) {
  if (remaining() < n) return Short(n);
  std::string_view out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

Result<std::string_view> ByteReader::ReadString(uint32_t max_len) {
  SP_ASSIGN_OR_RETURN(uint32_t len, ReadU32());
  if (len > max_len) {
    return DataLossError(what_ + ": string length " + std::to_string(len) + " at byte " +
                         std::to_string(pos_ - 4) + " exceeds the limit " +
                         std::to_string(max_len));
  }
  return ReadRaw(len);
}

Result<uint64_t> ByteReader::ReadLongVarint() {
  const size_t start = pos_;
  uint64_t v = 0;
  for (int shift = 0; shift < 70; shift += 7) {
    if (remaining() < 1) {
      return DataLossError(what_ + ": varint at byte " + std::to_string(start) +
                           " is cut off by the end of the input");
    }
    const uint8_t b = static_cast<uint8_t>(in_[pos_++]);
    if (shift == 63 && b > 1) break;  // bits past the 64th
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (b < 0x80) return v;
  }
  return DataLossError(what_ + ": varint at byte " + std::to_string(start) +
                       " does not fit in 64 bits");
}

Result<uint32_t> ByteReader::ReadIndexStep(std::string_view field, int64_t* previous) {
  const size_t start = pos_;
  SP_ASSIGN_OR_RETURN(int64_t step, ReadSignedVarint());
  int64_t index = 0;
  if (__builtin_add_overflow(*previous, step, &index) || index < 0 || index > UINT32_MAX) {
    return DataLossError(what_ + ": " + std::string(field) + " " + std::to_string(*previous) +
                         " + " + std::to_string(step) + " out of range at byte " +
                         std::to_string(start));
  }
  *previous = index;
  return static_cast<uint32_t>(index);
}

Result<uint32_t> ByteReader::ReadVarintCount(size_t min_element_bytes) {
  const size_t start = pos_;
  SP_ASSIGN_OR_RETURN(uint64_t count, ReadVarint());
  if (count > UINT32_MAX ||
      (min_element_bytes > 0 && count > remaining() / min_element_bytes)) {
    return DataLossError(what_ + ": count " + std::to_string(count) + " at byte " +
                         std::to_string(start) + " cannot fit in the " +
                         std::to_string(remaining()) + " remaining bytes");
  }
  return static_cast<uint32_t>(count);
}

Result<uint32_t> ByteReader::ReadCount(size_t min_element_bytes) {
  SP_ASSIGN_OR_RETURN(uint32_t count, ReadU32());
  if (min_element_bytes > 0 && count > remaining() / min_element_bytes) {
    return DataLossError(what_ + ": count " + std::to_string(count) + " at byte " +
                         std::to_string(pos_ - 4) + " cannot fit in the " +
                         std::to_string(remaining()) + " remaining bytes");
  }
  return count;
}

}  // namespace sp
