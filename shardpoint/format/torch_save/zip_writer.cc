// ZIP layout and framing, byte for byte as PyTorchStreamWriter (miniz) writes it.
#include <set>

#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/format/torch_save/zip_format.h"

namespace sp::torch_save {

using namespace zipfmt;  // NOLINT: the record constants

namespace {

constexpr uint16_t kFlagDescriptor = 0x0008;
constexpr uint16_t kFlagUtf8 = 0x0800;
constexpr uint16_t kZip64VersionMadeBy = 0x031E;  // Unix, 3.0: what miniz writes
constexpr uint16_t kZip64VersionNeeded = 45;

bool NeedsZip64(uint64_t size, uint64_t header_offset) {
  return size >= kMax32 || header_offset >= kMax32;
}

// Bytes of the zip64 extra field miniz puts in a local header (size and a zero compressed size
// when the size is large, the header offset when that is large).
uint64_t LocalZip64Bytes(uint64_t size, uint64_t header_offset) {
  if (!NeedsZip64(size, header_offset)) return 0;
  return 4 + (size >= kMax32 ? 16 : 0) + (header_offset >= kMax32 ? 8 : 0);
}

uint64_t DescriptorBytes(uint64_t size, uint64_t header_offset) {
  if (size == 0) return 0;
  return NeedsZip64(size, header_offset) ? 24 : 16;
}

uint16_t Flags(uint64_t size) { return size > 0 ? (kFlagUtf8 | kFlagDescriptor) : kFlagUtf8; }

void PutZip64Extra(std::string* out, bool with_sizes, uint64_t uncompressed, uint64_t compressed,
                   bool with_offset, uint64_t offset) {
  Put16(out, kZip64ExtraId);
  Put16(out, static_cast<uint16_t>((with_sizes ? 16 : 0) + (with_offset ? 8 : 0)));
  if (with_sizes) {
    Put64(out, uncompressed);
    Put64(out, compressed);
  }
  if (with_offset) Put64(out, offset);
}

}  // namespace

Result<ZipLayout> ZipLayout::Plan(std::vector<ZipEntrySpec> entries, uint64_t alignment) {
  if (alignment < 1 || alignment > 4096) {
    return InvalidArgumentError("ZIP alignment must be 1 to 4096, got " + std::to_string(alignment));
  }
  ZipLayout layout;
  std::set<std::string> names;
  uint64_t cursor = 0;
  for (ZipEntrySpec& spec : entries) {
    if (spec.name.empty() || spec.name.size() > 0xFFFF || !names.insert(spec.name).second) {
      return InvalidArgumentError("ZIP entry name '" + spec.name + "' is empty, too long or repeated");
    }
    if (spec.size > (uint64_t{1} << 62)) {
      return InvalidArgumentError("ZIP entry '" + spec.name + "' is too large");
    }
    Placed p{std::move(spec.name), spec.size, cursor, 0};
    uint64_t start = cursor + kLocalHeaderSize + p.name.size() + 4 + LocalZip64Bytes(p.size, cursor);
    p.data_offset = start + (alignment - start % alignment) % alignment;
    cursor = p.data_offset + p.size + DescriptorBytes(p.size, p.header_offset);
    layout.entries_.push_back(std::move(p));
  }
  layout.central_directory_offset_ = cursor;
  uint64_t cd_size = 0;
  for (const Placed& p : layout.entries_) {
    bool big_size = p.size >= kMax32, big_offset = p.header_offset >= kMax32;
    uint64_t extra = (big_size || big_offset) ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0;
    cd_size += kCentralHeaderSize + p.name.size() + extra;
  }
  layout.total_size_ = cursor + cd_size + kZip64EocdSize + kZip64LocatorSize + kEocdSize;
  return layout;
}

std::string ZipLayout::LocalHeader(size_t i) const {
  const Placed& p = entries_[i];
  uint64_t zip64 = LocalZip64Bytes(p.size, p.header_offset);
  uint64_t fixed = p.header_offset + kLocalHeaderSize + p.name.size() + zip64 + 4;
  uint64_t padding = p.data_offset - fixed;
  std::string out;
  out.reserve(p.data_offset - p.header_offset);
  Put32(&out, kLocalSig);
  Put16(&out, 0);  // version needed, as miniz writes it
  Put16(&out, Flags(p.size));
  Put16(&out, 0);  // stored
  Put32(&out, 0);  // time, date
  Put32(&out, 0);  // CRC-32: in the data descriptor
  Put32(&out, 0);  // sizes: in the data descriptor
  Put32(&out, 0);
  Put16(&out, static_cast<uint16_t>(p.name.size()));
  Put16(&out, static_cast<uint16_t>(zip64 + 4 + padding));
  out.append(p.name);
  if (zip64 > 0) {
    PutZip64Extra(&out, p.size >= kMax32, p.size, 0, p.header_offset >= kMax32, p.header_offset);
  }
  out.append("FB");
  Put16(&out, static_cast<uint16_t>(padding));
  out.append(padding, 'Z');
  return out;
}

std::string ZipLayout::DataDescriptor(size_t i, uint32_t crc32) const {
  const Placed& p = entries_[i];
  std::string out;
  if (p.size == 0) return out;
  Put32(&out, kDescriptorSig);
  Put32(&out, crc32);
  if (NeedsZip64(p.size, p.header_offset)) {
    Put64(&out, p.size);
    Put64(&out, p.size);
  } else {
    Put32(&out, static_cast<uint32_t>(p.size));
    Put32(&out, static_cast<uint32_t>(p.size));
  }
  return out;
}

std::string ZipLayout::CentralDirectory(std::span<const uint32_t> crc32s) const {
  std::string out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Placed& p = entries_[i];
    bool big_size = p.size >= kMax32, big_offset = p.header_offset >= kMax32;
    uint16_t extra = (big_size || big_offset) ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0;
    Put32(&out, kCentralSig);
    Put16(&out, 0);  // version made by
    Put16(&out, 0);  // version needed
    Put16(&out, Flags(p.size));
    Put16(&out, 0);  // stored
    Put32(&out, 0);  // time, date
    Put32(&out, p.size == 0 ? 0 : (i < crc32s.size() ? crc32s[i] : 0));
    uint32_t size32 = big_size ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(p.size);
    Put32(&out, size32);
    Put32(&out, size32);
    Put16(&out, static_cast<uint16_t>(p.name.size()));
    Put16(&out, extra);
    Put16(&out, 0);  // comment
    Put16(&out, 0);  // disk
    Put16(&out, 0);  // internal attributes
    Put32(&out, 0);  // external attributes
    Put32(&out, big_offset ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(p.header_offset));
    out.append(p.name);
    if (extra > 0) PutZip64Extra(&out, big_size, p.size, p.size, big_offset, p.header_offset);
  }
  uint64_t cd_size = out.size();
  uint64_t count = entries_.size();
  Put32(&out, kZip64EocdSig);
  Put64(&out, kZip64EocdSize - 12);
  Put16(&out, kZip64VersionMadeBy);
  Put16(&out, kZip64VersionNeeded);
  Put32(&out, 0);
  Put32(&out, 0);
  Put64(&out, count);
  Put64(&out, count);
  Put64(&out, cd_size);
  Put64(&out, central_directory_offset_);
  Put32(&out, kZip64LocatorSig);
  Put32(&out, 0);
  Put64(&out, central_directory_offset_ + cd_size);
  Put32(&out, 1);
  Put32(&out, kEocdSig);
  Put32(&out, 0);  // disk numbers
  uint16_t count16 = count >= 0xFFFF ? 0xFFFF : static_cast<uint16_t>(count);
  Put16(&out, count16);
  Put16(&out, count16);
  Put32(&out, cd_size >= kMax32 ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(cd_size));
  Put32(&out, central_directory_offset_ >= kMax32 ? static_cast<uint32_t>(kMax32)
                                                  : static_cast<uint32_t>(central_directory_offset_));
  Put16(&out, 0);  // comment
  return out;
}

Result<std::string> BuildZip(const std::vector<std::pair<std::string, std::string>>& entries,
                             uint64_t alignment) {
  std::vector<ZipEntrySpec> specs;
  for (const auto& [name, data] : entries) specs.push_back({name, data.size()});
  SP_ASSIGN_OR_RETURN(ZipLayout layout, ZipLayout::Plan(std::move(specs), alignment));
  std::string out;
  out.reserve(layout.total_size());
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& data = entries[i].second;
    crcs.push_back(Crc32(0, data.data(), data.size()));
    out += layout.LocalHeader(i);
    out += data;
    out += layout.DataDescriptor(i, crcs.back());
  }
  out += layout.CentralDirectory(crcs);
  return out;
}

}  // namespace sp::torch_save
