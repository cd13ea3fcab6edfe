// libFuzzer target for the metadata wire codec (shardpoint/format/metadata_wire.h), which ranks
// decode from the coordinator's broadcast.
//
// A decoded model must re-encode to bytes that decode to the same model and encode to the same
// bytes again. The encoding is never longer than the input (a repeated attribute key is the only
// thing decoding drops, at least 8 bytes each) and, with at most one attribute (nothing to
// reorder), equals the input when it is as long. A re-encoding cut by one byte is refused.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "shardpoint/format/metadata_wire.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  sp::Result<sp::CheckpointMetadata> decoded = sp::DecodeMetadataFromWire(bytes);
  if (!decoded.ok()) return 0;
  std::string encoded = sp::EncodeMetadataForWire(*decoded);
  Check(encoded.size() <= size);
  if (encoded.size() == size && decoded->attributes.size() <= 1) Check(encoded == bytes);
  sp::Result<sp::CheckpointMetadata> again = sp::DecodeMetadataFromWire(encoded);
  Check(again.ok() && *again == *decoded);
  Check(sp::EncodeMetadataForWire(*again) == encoded);
  sp::Result<sp::CheckpointMetadata> cut =
      sp::DecodeMetadataFromWire(std::string_view(encoded).substr(0, encoded.size() - 1));
  Check(!cut.ok());
  return 0;
}
