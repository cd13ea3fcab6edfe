// ZIP archives as torch.save writes them: read the directory of an archive that lies in a byte
// range of a larger file, and lay out new archives whose entry data the caller writes itself.
//
// torch.save (PyTorchStreamWriter over miniz) writes a ZIP with only stored (uncompressed)
// entries, a data descriptor after each non-empty entry, a zip64 end-of-central-directory record
// and locator always, zip64 extra fields when a size or offset reaches 0xFFFFFFFF, and every
// entry's data aligned to 64 bytes from the archive start through an "FB" extra field in the
// local header. docs/TORCH_DCP.md §3 has the details. torch does not check CRC-32s when it
// reads; this reader checks them for the small entries it reads whole (ReadZipEntry).
//
// Reading never reads the whole archive: the end records, the central directory, and the local
// header of each entry asked for. Sizes and offsets come from the central directory; the data
// start comes from the local header's name and extra lengths (as torch's getRecordOffset does).
// Input is hostile: every offset is checked against the archive length and the central
// directory's position, and sizes are capped. Errors are kDataLoss naming `what` and the entry;
// a compressed or encrypted entry is kUnimplemented naming it.
//
// Writing (ZipLayout) is zero-copy: the layout (every offset and the total size) is computed from
// names and sizes alone; the caller writes each entry's data at data_offset(i) itself, computes
// its CRC-32 while doing so, and then asks for the framing bytes. Local headers do not depend on
// the CRCs (they are written with the data-descriptor flag, as miniz does), so they can be
// written before the data. The bytes produced are those torch.save would write for the same
// entries. All functions are thread-safe; a ZipLayout is immutable.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/crc32.h"
#include "shardpoint/base/result.h"

namespace sp::torch_save {

// Reads exactly `n` bytes at `offset` (relative to the archive start) into `out`.
using RangeReader = std::function<Status(uint64_t offset, uint64_t n, std::byte* out)>;

// A RangeReader over bytes in memory; reads past the end are kDataLoss.
RangeReader MemoryRangeReader(ByteView bytes);

inline constexpr uint64_t kMaxZipCentralDirectoryBytes = uint64_t{64} << 20;

struct ZipEntry {
  std::string name;
  uint16_t flags = 0;
  uint16_t method = 0;  // 0 = stored
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0;
  uint64_t size = 0;
  uint64_t local_header_offset = 0;
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;  // central directory order; names are unique
  uint64_t central_directory_offset = 0;
  uint64_t archive_length = 0;

  // The entry named `name`, or null.
  const ZipEntry* Find(std::string_view name) const;
};

// Reads the end records and the central directory of the archive [0, archive_length).
Result<ZipDirectory> ReadZipDirectory(const RangeReader& read, uint64_t archive_length,
                                      std::string_view what);

// The offset of `entry`'s data: reads its local header and checks the signature, the name, that
// the entry is stored and not encrypted, and that its data lies before the central directory.
Result<uint64_t> ZipEntryDataOffset(const RangeReader& read, const ZipDirectory& dir,
                                    const ZipEntry& entry, std::string_view what);

// Reads a whole stored entry of at most `max_bytes` bytes and checks its CRC-32 (a stored CRC of
// 0 means "not computed", as torch writes with CRCs disabled, and is not checked).
Result<std::string> ReadZipEntry(const RangeReader& read, const ZipDirectory& dir,
                                 const ZipEntry& entry, std::string_view what, uint64_t max_bytes);

struct ZipEntrySpec {
  std::string name;
  uint64_t size = 0;
};

class ZipLayout {
 public:
  // Lays out `entries` in order with data aligned to `alignment` (1 to 4096; torch uses 64).
  // kInvalidArgument for an empty or over-long (> 65535 bytes) or duplicate name, or a bad
  // alignment.
  static Result<ZipLayout> Plan(std::vector<ZipEntrySpec> entries, uint64_t alignment = 64);

  size_t entry_count() const { return entries_.size(); }
  const std::string& name(size_t i) const { return entries_[i].name; }
  uint64_t size(size_t i) const { return entries_[i].size; }
  uint64_t header_offset(size_t i) const { return entries_[i].header_offset; }
  uint64_t data_offset(size_t i) const { return entries_[i].data_offset; }
  uint64_t data_end(size_t i) const { return entries_[i].data_offset + entries_[i].size; }
  uint64_t central_directory_offset() const { return central_directory_offset_; }
  uint64_t total_size() const { return total_size_; }

  // Bytes [header_offset(i), data_offset(i)): the local header with its extra fields.
  std::string LocalHeader(size_t i) const;
  // Bytes [data_end(i), next header or central directory): the data descriptor (empty for an
  // empty entry).
  std::string DataDescriptor(size_t i, uint32_t crc32) const;
  // Bytes [central_directory_offset(), total_size()): central directory, zip64 end record,
  // zip64 locator, end record. `crc32s` has one CRC per entry.
  std::string CentralDirectory(std::span<const uint32_t> crc32s) const;

 private:
  struct Placed {
    std::string name;
    uint64_t size = 0;
    uint64_t header_offset = 0;
    uint64_t data_offset = 0;
  };
  std::vector<Placed> entries_;
  uint64_t central_directory_offset_ = 0;
  uint64_t total_size_ = 0;
};

// A whole archive in memory: entries in order, each stored and aligned to `alignment`.
Result<std::string> BuildZip(const std::vector<std::pair<std::string, std::string>>& entries,
                             uint64_t alignment = 64);

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_ZIP_H_
