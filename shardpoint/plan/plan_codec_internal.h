// Helpers shared by the plan codecs (plan_codec.cc, ruled_plan.cc): lists of integers, objects,
// and the sealed envelope (magic, body, CRC32C) every plan message has. Internal to plan/.
#ifndef SHARDPOINT_PLAN_PLAN_CODEC_INTERNAL_H_
#define SHARDPOINT_PLAN_PLAN_CODEC_INTERNAL_H_

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"

namespace sp {
namespace plan_codec_internal {

constexpr uint32_t kMaxNameBytes = 1u << 20;
constexpr uint32_t kMaxPayloadBytes = std::numeric_limits<uint32_t>::max();
constexpr size_t kMinObjectBytes = 4 + 1 + 4;

inline void PutI64List(ByteWriter& w, std::span<const int64_t> values) {
  w.PutU32(static_cast<uint32_t>(values.size()));
  for (int64_t v : values) w.PutI64(v);
}

template <typename Values>  // Shape or Dims
inline Status ReadI64List(ByteReader& r, Values* values) {
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(8));
  values->resize(count);
  for (int64_t& v : *values) {
    SP_ASSIGN_OR_RETURN(v, r.ReadI64());
  }
  return OkStatus();
}

// Appends the CRC32C of everything written so far.
inline std::string Seal(std::string out) {
  const uint32_t crc = Crc32c(out);
  ByteWriter(&out).PutU32(crc);
  return out;
}

// Checks the trailing checksum and the magic; returns a reader over the body.
inline Result<ByteReader> Open(std::string_view bytes, uint32_t magic, std::string what) {
  if (bytes.size() < 8) {
    return DataLossError(what + ": " + std::to_string(bytes.size()) +
                         " bytes is too short (at least 8 expected)");
  }
  const std::string_view covered = bytes.substr(0, bytes.size() - 4);
  const uint32_t stored = DecodeFixed32(bytes.data() + covered.size());
  const uint32_t actual = Crc32c(covered);
  if (stored != actual) {
    return DataLossError(what + ": checksum mismatch (stored " + std::to_string(stored) +
                         ", computed " + std::to_string(actual) + ")");
  }
  ByteReader reader(covered, std::move(what));
  SP_ASSIGN_OR_RETURN(uint32_t found, reader.ReadU32());
  if (found != magic) {
    return DataLossError(reader.what() + ": bad magic " + std::to_string(found) + " (expected " +
                         std::to_string(magic) + ")");
  }
  return reader;
}

inline Status ExpectDone(const ByteReader& r) {
  if (r.done()) return OkStatus();
  return DataLossError(r.what() + ": " + std::to_string(r.remaining()) +
                       " unexpected trailing bytes at byte " + std::to_string(r.position()));
}

// A list of boxes: count, then each box's offsets and sizes as lists.
inline void PutBoxList(ByteWriter& w, std::span<const Box> boxes) {
  w.PutU32(static_cast<uint32_t>(boxes.size()));
  for (const Box& box : boxes) {
    PutI64List(w, box.offsets);
    PutI64List(w, box.sizes);
  }
}

// Reads a list written by PutBoxList into *boxes (reused: it allocates only to grow).
inline Status ReadBoxList(ByteReader& r, std::vector<Box>* boxes) {
  constexpr size_t kMinBoxBytes = 4 + 4;
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(kMinBoxBytes));
  boxes->resize(count);
  for (Box& box : *boxes) {
    SP_RETURN_IF_ERROR(ReadI64List(r, &box.offsets));
    SP_RETURN_IF_ERROR(ReadI64List(r, &box.sizes));
  }
  return OkStatus();
}

inline void PutObject(ByteWriter& w, const ObjectEntry& object) {
  w.PutString(object.name);
  w.PutU8(static_cast<uint8_t>(object.encoding));
  w.PutString(object.payload);
}

inline Result<ObjectEntry> ReadObject(ByteReader& r) {
  ObjectEntry object;
  SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString(kMaxNameBytes));
  object.name = std::string(name);
  SP_ASSIGN_OR_RETURN(uint8_t encoding, r.ReadU8());
  if (!IsKnownObjectEncoding(encoding)) {
    return DataLossError(r.what() + ": object '" + object.name + "' has unknown encoding " +
                         std::to_string(encoding));
  }
  object.encoding = static_cast<ObjectEncoding>(encoding);
  SP_ASSIGN_OR_RETURN(std::string_view payload, r.ReadString(kMaxPayloadBytes));
  object.payload = std::string(payload);
  return object;
}

}  // namespace plan_codec_internal
}  // namespace sp

#endif  // SHARDPOINT_PLAN_PLAN_CODEC_INTERNAL_H_
