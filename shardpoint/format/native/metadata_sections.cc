// The header, summary and index sections of the native metadata file (docs/FORMAT.md §3.1-3.4).
#include <cstring>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/format/native/metadata_sections.h"

namespace sp::native_metadata {
namespace {

bool ValidSaveId(std::string_view id) {
  if (id.empty() || id.size() > kMaxSaveIdBytes || id.front() == '.') return false;
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// One path component: hostile metadata must not name files outside the checkpoint.
bool ValidFileName(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

Status DecodeDataFile(ByteReader& r, int32_t world_size, std::string_view path, DataFile* file) {
  SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString(kMaxFileNameBytes));
  if (!ValidFileName(name)) {
    return Corrupt(path, "data file name \"" + std::string(name) +
                             "\" is not a single path component");
  }
  file->name = std::string(name);
  SP_ASSIGN_OR_RETURN(file->data_start, r.ReadU64());
  SP_ASSIGN_OR_RETURN(file->size, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint32_t writer, r.ReadU32());
  file->writer_rank = static_cast<int32_t>(writer);
  if (file->data_start < 8 || file->data_start > file->size) {
    return Corrupt(path, "data file " + file->name + ": data_start " +
                             std::to_string(file->data_start) + " is outside [8, size " +
                             std::to_string(file->size) + "]");
  }
  if (file->writer_rank < 0 || file->writer_rank >= world_size) {
    return Corrupt(path, "data file " + file->name + ": writer rank " +
                             std::to_string(file->writer_rank) + " is outside [0, world size " +
                             std::to_string(world_size) + ")");
  }
  return OkStatus();
}

Status DecodeAttributes(ByteReader& r, std::string_view path,
                        std::map<std::string, std::string>* out) {
  SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadCount(8));
  if (count > kMaxAttributes) {
    return Corrupt(path, std::to_string(count) + " attributes exceed the limit");
  }
  std::string_view previous;
  for (uint32_t i = 0; i < count; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view key, r.ReadString(kMaxAttributeKeyBytes));
    SP_ASSIGN_OR_RETURN(std::string_view value, r.ReadString(kMaxAttributeValueBytes));
    if (i > 0 && key <= previous) {
      return Corrupt(path, "attribute \"" + std::string(key) + "\" is out of order after \"" +
                               std::string(previous) + "\"");
    }
    previous = key;
    out->emplace_hint(out->end(), std::string(key), std::string(value));
  }
  return OkStatus();
}

}  // namespace

Status Corrupt(std::string_view path, std::string_view problem) {
  return DataLossError("metadata file " + std::string(path) + ": " + std::string(problem));
}

Status CheckCrc(std::string_view bytes, uint32_t expected, std::string_view what,
                std::string_view path) {
  uint32_t actual = Crc32c(bytes);
  if (actual == expected) return OkStatus();
  return Corrupt(path, std::string(what) + " checksum mismatch (stored " +
                           std::to_string(expected) + ", computed " + std::to_string(actual) + ")");
}

Result<uint32_t> DecodePrefix(std::string_view prefix, uint64_t file_size, std::string_view path,
                              CheckpointMetadata* summary) {
  if (file_size < kPrefixBytes || prefix.size() < kPrefixBytes) {
    return Corrupt(path, "file of " + std::to_string(file_size) +
                             " bytes is shorter than the 32-byte header");
  }
  if (file_size > kMaxMetadataBytes) {
    return Corrupt(path, "file of " + std::to_string(file_size) + " bytes exceeds the 4 GiB limit");
  }
  if (std::memcmp(prefix.data(), kMagic, sizeof(kMagic)) != 0) {
    return Corrupt(path, "bad magic: not a shardpoint metadata file");
  }
  uint32_t major = DecodeFixed32(prefix.data() + 8);
  uint32_t minor = DecodeFixed32(prefix.data() + 12);
  std::string version = std::to_string(major) + "." + std::to_string(minor);
  if (major > kNativeFormatMajor) {
    return FailedPreconditionError("metadata file " + std::string(path) +
                                   ": checkpoint format version " + version +
                                   " is newer than this reader (" +
                                   std::to_string(kNativeFormatMajor) + ".x)");
  }
  if (major < kOldestNativeFormatMajor) return Corrupt(path, "unknown format version " + version);
  summary->version_major = major;
  summary->version_minor = minor;
  uint32_t header_length = DecodeFixed32(prefix.data() + 16);
  uint32_t section_count = DecodeFixed32(prefix.data() + 20);
  if (section_count < kSectionCount || section_count > kMaxSectionCount ||
      header_length != kPrefixBytes + kSectionEntryBytes * section_count + 4 ||
      header_length > file_size) {
    return Corrupt(path, "inconsistent header: length " + std::to_string(header_length) +
                             " with " + std::to_string(section_count) + " sections in a file of " +
                             std::to_string(file_size) + " bytes");
  }
  return header_length;
}

