// Little-endian fixed-width and variable-length encoding, and a bounds-checked reader for hostile
// bytes.
//
// A varint is an unsigned integer in groups of 7 bits, lowest first, each byte's top bit set when
// another follows (LEB128): 0-127 take one byte, a u64 at most 10. A signed value travels
// zigzagged (0, -1, 1, -2, ... as 0, 1, 2, 3, ...), so small magnitudes take few bytes either way.
//
// ByteWriter appends to a std::string. ByteReader never reads past its input: every Read*
// returns kDataLoss naming `what` when the input is too short. Lengths read from input are
// checked against the remaining bytes before any allocation.
#ifndef SHARDPOINT_BASE_CODING_H_
#define SHARDPOINT_BASE_CODING_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "shardpoint/base/result.h"

namespace sp {

inline void EncodeFixed32(char* dst, uint32_t v) { std::memcpy(dst, &v, 4); }  // x86-64/LE only
inline void EncodeFixed64(char* dst, uint64_t v) { std::memcpy(dst, &v, 8); }
inline uint32_t DecodeFixed32(const char* src) {
  uint32_t v;
  std::memcpy(&v, src, 4);
  return v;
}
inline uint64_t DecodeFixed64(const char* src) {
  uint64_t v;
  std::memcpy(&v, src, 8);
  return v;
}

inline uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
inline int64_t UnZigZag(uint64_t v) {
  return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1);
}

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void PutU8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void PutU32(uint32_t v) {
    char b[4];
    EncodeFixed32(b, v);
    out_->append(b, 4);
  }
  void PutU64(uint64_t v) {
    char b[8];
    EncodeFixed64(b, v);
    out_->append(b, 8);
  }
  void PutI64(int64_t v) { PutU64(static_cast<uint64_t>(v)); }
  void PutVarint(uint64_t v) {
    char b[10];
    size_t n = 0;
    for (; v >= 0x80; v >>= 7) b[n++] = static_cast<char>(v | 0x80);
    b[n++] = static_cast<char>(v);
    out_->append(b, n);
  }
  void PutSignedVarint(int64_t v) { PutVarint(ZigZag(v)); }
  // A 32-bit index as the signed varint step from `*previous` (the index before it in a list,
  // 0 for the first), which it then becomes: a list of indices that rise or repeat takes a byte
  // an index. ByteReader::ReadIndexStep reads it.
  void PutIndexStep(uint32_t index, int64_t* previous) {
    PutSignedVarint(int64_t{index} - *previous);
    *previous = index;
  }
  // u32 length, then the bytes.
  void PutString(std::string_view s) {
    PutU32(static_cast<uint32_t>(s.size()));
    out_->append(s);
  }
  void PutRaw(std::string_view s) { out_->append(s); }
  size_t size() const { return out_->size(); }

 private:
  std::string* out_;
};

class ByteReader {
 public:
  // `what` names the input in error messages ("metadata file /x/.metadata, tensor section").
  ByteReader(std::string_view input, std::string what) : in_(input), what_(std::move(what)) {}

  // Inline: a metadata file's decoder reads millions of these.
  Result<uint8_t> ReadU8() {
    if (remaining() < 1) return Short(1);
    return static_cast<uint8_t>(in_[pos_++]);
  }
  Result<uint32_t> ReadU32() {
    if (remaining() < 4) return Short(4);
    const uint32_t v = DecodeFixed32(in_.data() + pos_);
    pos_ += 4;
    return v;
  }
  Result<uint64_t> ReadU64() {
    if (remaining() < 8) return Short(8);
    const uint64_t v = DecodeFixed64(in_.data() + pos_);
    pos_ += 8;
    return v;
  }
  Result<int64_t> ReadI64() {
    if (remaining() < 8) return Short(8);
    const uint64_t v = DecodeFixed64(in_.data() + pos_);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  // A varint (see above); one of more than 10 bytes, or whose tenth byte carries bits past the
  // 64th, is kDataLoss.
  Result<uint64_t> ReadVarint() {
    if (remaining() > 0 && static_cast<uint8_t>(in_[pos_]) < 0x80) {
      return static_cast<uint8_t>(in_[pos_++]);  // the common case: one byte
    }
    if (remaining() > 1 && static_cast<uint8_t>(in_[pos_ + 1]) < 0x80) {  // two: below 2^14
      const uint64_t v = (static_cast<uint8_t>(in_[pos_]) & 0x7fu) |
                         uint64_t{static_cast<uint8_t>(in_[pos_ + 1])} << 7;
      pos_ += 2;
      return v;
    }
    return ReadLongVarint();
  }
  Result<int64_t> ReadSignedVarint() {
    SP_ASSIGN_OR_RETURN(uint64_t v, ReadVarint());
    return UnZigZag(v);
  }
  // An index written by ByteWriter::PutIndexStep after `*previous`, which it then becomes:
  // kDataLoss "<what>: <field> <previous> + <step> out of range at byte N" when it leaves 32 bits.
  Result<uint32_t> ReadIndexStep(std::string_view field, int64_t* previous);
  // A varint count, checked as ReadCount checks a u32 one.
  Result<uint32_t> ReadVarintCount(size_t min_element_bytes);
  // A u32 length then that many bytes, at most `max_len`.
  Result<std::string_view> ReadString(uint32_t max_len = 1u << 20);
  Result<std::string_view> ReadRaw(size_t n);
  // Reads a u32 count and checks that count * min_element_bytes fits in what remains.
  Result<uint32_t> ReadCount(size_t min_element_bytes);

  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  bool done() const { return pos_ == in_.size(); }
  const std::string& what() const { return what_; }

 private:
  Status Short(size_t needed) const;
  Result<uint64_t> ReadLongVarint();
  std::string_view in_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace sp

#endif  // SHARDPOINT_BASE_CODING_H_
