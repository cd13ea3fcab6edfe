// libFuzzer target for the safetensors header parser and its JSON subset (docs/FORMAT.md §2).
//
// The input is a whole safetensors file. A header that parses must re-encode to a header that
// parses to the same entries and metadata.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "shardpoint/base/json.h"
#include "shardpoint/format/safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  sp::ParseJson(bytes, "fuzz").status().IgnoreError();
  sp::Result<sp::SafetensorsHeader> header = sp::ParseSafetensorsHeader(bytes, size, "fuzz");
  if (!header.ok()) return 0;
  std::string encoded = sp::EncodeSafetensorsHeader(header->entries, header->metadata);
  uint64_t data_bytes = size - header->data_start;
  encoded.append(data_bytes, '\0');
  sp::Result<sp::SafetensorsHeader> again =
      sp::ParseSafetensorsHeader(encoded, encoded.size(), "fuzz");
  if (!again.ok() || again->entries != header->entries || again->metadata != header->metadata) {
    std::abort();
  }
  return 0;
}