Result<std::vector<Section>> DecodeSectionTable(std::string_view header, uint64_t file_size,
                                                std::string_view path) {
  size_t crc_at = header.size() - 4;
  SP_RETURN_IF_ERROR(CheckCrc(header.substr(0, crc_at), DecodeFixed32(header.data() + crc_at),
                              "header", path));
  uint64_t stored_size = DecodeFixed64(header.data() + 24);
  if (stored_size != file_size) {
    return Corrupt(path, "the header says the file holds " + std::to_string(stored_size) +
                             " bytes, found " + std::to_string(file_size));
  }
  std::vector<Section> sections((crc_at - kPrefixBytes) / kSectionEntryBytes);
  uint64_t expected = header.size();
  for (size_t i = 0; i < sections.size(); ++i) {
    const char* p = header.data() + kPrefixBytes + i * kSectionEntryBytes;
    Section& s = sections[i];
    s = {DecodeFixed64(p), DecodeFixed64(p + 8), DecodeFixed32(p + 16), DecodeFixed32(p + 20)};
    if (s.offset != expected || s.length > file_size - s.offset) {
      return Corrupt(path, "section " + std::to_string(i) + " at [" + std::to_string(s.offset) +
                               ", +" + std::to_string(s.length) + ") is misplaced (expected at " +
                               std::to_string(expected) + ", file size " +
                               std::to_string(file_size) + ")");
    }
    expected = s.offset + s.length;
  }
  if (expected != file_size) {
    return Corrupt(path, "sections end at " + std::to_string(expected) + ", the file at " +
                             std::to_string(file_size));
  }
  if (sections[kTensorIndex].count != sections[kTensorRecords].count ||
      sections[kObjectIndex].count != sections[kObjectRecords].count) {
    return Corrupt(path, "index and record sections disagree on their counts");
  }
  return sections;
}

std::string EncodeSummary(const CheckpointMetadata& m, bool header_crcs) {
  std::string out;
  ByteWriter w(&out);
  w.PutString(m.save_id);
  w.PutU32(static_cast<uint32_t>(m.world_size));
  w.PutU64(m.checksum_block_bytes);
  w.PutU32(static_cast<uint32_t>(m.files.size()));
  for (const DataFile& f : m.files) {
    w.PutString(f.name);
    w.PutU64(f.data_start);
    w.PutU64(f.size);
    w.PutU32(static_cast<uint32_t>(f.writer_rank));
  }
  w.PutU32(static_cast<uint32_t>(m.attributes.size()));
  for (const auto& [key, value] : m.attributes) {
    w.PutString(key);
    w.PutString(value);
  }
  if (header_crcs) {
    for (const DataFile& f : m.files) w.PutU32(f.header_crc32c);
  }
  return out;
}

