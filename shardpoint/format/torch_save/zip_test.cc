#include "shardpoint/format/torch_save/zip.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "shardpoint/format/torch_save/test_util.h"

namespace sp::torch_save {
namespace {

TEST(Zip, BuildAndReadBack) {
  std::vector<std::pair<std::string, std::string>> entries = {
      {"a/data.pkl", "pickle"}, {"a/empty", ""}, {"a/data/0", std::string(1000, 'x')}};
  Result<std::string> zip = BuildZip(entries);
  ASSERT_TRUE(zip.ok()) << zip.status();
  RangeReader read = MemoryRangeReader(AsBytes(*zip));
  Result<ZipDirectory> dir = ReadZipDirectory(read, zip->size(), "mem");
  ASSERT_TRUE(dir.ok()) << dir.status();
  ASSERT_EQ(dir->entries.size(), 3u);
  for (const auto& [name, content] : entries) {
    const ZipEntry* e = dir->Find(name);
    ASSERT_NE(e, nullptr) << name;
    Result<uint64_t> offset = ZipEntryDataOffset(read, *dir, *e, "mem");
    ASSERT_TRUE(offset.ok()) << offset.status();
    EXPECT_EQ(*offset % 64, 0u) << name;
    Result<std::string> data = ReadZipEntry(read, *dir, *e, "mem", 1 << 20);
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_EQ(*data, content);
  }
}

// torch.save's archive of torch.arange(6, dtype=float32).reshape(2, 3): the layout this writer
// produces for the same records matches it byte for byte up to the serialization id record
// (which shardpoint does not write).
TEST(Zip, LayoutMatchesTorchSave) {
  std::string torch = TestData("tensor_f32.pt");
  RangeReader read = MemoryRangeReader(AsBytes(torch));
  Result<ZipDirectory> dir = ReadZipDirectory(read, torch.size(), "tensor_f32.pt");
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::vector<std::pair<std::string, std::string>> entries;
  for (const ZipEntry& e : dir->entries) {
    if (e.name.ends_with("serialization_id")) continue;
    Result<std::string> data = ReadZipEntry(read, *dir, e, "tensor_f32.pt", 1 << 20);
    ASSERT_TRUE(data.ok()) << data.status();
    entries.emplace_back(e.name, *data);
  }
  Result<std::string> ours = BuildZip(entries);
  ASSERT_TRUE(ours.ok());
  const ZipEntry* id = dir->Find("archive/.data/serialization_id");
  ASSERT_NE(id, nullptr);
  size_t common = id->local_header_offset;
  EXPECT_EQ(ours->substr(0, common), torch.substr(0, common));
}

// The offsets torch 2.13 wrote for torch.save({'a': uint8 tensor of 2^32 + 100 bytes,
// 'b': int32 tensor of 4}, 'big.pt'): zip64 sizes for the large entry, zip64 header offsets for
// everything after it, 24-byte data descriptors, 64-byte aligned data.
TEST(Zip, Zip64LayoutMatchesTorchSave) {
  uint64_t big = (uint64_t{1} << 32) + 100;
  Result<ZipLayout> layout = ZipLayout::Plan({{"big/data.pkl", 0xf7},
                                              {"big/.format_version", 1},
                                              {"big/.storage_alignment", 2},
                                              {"big/byteorder", 6},
                                              {"big/data/0", big},
                                              {"big/data/1", 16},
                                              {"big/version", 2},
                                              {"big/.data/serialization_id", 40}});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<uint64_t> headers = {0, 0x147, 0x191, 0x212, 0x296, 0x10000037c, 0x1000003e8, 0x10000045a};
  std::vector<uint64_t> data = {64, 384, 512, 640, 768, 4294968256, 4294968384, 4294968512};
  for (size_t i = 0; i < headers.size(); ++i) {
    EXPECT_EQ(layout->header_offset(i), headers[i]) << i;
    EXPECT_EQ(layout->data_offset(i), data[i]) << i;
  }
  EXPECT_EQ(layout->central_directory_offset(), 4294968576u);
  EXPECT_EQ(layout->total_size(), 4294969221u);
  // The large entry's local extra: zip64 (size, zero compressed size), then FB padding.
  std::string local = layout->LocalHeader(4);
  EXPECT_EQ(local.substr(30 + 10, 20),
            std::string("\x01\x00\x10\x00\x64\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 20));
  EXPECT_EQ(layout->DataDescriptor(4, 0x12345678).size(), 24u);
  EXPECT_EQ(layout->DataDescriptor(3, 0x12345678).size(), 16u);
}

// A virtual archive whose framing comes from ZipLayout and whose data bytes are all zero, so a
// 5 GiB entry needs no memory: the reader must find every entry where the layout put it.
TEST(Zip, ReadsZip64ArchivesWithoutReadingTheData) {
  uint64_t big = uint64_t{5} << 30;
  Result<ZipLayout> layout = ZipLayout::Plan({{"x/a", 10}, {"x/big", big}, {"x/after", 7}});
  ASSERT_TRUE(layout.ok());
  std::map<uint64_t, std::string> pieces;
  std::vector<uint32_t> crcs = {1, 2, 3};
  for (size_t i = 0; i < 3; ++i) {
    pieces[layout->header_offset(i)] = layout->LocalHeader(i);
    pieces[layout->data_end(i)] = layout->DataDescriptor(i, crcs[i]);
  }
  pieces[layout->central_directory_offset()] = layout->CentralDirectory(crcs);
  uint64_t bytes_read = 0;
  RangeReader read = [&](uint64_t offset, uint64_t n, std::byte* out) -> Status {
    bytes_read += n;
    if (offset + n > layout->total_size()) return DataLossError("past the end");
    std::memset(out, 0, n);
    for (const auto& [start, piece] : pieces) {
      uint64_t lo = std::max(start, offset), hi = std::min(start + piece.size(), offset + n);
      if (lo < hi) std::memcpy(out + (lo - offset), piece.data() + (lo - start), hi - lo);
    }
    return OkStatus();
  };
  Result<ZipDirectory> dir = ReadZipDirectory(read, layout->total_size(), "virtual");
  ASSERT_TRUE(dir.ok()) << dir.status();
  ASSERT_EQ(dir->entries.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(dir->entries[i].size, layout->size(i));
    EXPECT_EQ(dir->entries[i].crc32, crcs[i]);
    Result<uint64_t> offset = ZipEntryDataOffset(read, *dir, dir->entries[i], "virtual");
    ASSERT_TRUE(offset.ok()) << offset.status();
    EXPECT_EQ(*offset, layout->data_offset(i));
  }
  EXPECT_GT(dir->entries[2].local_header_offset, uint64_t{0xFFFFFFFF});
  EXPECT_LT(bytes_read, uint64_t{1} << 20);
}

TEST(Zip, RefusesCompressedEntriesByName) {
  Result<std::string> zip = BuildZip({{"archive/data.pkl", "abc"}});
  ASSERT_TRUE(zip.ok());
  std::string bytes = *zip;
  size_t cd = bytes.find("PK\x01\x02");
  ASSERT_NE(cd, std::string::npos);
  bytes[cd + 10] = 8;  // method: deflate
  RangeReader read = MemoryRangeReader(AsBytes(bytes));
  Result<ZipDirectory> dir = ReadZipDirectory(read, bytes.size(), "deflated.pt");
  ASSERT_TRUE(dir.ok()) << dir.status();
  SP_EXPECT_ERROR(ZipEntryDataOffset(read, *dir, dir->entries[0], "deflated.pt").status(),
                  StatusCode::kUnimplemented, "entry 'archive/data.pkl' is compressed (method 8)");
}

TEST(Zip, RefusesHostileDirectories) {
  Result<std::string> zip = BuildZip({{"archive/data.pkl", "abc"}, {"archive/version", "3\n"}});
  ASSERT_TRUE(zip.ok());
  const std::string& good = *zip;
  auto dir_of = [](const std::string& b) {
    return ReadZipDirectory(MemoryRangeReader(AsBytes(b)), b.size(), "hostile.pt").status();
  };
  // Every truncation of the archive fails cleanly.
  for (size_t n = 0; n < good.size(); ++n) EXPECT_FALSE(dir_of(good.substr(0, n)).ok()) << n;
  SP_EXPECT_ERROR(dir_of("short"), StatusCode::kDataLoss, "too short");
  // A central directory offset beyond the end records.
  std::string bad = good;
  size_t z64 = bad.find("PK\x06\x06");
  uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bad.data() + z64 + 48, &huge, 8);
  SP_EXPECT_ERROR(dir_of(bad), StatusCode::kDataLoss, "overlaps the end records");
  // An entry count that cannot fit in the central directory.
  bad = good;
  uint64_t count = uint64_t{1} << 30;
  std::memcpy(bad.data() + z64 + 32, &count, 8);
  SP_EXPECT_ERROR(dir_of(bad), StatusCode::kDataLoss, "entries cannot fit");
  // An entry whose data runs into the central directory.
  bad = good;
  size_t cd = bad.find("PK\x01\x02");
  uint32_t size = 1 << 20;
  std::memcpy(bad.data() + cd + 20, &size, 4);
  std::memcpy(bad.data() + cd + 24, &size, 4);
  RangeReader read = MemoryRangeReader(AsBytes(bad));
  Result<ZipDirectory> dir = ReadZipDirectory(read, bad.size(), "hostile.pt");
  ASSERT_TRUE(dir.ok());
  SP_EXPECT_ERROR(ZipEntryDataOffset(read, *dir, dir->entries[0], "hostile.pt").status(),
                  StatusCode::kDataLoss, "runs past the central directory");
  // A CRC mismatch in a small entry.
  bad = good;
  bad[bad.find("abc")] = 'X';
  read = MemoryRangeReader(AsBytes(bad));
  dir = ReadZipDirectory(read, bad.size(), "hostile.pt");
  ASSERT_TRUE(dir.ok());
  SP_EXPECT_ERROR(ReadZipEntry(read, *dir, dir->entries[0], "hostile.pt", 100).status(),
                  StatusCode::kDataLoss, "CRC-32");
}

TEST(ZipLayout, RefusesBadEntries) {
  SP_EXPECT_ERROR(ZipLayout::Plan({{"a", 1}, {"a", 2}}).status(), StatusCode::kInvalidArgument, "repeated");
  SP_EXPECT_ERROR(ZipLayout::Plan({{"", 1}}).status(), StatusCode::kInvalidArgument, "empty");
  SP_EXPECT_ERROR(ZipLayout::Plan({{"a", 1}}, 0).status(), StatusCode::kInvalidArgument, "alignment");
}

}  // namespace
}  // namespace sp::torch_save
