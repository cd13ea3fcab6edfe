#include "shardpoint/format/torch_dcp/dcp_items.h"

#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <utility>

#include "shardpoint/base/coding.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/base/json.h"

namespace sp::torch_dcp {

namespace {

struct DctxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};
struct CctxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};

Status TooLarge(std::string_view what, uint64_t max_decoded_bytes) {
  return ResourceExhaustedError("zstd item " + std::string(what) + " decodes to more than " +
                                std::to_string(max_decoded_bytes) + " bytes");
}

// Streams (the frame header need not declare the content size) with the output capped: frames
// whose headers declare more than the cap are refused before anything is decoded, others are
// refused as soon as their output passes it. Several frames decode to their concatenation.
// The content sizes the frame headers of `stored` declare, summed over the frames (capped at
// UINT64_MAX), and whether every frame declares one. A frame that is neither a zstd frame nor a
// skippable one is refused by its magic number: libzstd also decodes the legacy formats of 2016
// (v0.5-v0.7, which torch never writes), whose headers are not checked against their output.
// Stops at the first otherwise malformed frame, which the decoder then reports.
struct Declared {
  uint64_t total = 0;
  bool all = true;
};
Result<Declared> DeclaredSize(ByteView stored, std::string_view what) {
  Declared d;
  size_t pos = 0;
  while (pos < stored.size()) {
    const void* frame = stored.data() + pos;
    if (stored.size() - pos >= 4) {
      const uint32_t magic = DecodeFixed32(reinterpret_cast<const char*>(stored.data()) + pos);
      if (magic != ZSTD_MAGICNUMBER && (magic & ZSTD_MAGIC_SKIPPABLE_MASK) != ZSTD_MAGIC_SKIPPABLE_START) {
        char hex[11];
        std::snprintf(hex, sizeof hex, "0x%08X", magic);
        return DataLossError("zstd item " + std::string(what) + ": the frame at byte " + std::to_string(pos) +
                             " has magic number " + hex + ", expected a zstd frame (0xFD2FB528)");
      }
    }
    const unsigned long long size = ZSTD_getFrameContentSize(frame, stored.size() - pos);
    if (size == ZSTD_CONTENTSIZE_ERROR) return Declared{d.total, false};
    if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
      d.all = false;
    } else {
      d.total = size > UINT64_MAX - d.total ? UINT64_MAX : d.total + size;
    }
    const size_t length = ZSTD_findFrameCompressedSize(frame, stored.size() - pos);
    if (ZSTD_isError(length) || length == 0) return Declared{d.total, false};
    pos += length;
  }
  return d;
}

// One frame of a zstd item: [begin, end) of the stored bytes, and the content size its header
// declares (ZSTD_CONTENTSIZE_UNKNOWN when it declares none). When the frame cannot be delimited
// (truncated or malformed), it runs to the end of the item and declares nothing: the decoder
// reports what is wrong with it.
struct ZstdFrame {
  size_t end = 0;
  unsigned long long declared = ZSTD_CONTENTSIZE_UNKNOWN;
};
ZstdFrame FrameAt(ByteView stored, size_t begin) {
  const void* frame = stored.data() + begin;
  const size_t rest = stored.size() - begin;
  const unsigned long long size = ZSTD_getFrameContentSize(frame, rest);
  const size_t length = ZSTD_findFrameCompressedSize(frame, rest);
  if (size == ZSTD_CONTENTSIZE_ERROR || ZSTD_isError(length) || length == 0) {
    return ZstdFrame{stored.size(), ZSTD_CONTENTSIZE_UNKNOWN};
  }
  return ZstdFrame{begin + length, size};
}

