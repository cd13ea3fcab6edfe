// ZIP reading (the writer is in zip_writer.cc).
#include <algorithm>
#include <array>
#include <cstring>
#include <set>

#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/format/torch_save/zip_format.h"

namespace sp::torch_save {

using namespace zipfmt;  // NOLINT: the record constants

namespace {


Status Corrupt(std::string_view what, const std::string& problem) {
  return DataLossError("ZIP archive " + std::string(what) + ": " + problem);
}

Result<std::string> ReadRange(const RangeReader& read, uint64_t offset, uint64_t n) {
  std::string out(n, '\0');
  SP_RETURN_IF_ERROR(read(offset, n, reinterpret_cast<std::byte*>(out.data())));
  return out;
}

struct EndRecord {
  uint64_t eocd_offset = 0;
  uint64_t entries = 0;
  uint64_t cd_size = 0;
  uint64_t cd_offset = 0;
  uint64_t cd_limit = 0;  // where the central directory must end (the first end record)
};

// Finds the end-of-central-directory record: first at length - 22 (no comment, what torch
// writes), otherwise by scanning the last 64 KiB + 22 bytes backwards.
Result<uint64_t> FindEocd(const RangeReader& read, uint64_t length, std::string_view what) {
  SP_ASSIGN_OR_RETURN(std::string last, ReadRange(read, length - kEocdSize, kEocdSize));
  if (Le32(last.data()) == kEocdSig && Le16(last.data() + 20) == 0) return length - kEocdSize;
  uint64_t tail = std::min<uint64_t>(length, kEocdSize + 0xFFFF);
  SP_ASSIGN_OR_RETURN(std::string bytes, ReadRange(read, length - tail, tail));
  for (uint64_t i = tail - kEocdSize + 1; i-- > 0;) {
    if (Le32(bytes.data() + i) == kEocdSig &&
        i + kEocdSize + Le16(bytes.data() + i + 20) == tail) {
      return length - tail + i;
    }
  }
  return Corrupt(what, "no end-of-central-directory record in the last " + std::to_string(tail) +
                           " bytes (not a ZIP archive, or truncated)");
}

Status ReadZip64End(const RangeReader& read, EndRecord* end, std::string_view what) {
  SP_ASSIGN_OR_RETURN(std::string loc, ReadRange(read, end->eocd_offset - kZip64LocatorSize,
                                                 kZip64LocatorSize));
  uint64_t z64 = Le64(loc.data() + 8);
  if (Le32(loc.data() + 4) != 0 || Le32(loc.data() + 16) > 1) {
    return Corrupt(what, "multi-disk archives are not supported");
  }
  if (z64 > end->eocd_offset - kZip64LocatorSize ||
      end->eocd_offset - kZip64LocatorSize - z64 < kZip64EocdSize) {
    return Corrupt(what, "zip64 end record offset " + std::to_string(z64) + " out of range");
  }
  SP_ASSIGN_OR_RETURN(std::string rec, ReadRange(read, z64, kZip64EocdSize));
  if (Le32(rec.data()) != kZip64EocdSig) {
    return Corrupt(what, "no zip64 end record at offset " + std::to_string(z64));
  }
  if (Le32(rec.data() + 16) != 0 || Le32(rec.data() + 20) != 0) {
    return Corrupt(what, "multi-disk archives are not supported");
  }
  end->entries = Le64(rec.data() + 32);
  end->cd_size = Le64(rec.data() + 40);
  end->cd_offset = Le64(rec.data() + 48);
  end->cd_limit = z64;
  return OkStatus();
}

Result<EndRecord> ReadEnd(const RangeReader& read, uint64_t length, std::string_view what) {
  EndRecord end;
  SP_ASSIGN_OR_RETURN(end.eocd_offset, FindEocd(read, length, what));
  SP_ASSIGN_OR_RETURN(std::string eocd, ReadRange(read, end.eocd_offset, kEocdSize));
  if (Le16(eocd.data() + 4) != 0 || Le16(eocd.data() + 6) != 0) {
    return Corrupt(what, "multi-disk archives are not supported");
  }
  end.entries = Le16(eocd.data() + 10);
  end.cd_size = Le32(eocd.data() + 12);
  end.cd_offset = Le32(eocd.data() + 16);
  end.cd_limit = end.eocd_offset;
  bool has_locator = false;
  if (end.eocd_offset >= kZip64LocatorSize) {
    SP_ASSIGN_OR_RETURN(std::string sig, ReadRange(read, end.eocd_offset - kZip64LocatorSize, 4));
    has_locator = Le32(sig.data()) == kZip64LocatorSig;
  }
  if (has_locator) {
    SP_RETURN_IF_ERROR(ReadZip64End(read, &end, what));
  } else if (end.entries == 0xFFFF || end.cd_size == kMax32 || end.cd_offset == kMax32) {
    return Corrupt(what, "end record needs zip64 values but there is no zip64 locator");
  }
  if (end.cd_offset > end.cd_limit || end.cd_size > end.cd_limit - end.cd_offset) {
    return Corrupt(what, "central directory [" + std::to_string(end.cd_offset) + ", +" +
                             std::to_string(end.cd_size) + ") overlaps the end records at " +
                             std::to_string(end.cd_limit));
  }
  if (end.cd_size > kMaxZipCentralDirectoryBytes) {
    return Corrupt(what, "central directory of " + std::to_string(end.cd_size) +
                             " bytes is larger than the limit");
  }
  if (end.entries > end.cd_size / kCentralHeaderSize) {
    return Corrupt(what, std::to_string(end.entries) + " entries cannot fit in a central directory of " +
                             std::to_string(end.cd_size) + " bytes");
  }
  return end;
}

// Applies a zip64 extended-information extra field to the fields that hold 0xFFFFFFFF.
Status ApplyZip64Extra(std::string_view extra, ZipEntry* e, std::string_view what) {
  size_t pos = 0;
  while (pos + 4 <= extra.size()) {
    uint16_t id = Le16(extra.data() + pos);
    uint16_t len = Le16(extra.data() + pos + 2);
    if (len > extra.size() - pos - 4) return Corrupt(what, "entry '" + e->name + "': extra field overruns");
    if (id == kZip64ExtraId) {
      std::string_view field = extra.substr(pos + 4, len);
      size_t at = 0;
      for (uint64_t* v : {&e->size, &e->compressed_size, &e->local_header_offset}) {
        if (*v != kMax32) continue;
        if (at + 8 > field.size()) return Corrupt(what, "entry '" + e->name + "': zip64 field too short");
        *v = Le64(field.data() + at);
        at += 8;
      }
      return OkStatus();
    }
    pos += 4 + len;
  }
  if (e->size == kMax32 || e->compressed_size == kMax32 || e->local_header_offset == kMax32) {
    return Corrupt(what, "entry '" + e->name + "' needs a zip64 extra field and has none");
  }
  return OkStatus();
}

Result<ZipEntry> ParseCentralEntry(std::string_view cd, size_t* pos, std::string_view what) {
  if (cd.size() - *pos < kCentralHeaderSize || Le32(cd.data() + *pos) != kCentralSig) {
    return Corrupt(what, "bad central directory header at directory byte " + std::to_string(*pos));
  }
  const char* h = cd.data() + *pos;
  ZipEntry e;
  e.flags = Le16(h + 8);
  e.method = Le16(h + 10);
  e.crc32 = Le32(h + 16);
  e.compressed_size = Le32(h + 20);
  e.size = Le32(h + 24);
  size_t name_len = Le16(h + 28), extra_len = Le16(h + 30), comment_len = Le16(h + 32);
  e.local_header_offset = Le32(h + 42);
  size_t total = kCentralHeaderSize + name_len + extra_len + comment_len;
  if (cd.size() - *pos < total) return Corrupt(what, "central directory entry overruns the directory");
  e.name.assign(h + kCentralHeaderSize, name_len);
  SP_RETURN_IF_ERROR(ApplyZip64Extra(cd.substr(*pos + kCentralHeaderSize + name_len, extra_len), &e, what));
  *pos += total;
  return e;
}

}  // namespace

RangeReader MemoryRangeReader(ByteView bytes) {
  return [bytes](uint64_t offset, uint64_t n, std::byte* out) -> Status {
    if (offset > bytes.size() || n > bytes.size() - offset) {
      return DataLossError("read of " + std::to_string(n) + " bytes at offset " +
                           std::to_string(offset) + " past the end of " +
                           std::to_string(bytes.size()) + " bytes");
    }
    if (n > 0) std::memcpy(out, bytes.data() + offset, n);
    return OkStatus();
  };
}


const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  for (const ZipEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<ZipDirectory> ReadZipDirectory(const RangeReader& read, uint64_t archive_length,
                                      std::string_view what) {
  if (archive_length < kEocdSize) {
    return Corrupt(what, std::to_string(archive_length) + " bytes is too short for a ZIP archive");
  }
  SP_ASSIGN_OR_RETURN(EndRecord end, ReadEnd(read, archive_length, what));
  SP_ASSIGN_OR_RETURN(std::string cd, ReadRange(read, end.cd_offset, end.cd_size));
  ZipDirectory dir;
  dir.central_directory_offset = end.cd_offset;
  dir.archive_length = archive_length;
  std::set<std::string_view> names;
  size_t pos = 0;
  for (uint64_t i = 0; i < end.entries; ++i) {
    SP_ASSIGN_OR_RETURN(ZipEntry e, ParseCentralEntry(cd, &pos, what));
    if (e.local_header_offset > end.cd_offset ||
        end.cd_offset - e.local_header_offset < kLocalHeaderSize) {
      return Corrupt(what, "entry '" + e.name + "' local header offset " +
                               std::to_string(e.local_header_offset) + " is not before the central directory");
    }
    dir.entries.push_back(std::move(e));
  }
  for (const ZipEntry& e : dir.entries) {
    if (!names.insert(e.name).second) return Corrupt(what, "duplicate entry '" + e.name + "'");
  }
  return dir;
}

Result<uint64_t> ZipEntryDataOffset(const RangeReader& read, const ZipDirectory& dir,
                                    const ZipEntry& entry, std::string_view what) {
  if (entry.method != 0) {
    return UnimplementedError("ZIP archive " + std::string(what) + ": entry '" + entry.name +
                              "' is compressed (method " + std::to_string(entry.method) +
                              "); only stored entries are supported");
  }
  if (entry.flags & 1) {
    return UnimplementedError("ZIP archive " + std::string(what) + ": entry '" + entry.name +
                              "' is encrypted");
  }
  if (entry.compressed_size != entry.size) {
    return Corrupt(what, "stored entry '" + entry.name + "' has compressed size " +
                             std::to_string(entry.compressed_size) + " but size " + std::to_string(entry.size));
  }
  SP_ASSIGN_OR_RETURN(std::string h, ReadRange(read, entry.local_header_offset, kLocalHeaderSize));
  if (Le32(h.data()) != kLocalSig) {
    return Corrupt(what, "entry '" + entry.name + "': no local header at offset " +
                             std::to_string(entry.local_header_offset));
  }
  uint64_t name_len = Le16(h.data() + 26), extra_len = Le16(h.data() + 28);
  uint64_t limit = dir.central_directory_offset;
  uint64_t data = entry.local_header_offset + kLocalHeaderSize + name_len + extra_len;
  if (data > limit || entry.size > limit - data) {
    return Corrupt(what, "entry '" + entry.name + "' data [" + std::to_string(data) + ", +" +
                             std::to_string(entry.size) + ") runs past the central directory at " +
                             std::to_string(limit));
  }
  SP_ASSIGN_OR_RETURN(std::string name, ReadRange(read, entry.local_header_offset + kLocalHeaderSize, name_len));
  if (name != entry.name || Le16(h.data() + 8) != 0) {
    return Corrupt(what, "local header of entry '" + entry.name + "' does not match the central directory");
  }
  return data;
}

Result<std::string> ReadZipEntry(const RangeReader& read, const ZipDirectory& dir,
                                 const ZipEntry& entry, std::string_view what, uint64_t max_bytes) {
  if (entry.size > max_bytes) {
    return Corrupt(what, "entry '" + entry.name + "' has " + std::to_string(entry.size) +
                             " bytes, more than the " + std::to_string(max_bytes) + " expected at most");
  }
  SP_ASSIGN_OR_RETURN(uint64_t offset, ZipEntryDataOffset(read, dir, entry, what));
  SP_ASSIGN_OR_RETURN(std::string data, ReadRange(read, offset, entry.size));
  uint32_t crc = Crc32(0, data.data(), data.size());
  if (entry.crc32 != 0 && crc != entry.crc32) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "CRC-32 0x%08x, expected 0x%08x", crc, entry.crc32);
    return Corrupt(what, "entry '" + entry.name + "' has " + buf);
  }
  return data;
}

}  // namespace sp::torch_save