Status DecodeSummary(std::string_view bytes, bool newer_minor, std::string_view path,
                     CheckpointMetadata* out) {
  ByteReader r(bytes, "metadata file " + std::string(path) + ", summary");
  SP_ASSIGN_OR_RETURN(std::string_view save_id, r.ReadString(kMaxSaveIdBytes));
  if (!ValidSaveId(save_id)) {
    return Corrupt(path, "save_id \"" + std::string(save_id) + "\" is not 1-128 bytes of [A-Za-z0-9._-]");
  }
  out->save_id = std::string(save_id);
  SP_ASSIGN_OR_RETURN(uint32_t world_size, r.ReadU32());
  out->world_size = static_cast<int32_t>(world_size);
  if (out->world_size < 1 || out->world_size > kMaxWorldSize) {
    return Corrupt(path, "world size " + std::to_string(out->world_size) + " is out of range");
  }
  SP_ASSIGN_OR_RETURN(out->checksum_block_bytes, r.ReadU64());
  if (out->checksum_block_bytes < 1 || out->checksum_block_bytes > kMaxChecksumBlockBytes) {
    return Corrupt(path, "checksum block size " + std::to_string(out->checksum_block_bytes) +
                             " is out of range [1, 2^40]");
  }
  SP_ASSIGN_OR_RETURN(uint32_t file_count, r.ReadCount(25));
  if (file_count > kMaxFiles) return Corrupt(path, "too many data files");
  out->files.resize(file_count);
  for (DataFile& file : out->files) {
    SP_RETURN_IF_ERROR(DecodeDataFile(r, out->world_size, path, &file));
  }
  SP_RETURN_IF_ERROR(DecodeAttributes(r, path, &out->attributes));
  // From version 3.1: each data file's header CRC (its header holds its chunks' checksums); from
  // version 4 the records hold none.
  out->data_file_checksums =
      out->version_major >= 4 || (out->version_major == 3 && out->version_minor >= 1);
  out->checksums_in_headers = out->version_major >= 4;
  if (out->data_file_checksums) {
    if (out->files.size() > r.remaining() / 4) {
      return Corrupt(path, "the summary ends before the header CRCs of its " +
                               std::to_string(out->files.size()) + " data files");
    }
    for (DataFile& file : out->files) {
      SP_ASSIGN_OR_RETURN(file.header_crc32c, r.ReadU32());
    }
  }
  if (!r.done() && !newer_minor) {
    return Corrupt(path, std::to_string(r.remaining()) + " unexpected bytes after the summary");
  }
  return OkStatus();
}

void EncodeIndexEntry(std::string* out, std::string_view name, const RecordSlot& slot) {
  ByteWriter w(out);
  w.PutString(name);
  w.PutU64(slot.offset);
  w.PutU64(slot.length);
  w.PutU32(slot.crc32c);
}

Status DecodeIndex(std::string_view bytes, uint32_t count, uint64_t records_length,
                   std::string_view what, std::string_view path, std::vector<std::string>* names,
                   std::vector<RecordSlot>* slots) {
  constexpr size_t kMinEntryBytes = 4 + 8 + 8 + 4;  // an empty name is refused below
  if (count > bytes.size() / kMinEntryBytes) {
    return Corrupt(path, std::string(what) + ": " + std::to_string(count) +
                             " entries cannot fit in " + std::to_string(bytes.size()) + " bytes");
  }
  ByteReader r(bytes, "metadata file " + std::string(path) + ", " + std::string(what));
  names->reserve(count);
  slots->reserve(count);
  uint64_t expected_offset = 0;
  for (uint32_t i = 0; i < count; ++i) {
    SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString(kMaxNameBytes));
    if (name.empty() || (i > 0 && name <= names->back())) {
      return Corrupt(path, std::string(what) + ": name \"" + std::string(name) +
                               "\" is empty, duplicate or out of order");
    }
    RecordSlot slot;
    SP_ASSIGN_OR_RETURN(slot.offset, r.ReadU64());
    SP_ASSIGN_OR_RETURN(slot.length, r.ReadU64());
    SP_ASSIGN_OR_RETURN(slot.crc32c, r.ReadU32());
    if (slot.offset != expected_offset || slot.length > kMaxRecordBytes ||
        slot.length > records_length - slot.offset) {
      return Corrupt(path, std::string(what) + ": record of \"" + std::string(name) +
                               "\" at [" + std::to_string(slot.offset) + ", +" +
                               std::to_string(slot.length) + ") is misplaced");
    }
    expected_offset += slot.length;
    names->emplace_back(name);
    slots->push_back(slot);
  }
  if (expected_offset != records_length || !r.done()) {
    return Corrupt(path, std::string(what) + ": records cover " + std::to_string(expected_offset) +
                             " of " + std::to_string(records_length) + " bytes");
  }
  return OkStatus();
}

}  // namespace sp::native_metadata