Result<std::string> ZstdDecode(ByteView stored, uint64_t max_decoded_bytes, std::string_view what) {
  if (stored.empty()) {
    return DataLossError("zstd item " + std::string(what) + " is truncated (the stream does not end)");
  }
  SP_ASSIGN_OR_RETURN(const Declared sizes, DeclaredSize(stored, what));
  const uint64_t declared = sizes.total;
  const bool known = sizes.all;
  if (declared > max_decoded_bytes) {
    return ResourceExhaustedError("zstd item " + std::string(what) + " declares " +
                                  std::to_string(declared) + " decoded bytes, more than " +
                                  std::to_string(max_decoded_bytes));
  }
  std::unique_ptr<ZSTD_DCtx, DctxFree> dctx(ZSTD_createDCtx());
  if (!dctx) return InternalError("zstd: cannot create a decompression context");
  // When every frame declares its size, the buffer starts at their total: a small item takes a
  // small allocation and libzstd decodes it in one pass, without its streaming buffers.
  const uint64_t limit = known ? declared : max_decoded_bytes;
  std::string out;
  // Frame by frame, so that each frame's output is checked against the size its header declares:
  // libzstd does not always check (a frame decoded in several steps whose last block is empty
  // ends without the check).
  for (size_t begin = 0; begin < stored.size();) {
    const ZstdFrame frame = FrameAt(stored, begin);
    const uint64_t frame_start = out.size();
    ZSTD_DCtx_reset(dctx.get(), ZSTD_reset_session_only);
    ZSTD_inBuffer in{stored.data(), frame.end, begin};
    for (;;) {
      const size_t used = out.size();
      const uint64_t room = limit - used;  // used <= limit here
      // One byte past the limit, so that output beyond it is seen.
      const size_t chunk = room >= ZSTD_DStreamOutSize() ? ZSTD_DStreamOutSize() : room + 1;
      if (used + chunk > out.capacity()) {
        // Doubling, but never past the limit + 1: near it, one last step to it, so that output
        // of about the cap never holds twice the cap.
        const uint64_t doubled = std::max<uint64_t>(2 * out.capacity(), used + chunk);
        out.reserve(static_cast<size_t>(std::min<uint64_t>(doubled, limit + 1)));
      }
      out.resize(used + chunk);
      ZSTD_outBuffer o{out.data() + used, chunk, 0};
      const size_t left = ZSTD_decompressStream(dctx.get(), &o, &in);
      out.resize(used + o.pos);
      if (ZSTD_isError(left)) {
        return DataLossError("zstd item " + std::string(what) + ": " + ZSTD_getErrorName(left));
      }
      if (out.size() > limit) {
        if (!known) return TooLarge(what, max_decoded_bytes);
        return DataLossError("zstd item " + std::string(what) + " decodes to more than the " +
                             std::to_string(declared) + " bytes its frame headers declare");
      }
      // 0: a frame ended and is flushed. The item's piece ends with it when no input is left;
      // otherwise another frame follows. (Whether output space was left says nothing: a frame
      // may end exactly when its output fills the buffer.)
      if (left == 0 && in.pos == in.size) break;
      // Mid-frame, all input consumed, and output space left: the rest of the frame is missing.
      if (left != 0 && in.pos == in.size && o.pos < chunk) {
        return DataLossError("zstd item " + std::string(what) +
                             " is truncated (the stream does not end)");
      }
    }
    if (frame.declared != ZSTD_CONTENTSIZE_UNKNOWN && out.size() - frame_start != frame.declared) {
      return DataLossError("zstd item " + std::string(what) + ": the frame at byte " +
                           std::to_string(begin) + " decodes to " +
                           std::to_string(out.size() - frame_start) +
                           " bytes, but its header declares " + std::to_string(frame.declared));
    }
    begin = frame.end;
  }
  return out;
}

Result<std::vector<int64_t>> SavedOffsets(const JsonValue& info, std::string_view fqn,
                                          std::string_view path) {
  auto bad = [&](const std::string& problem) {
    return DataLossError("safetensors file " + std::string(path) + ": DCP_SHARDING_INFO for '" +
                         std::string(fqn) + "': " + problem);
  };
  if (!info.is_object()) return bad("not an object");
  for (size_t i = 0; i < info.keys.size(); ++i) {
    if (info.keys[i] != "saved_offsets") continue;
    const JsonValue& list = info.values[i];
    if (!list.is_array()) return bad("saved_offsets is not an array");
    std::vector<int64_t> out;
    for (const JsonValue& v : list.items) {
      if (!v.is_number() || v.number > (uint64_t{1} << 62)) return bad("offset is not a number");
      out.push_back(static_cast<int64_t>(v.number));
    }
    return out;
  }
  return bad("no saved_offsets");
}

}  // namespace

