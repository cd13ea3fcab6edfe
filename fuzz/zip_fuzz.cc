// libFuzzer target for the ZIP reader and the torch.save archive parsers
// (shardpoint/format/torch_save, docs/TORCH_DCP.md).
//
// Each input is read as an archive twice: as given, and with the central directory's CRC-32s
// recomputed so that mutations of data.pkl reach the unpickler instead of stopping at a CRC.
// Every entry is located and read; the archive is parsed as a tensor, a state dict and plain
// data, and as a Megatron common.pt (cut into one re-emitted archive per entry, each of which is
// parsed again). Located data must lie inside the archive and before the central directory.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/format/torch_save/zip.h"

namespace {

using namespace sp::torch_dcp;   // NOLINT
using namespace sp::torch_save;  // NOLINT

void Check(bool condition) {
  if (!condition) std::abort();
}

// Rewrites the CRC-32 of every central directory entry whose data can be located.
void FixCrcs(std::string& b) {
  RangeReader read = MemoryRangeReader(sp::AsBytes(b));
  sp::Result<ZipDirectory> dir = ReadZipDirectory(read, b.size(), "fuzz");
  if (!dir.ok()) return;
  uint64_t pos = dir->central_directory_offset;
  for (const ZipEntry& e : dir->entries) {
    if (pos + 46 > b.size()) return;
    uint16_t n, x, c;
    std::memcpy(&n, b.data() + pos + 28, 2);
    std::memcpy(&x, b.data() + pos + 30, 2);
    std::memcpy(&c, b.data() + pos + 32, 2);
    sp::Result<uint64_t> offset = ZipEntryDataOffset(read, *dir, e, "fuzz");
    if (offset.ok()) {
      uint32_t crc = sp::Crc32(0, b.data() + *offset, e.size);
      std::memcpy(b.data() + pos + 16, &crc, 4);
    }
    pos += 46 + n + x + c;
  }
}

void ReadAll(const std::string& b) {
  RangeReader read = MemoryRangeReader(sp::AsBytes(b));
  sp::Result<ZipDirectory> dir = ReadZipDirectory(read, b.size(), "fuzz");
  if (dir.ok()) {
    for (const ZipEntry& e : dir->entries) {
      sp::Result<uint64_t> offset = ZipEntryDataOffset(read, *dir, e, "fuzz");
      if (offset.ok()) Check(*offset <= dir->central_directory_offset && e.size <= b.size() - *offset);
      ReadZipEntry(read, *dir, e, "fuzz", 1 << 20).status().IgnoreError();
    }
  }
  sp::Result<TorchSaveTensorInfo> t = ParseTorchSaveTensor(read, b.size(), "fuzz");
  if (t.ok()) Check(t->data_offset <= b.size() && t->storage_bytes <= b.size() - t->data_offset);
  ParseTorchSaveStateDict(read, b.size(), "fuzz").status().IgnoreError();
  ParseTorchSaveObject(read, b.size(), "fuzz").status().IgnoreError();
  sp::Result<MegatronCommon> common = DecodeMegatronCommon(sp::AsBytes(b), "fuzz");
  if (common.ok()) {
    Check(common->objects.size() == common->paths.size());
    for (const sp::ObjectEntry& o : common->objects) {
      ReemitTorchSaveArchive(sp::AsBytes(o.payload), "fuzz").status().IgnoreError();
    }
  }
  ParseMegatronConfig(b, "fuzz").status().IgnoreError();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  ReadAll(bytes);
  FixCrcs(bytes);
  ReadAll(bytes);
  return 0;
}
