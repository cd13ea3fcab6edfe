// libFuzzer target for the native metadata decoder (docs/FORMAT.md §3).
//
// Each input is decoded twice: as given, and with the header and section checksums recomputed
// so that mutations reach the section and record decoders instead of stopping at a CRC. A
// decoded file must re-encode to bytes that decode to the same metadata, and every tensor and
// object must also be readable one at a time through MetadataReader. Decoded as a save plan holds
// it (tensors as cells, format/chunk_grid.h), it must encode to the same bytes with its checksums
// kept apart and expand to the same chunks.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/native/metadata_codec.h"

namespace {

class BytesFile : public sp::ReadableFile {
 public:
  explicit BytesFile(std::string bytes) : bytes_(std::move(bytes)) {}
  sp::Status ReadAt(uint64_t offset, sp::MutableByteView out) const override {
    if (offset > bytes_.size() || out.size() > bytes_.size() - offset) {
      return sp::DataLossError("read past the end");
    }
    std::memcpy(out.data(), bytes_.data() + offset, out.size());
    return sp::OkStatus();
  }
  uint64_t size() const override { return bytes_.size(); }
  const std::string& path() const override { return path_; }

 private:
  std::string bytes_;
  std::string path_ = "fuzz";
};

// Recomputes the section CRCs and the header CRC where the layout allows it.
void FixChecksums(std::string& b) {
  if (b.size() < 32) return;
  uint64_t header_length = sp::DecodeFixed32(b.data() + 16);
  uint64_t count = sp::DecodeFixed32(b.data() + 20);
  if (count > 64 || header_length != 32 + 24 * count + 4 || header_length > b.size()) return;
  for (uint64_t i = 0; i < count; ++i) {
    char* p = b.data() + 32 + 24 * i;
    uint64_t offset = sp::DecodeFixed64(p);
    uint64_t length = sp::DecodeFixed64(p + 8);
    if (offset > b.size() || length > b.size() - offset) continue;
    sp::EncodeFixed32(p + 16, sp::Crc32c(b.data() + offset, length));
  }
  sp::EncodeFixed32(b.data() + header_length - 4, sp::Crc32c(b.data(), header_length - 4));
}

void Check(bool condition) {
  if (!condition) std::abort();
}

void DecodeOne(const std::string& bytes) {
  sp::Result<sp::CheckpointMetadata> decoded = sp::DecodeMetadata(bytes, "fuzz");
  auto reader = sp::MetadataReader::Open(std::make_unique<BytesFile>(bytes));
  if (decoded.ok()) Check(reader.ok());
  if (reader.ok()) {
    const sp::MetadataReader& r = **reader;
    for (const std::string& name : r.tensor_names()) r.ReadTensor(name).status().IgnoreError();
    for (const std::string& name : r.object_names()) r.ReadObject(name).status().IgnoreError();
  }
  if (!decoded.ok()) return;
  std::string encoded = sp::EncodeMetadata(*decoded);
  sp::Result<sp::CheckpointMetadata> again = sp::DecodeMetadata(encoded, "fuzz");
  Check(again.ok());
  Check(sp::EncodeMetadata(*again) == encoded);
  for (uint32_t f = 0; f < again->files.size(); ++f) sp::BuildDataFileHeader(*again, f);
  // Decoded as a save plan holds it (every tensor of raw chunks as cells, no checksums): the same
  // file from the cells and the checksums kept apart, and the same chunks once expanded.
  sp::Result<sp::CheckpointMetadata> as_cells =
      sp::DecodeMetadata(bytes, "fuzz", nullptr, nullptr, /*chunk_cells=*/true);
  Check(as_cells.ok() && as_cells->tensors.size() == decoded->tensors.size());
  sp::ChunkChecksums checksums;
  for (const sp::TensorMetadata& t : decoded->tensors) {
    sp::ChunkChecksums::Tensor& table = checksums.tensors.emplace_back();
    for (const sp::StoredChunk& c : t.chunks) {
      table.starts.push_back(table.crcs.size());
      table.crcs.insert(table.crcs.end(), c.block_crc32c.begin(), c.block_crc32c.end());
    }
    table.starts.push_back(table.crcs.size());
  }
  Check(sp::EncodeMetadata(sp::WithoutTensors(*decoded), as_cells->tensors, checksums) ==
        encoded);
  for (size_t t = 0; t < decoded->tensors.size(); ++t) {
    sp::TensorMetadata expanded = as_cells->tensors[t];
    sp::ExpandChunkCells(&expanded);
    Check(expanded.chunks.size() == decoded->tensors[t].chunks.size());
    for (size_t c = 0; c < expanded.chunks.size(); ++c) {
      sp::StoredChunk chunk = decoded->tensors[t].chunks[c];
      if (as_cells->tensors[t].cells) chunk.block_crc32c.clear();
      Check(expanded.chunks[c] == chunk);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  DecodeOne(bytes);
  FixChecksums(bytes);
  DecodeOne(bytes);
  return 0;
}