Result<std::string> DecodeTransformedItem(std::span<const std::string> descriptors, ByteView stored,
                                          uint64_t max_decoded_bytes, std::string_view what) {
  if (descriptors.empty()) {
    if (stored.size() > max_decoded_bytes) {
      return ResourceExhaustedError("item " + std::string(what) + " is larger than " +
                                    std::to_string(max_decoded_bytes) + " bytes");
    }
    return std::string(AsStringView(stored));
  }
  if (descriptors.size() > 1) {
    return UnimplementedError("item " + std::string(what) + " has " + std::to_string(descriptors.size()) +
                              " stream transforms; only one (stream.zstd) is supported");
  }
  std::string_view d = descriptors[0];
  size_t slash = d.find('/');
  std::string_view name = d.substr(0, slash);
  std::string_view version = slash == std::string_view::npos ? "" : d.substr(slash + 1);
  if (name != "stream.zstd" || version.substr(0, version.find('.')) != "1") {
    return UnimplementedError("item " + std::string(what) + ": unknown stream transform '" +
                              std::string(d) + "' (only stream.zstd/1 is supported)");
  }
  return ZstdDecode(stored, max_decoded_bytes, what);
}

Result<std::string> EncodeZstdItem(ByteView raw, int level) {
  std::unique_ptr<ZSTD_CCtx, CctxFree> cctx(ZSTD_createCCtx());
  if (!cctx) return InternalError("zstd: cannot create a compression context");
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_contentSizeFlag, 0);
  std::string out(ZSTD_compressBound(raw.size()), '\0');
  ZSTD_inBuffer in{raw.data(), raw.size(), 0};
  ZSTD_outBuffer o{out.data(), out.size(), 0};
  size_t left = ZSTD_compressStream2(cctx.get(), &o, &in, ZSTD_e_end);
  if (ZSTD_isError(left) || left != 0) {
    return InternalError(std::string("zstd compression failed: ") +
                         (ZSTD_isError(left) ? ZSTD_getErrorName(left) : "output buffer too small"));
  }
  out.resize(o.pos);
  return out;
}

Result<std::vector<DcpSafetensorsChunk>> DcpSafetensorsChunks(const SafetensorsHeader& header,
                                                              std::string_view path) {
  std::vector<std::string> keys;
  std::vector<JsonValue> infos;
  auto it = header.metadata.find("DCP_SHARDING_INFO");
  if (it != header.metadata.end()) {
    SP_ASSIGN_OR_RETURN(JsonValue sharding,
                        ParseJson(it->second, "safetensors file " + std::string(path) + " DCP_SHARDING_INFO"));
    if (!sharding.is_object()) {
      return DataLossError("safetensors file " + std::string(path) + ": DCP_SHARDING_INFO is not an object");
    }
    keys = sharding.keys;
    infos = sharding.values;
  }
  std::vector<DcpSafetensorsChunk> out;
  for (const SafetensorsEntry& e : header.entries) {
    DcpSafetensorsChunk c{e.name, e.dtype, Box::Whole(e.shape), header.data_start + e.begin, e.end - e.begin};
    auto k = std::find(keys.begin(), keys.end(), e.name);
    if (k != keys.end()) {
      SP_ASSIGN_OR_RETURN(c.box.offsets, SavedOffsets(infos[k - keys.begin()], e.name, path));
      if (c.box.offsets.size() != e.shape.size()) {
        return DataLossError("safetensors file " + std::string(path) + ": DCP_SHARDING_INFO for '" +
                             e.name + "' has " + std::to_string(c.box.offsets.size()) +
                             " offsets for a tensor of rank " + std::to_string(e.shape.size()));
      }
      // The chunk's extent (offsets + sizes) is a lower bound of the tensor's shape, so it must
      // be within the shared size limit (metadata.h); a sum past int64 is refused as too large.
      Shape extent(e.shape.size());
      for (size_t d = 0; d < extent.size(); ++d) {
        if (__builtin_add_overflow(c.box.offsets[d], e.shape[d], &extent[d])) extent[d] = INT64_MAX;
      }
      SP_RETURN_IF_ERROR(CheckedTensorBytes(e.dtype, extent,
                                            "safetensors file " + std::string(path) +
                                                ": DCP_SHARDING_INFO for '" + e.name +
                                                "': the chunk's extent")
                             .status());
    }
    out.push_back(std::move(c));
  }
  for (const std::string& key : keys) {
    bool found = std::any_of(out.begin(), out.end(), [&](const auto& c) { return c.fqn == key; });
    if (!found) {
      return DataLossError("safetensors file " + std::string(path) + ": DCP_SHARDING_INFO names '" +
                           key + "', which the file does not hold");
    }
  }
  return out;
}

}  // namespace sp::torch_dcp
