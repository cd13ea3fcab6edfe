// libFuzzer target for zstd-compressed DCP items (DecodeTransformedItem in
// shardpoint/format/torch_dcp/dcp_items.h, docs/TORCH_DCP.md), decoded under a cap of
// kMaxDecoded bytes.
//
// Invariants besides the absence of crashes:
//  - the output never exceeds the cap;
//  - differential: when libzstd's own streaming decoder decodes the whole input as complete
//    frames, each to the size its header declares, into at most kMaxDecoded bytes,
//    DecodeTransformedItem accepts it and returns the same bytes (and refuses it otherwise);
//  - what decodes, re-compressed by EncodeZstdItem, decodes to the same bytes;
//  - without a transform the item is returned unchanged.
#include <zstd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "shardpoint/format/torch_dcp/dcp_items.h"

namespace {

using sp::torch_dcp::DecodeTransformedItem;

constexpr uint64_t kMaxDecoded = uint64_t{1} << 20;

void Check(bool condition) {
  if (!condition) std::abort();
}

// Whether every frame of `in` is a zstd or a skippable frame: the legacy formats libzstd also
// decodes are refused (by their magic number; a truncated tail is left to the decoder).
bool OnlyCurrentFrames(std::string_view in) {
  size_t pos = 0;
  while (in.size() - pos >= 4) {
    uint32_t magic;
    std::memcpy(&magic, in.data() + pos, 4);
    if (magic != ZSTD_MAGICNUMBER && (magic & ZSTD_MAGIC_SKIPPABLE_MASK) != ZSTD_MAGIC_SKIPPABLE_START) return false;
    const size_t length = ZSTD_findFrameCompressedSize(in.data() + pos, in.size() - pos);
    if (ZSTD_isError(length) || length == 0) return true;
    pos += length;
  }
  return true;
}

// libzstd's reference answer: the decoded bytes when `in` is a sequence of complete zstd (not
// legacy) frames, each decoding to the content size its header declares (when it declares one),
// in all at most kMaxDecoded bytes; else nullopt. Each frame is decoded on its own by libzstd's
// streaming decoder (which does not always compare a frame's output with its header).
// The context and the output buffer are made once: a fresh large allocation per input is mapped
// and faulted in anew by the ASan allocator, which made it the target's dominant cost.
std::optional<std::string> Reference(std::string_view in) {
  static ZSTD_DCtx* const ctx = ZSTD_createDCtx();
  static std::string buffer(ZSTD_DStreamOutSize(), '\0');
  if (in.empty() || !OnlyCurrentFrames(in)) return std::nullopt;
  std::string out;
  for (size_t pos = 0; pos < in.size();) {
    const size_t length = ZSTD_findFrameCompressedSize(in.data() + pos, in.size() - pos);
    const unsigned long long declared = ZSTD_getFrameContentSize(in.data() + pos, in.size() - pos);
    const size_t end = ZSTD_isError(length) || length == 0 ? in.size() : pos + length;
    const size_t frame_start = out.size();
    ZSTD_DCtx_reset(ctx, ZSTD_reset_session_only);
    ZSTD_inBuffer input{in.data(), end, pos};
    size_t last = 1;  // 0 once the frame is complete and flushed
    while (input.pos < input.size || last != 0) {
      ZSTD_outBuffer output{buffer.data(), buffer.size(), 0};
      const size_t before = input.pos;
      last = ZSTD_decompressStream(ctx, &output, &input);
      if (ZSTD_isError(last)) return std::nullopt;
      out.append(buffer.data(), output.pos);
      if (out.size() > kMaxDecoded) return std::nullopt;
      // No progress with input left or a frame unfinished at the end: truncated.
      if (output.pos == 0 && input.pos == before && last != 0) return std::nullopt;
    }
    if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != ZSTD_CONTENTSIZE_ERROR &&
        out.size() - frame_start != declared) {
      return std::nullopt;
    }
    pos = end;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sp::ByteView stored(reinterpret_cast<const std::byte*>(data), size);
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string zstd[] = {sp::torch_dcp::kZstdTransformDescriptor};
  sp::Result<std::string> decoded = DecodeTransformedItem(zstd, stored, kMaxDecoded, "fuzz");
  if (decoded.ok()) Check(decoded->size() <= kMaxDecoded);
  std::optional<std::string> reference = Reference(bytes);
  Check(decoded.ok() == reference.has_value());
  if (!decoded.ok()) {
    Check(!decoded.status().ok());
  } else {
    Check(*decoded == *reference);
    sp::Result<std::string> again = sp::torch_dcp::EncodeZstdItem(sp::AsBytes(*decoded), 1);
    Check(again.ok());
    sp::Result<std::string> back = DecodeTransformedItem(zstd, sp::AsBytes(*again), kMaxDecoded, "fuzz");
    Check(back.ok() && *back == *decoded);
  }
  sp::Result<std::string> plain = DecodeTransformedItem({}, stored, kMaxDecoded, "fuzz");
  Check(plain.ok() == (size <= kMaxDecoded) && (!plain.ok() || *plain == bytes));
  return 0;
}
