// Objects of DCP checkpoints are located when the checkpoint is opened and read on demand
// (dcp_objects.h); regressions for issue 13, defect 3 (zstd bombs in stored objects).
#include "shardpoint/format/torch_dcp/dcp_objects.h"

#include <gtest/gtest.h>

#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/store/memory_store.h"

namespace sp::torch_dcp {

using torch_save::EncodePlainObjectItem;
using torch_save::EncodePlainPickle;
using torch_save::PlainValue;

namespace {

void Put(Store& store, const std::string& path, const std::string& bytes) {
  Result<std::unique_ptr<WritableFile>> f = store.NewWritableFile(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->WriteAt(0, AsBytes(bytes)).ok());
  ASSERT_TRUE((*f)->Close().ok());
}

// A DCP checkpoint at "ck" whose one data file holds, in order: a plain item ("hello"), a zstd
// item (a dict), a corrupt zstd item, a zstd bomb (`bomb_bytes` zeros inside a torch.save
// archive's place: not an archive at all) and a zstd item of a 300,000-byte bytes object.
// `entries` maps each object name to the item it points at (several may share one).
class DcpObjects : public ::testing::Test {
 protected:
  struct Item {
    uint64_t offset, length;
    bool zstd;
  };

  void Build(const std::vector<std::pair<std::string, int>>& entries, uint64_t bomb_bytes = 8 << 20) {
    std::string data;
    auto add = [&](const std::string& bytes, bool zstd) {
      items_.push_back(Item{data.size(), bytes.size(), zstd});
      data += bytes;
    };
    Result<std::string> hello = EncodePlainObjectItem(PlainValue::String("hello"));
    Result<std::string> dict = EncodePlainObjectItem(
        PlainValue::Dict({{PlainValue::String("lr"), PlainValue::Float(0.5)}}));
    Result<std::string> blob = EncodePlainObjectItem(PlainValue::Bytes(std::string(300000, 'b')));
    ASSERT_TRUE(hello.ok() && dict.ok() && blob.ok());
    add(*hello, false);
    add(*EncodeZstdItem(AsBytes(*dict)), true);
    std::string corrupt = *EncodeZstdItem(AsBytes(*dict));
    corrupt[corrupt.size() / 2] ^= 0x5a;
    add(corrupt.substr(0, corrupt.size() - 4), true);
    add(*EncodeZstdItem(AsBytes(std::string(bomb_bytes, '\0'))), true);
    add(*EncodeZstdItem(AsBytes(*blob)), true);
    DcpMetadata md;
    for (const auto& [name, item] : entries) {
      DcpEntry e;
      e.fqn = name;
      e.kind = DcpEntry::Kind::kBytes;
      md.state_dict_metadata.push_back(e);
      DcpStorageEntry s;
      s.fqn = name;
      s.relative_path = "__0_0.distcp";
      s.offset = items_[item].offset;
      s.length = items_[item].length;
      if (items_[item].zstd) s.transform_descriptors = {kZstdTransformDescriptor};
      md.storage_data.push_back(s);
    }
    Result<std::string> pickled = EncodeDcpMetadata(md);
    ASSERT_TRUE(pickled.ok()) << pickled.status();
    ASSERT_TRUE(store_.CreateDirs("ck").ok());
    Put(store_, "ck/.metadata", *pickled);
    Put(store_, "ck/__0_0.distcp", data);
  }

  Result<CheckpointMetadata> Open() { return OpenCheckpointMetadata(store_, "ck", nullptr); }

  MemoryStore store_;
  std::vector<Item> items_;
};

enum { kHello, kDict, kCorrupt, kBomb, kBlob };

// Opening reads no object item: a corrupt item and a bomb shared by ten entries cost nothing
// until an object is read (before the fix, opening decoded every item: a corrupt one failed
// the open, and each entry of a shared bomb was decoded again, up to 1 GiB each).
TEST_F(DcpObjects, OpeningReadsNoObjectItem) {
  std::vector<std::pair<std::string, int>> entries = {{"a", kHello}, {"b", kDict}, {"broken", kCorrupt}};
  for (int i = 0; i < 10; ++i) entries.emplace_back("bomb" + std::to_string(i), kBomb);
  Build(entries);
  Result<CheckpointMetadata> md = Open();
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->objects.size(), 13u);
  for (const ObjectEntry& o : md->objects) {
    ASSERT_TRUE(o.stored.has_value()) << o.name;
    EXPECT_TRUE(o.payload.empty()) << o.name;
    EXPECT_EQ(o.encoding, ObjectEncoding::kTorchSave) << o.name;
  }
  const ObjectEntry* bomb = md->FindObject("bomb7");
  EXPECT_EQ(bomb->stored->offset, items_[kBomb].offset);
  EXPECT_EQ(bomb->size_bytes(), items_[kBomb].length);
  EXPECT_EQ(bomb->stored->driver_tag, kDcpItemZstd);
  EXPECT_EQ(md->FindObject("a")->stored->driver_tag, kDcpItemPlain);
  // The item location survives the coordinator's broadcast.
  Result<CheckpointMetadata> wired = DecodeMetadataFromWire(EncodeMetadataForWire(*md));
  ASSERT_TRUE(wired.ok()) << wired.status();
  EXPECT_EQ(*wired, *md);
}

TEST_F(DcpObjects, ReadsTheRequestedPayloads) {
  Build({{"a", kHello}, {"b", kDict}, {"broken", kCorrupt}, {"c", kDict}});
  Result<CheckpointMetadata> md = Open();
  ASSERT_TRUE(md.ok()) << md.status();
  std::vector<ObjectEntry> wanted = {*md->FindObject("a"), *md->FindObject("b"), *md->FindObject("c")};
  ASSERT_TRUE(ReadObjectPayloads(store_, "ck", *md, wanted).ok());
  EXPECT_EQ(wanted[0].encoding, ObjectEncoding::kPlain);
  EXPECT_EQ(wanted[0].payload, *EncodePlainPickle(PlainValue::String("hello")));
  EXPECT_EQ(wanted[1].encoding, ObjectEncoding::kPlain);
  EXPECT_EQ(wanted[1].payload,
            *EncodePlainPickle(PlainValue::Dict({{PlainValue::String("lr"), PlainValue::Float(0.5)}})));
  EXPECT_EQ(wanted[2], (ObjectEntry{"c", ObjectEncoding::kPlain, wanted[1].payload}));
  for (const ObjectEntry& o : wanted) EXPECT_FALSE(o.stored.has_value());
  // The damaged item fails only when it is read, naming the object, the file and the offset.
  std::vector<ObjectEntry> broken = {*md->FindObject("broken")};
  SP_EXPECT_ERROR(ReadObjectPayloads(store_, "ck", *md, broken), StatusCode::kDataLoss,
                  "zstd item object 'broken' (item of " + std::to_string(items_[kCorrupt].length) +
                      " bytes at offset " + std::to_string(items_[kCorrupt].offset) +
                      " of ck/__0_0.distcp)");
}

TEST_F(DcpObjects, ABombIsRefusedAtTheObjectLimit) {
  Build({{"bomb", kBomb}}, 3 << 20);
  Result<CheckpointMetadata> md = Open();
  ASSERT_TRUE(md.ok()) << md.status();
  SP_EXPECT_ERROR(ReadObjectPayloads(store_, "ck", *md, md->objects, ObjectReadLimits{1 << 20, 4 << 20}),
                  StatusCode::kResourceExhausted,
                  "zstd item object 'bomb' (item of " + std::to_string(items_[kBomb].length) +
                      " bytes at offset " + std::to_string(items_[kBomb].offset) +
                      " of ck/__0_0.distcp) decodes to more than 1048576 bytes");
  ASSERT_TRUE(ReadObjectPayloads(store_, "ck", *md, md->objects, ObjectReadLimits{4 << 20, 4 << 20}).ok());
  EXPECT_EQ(md->objects[0].payload, std::string(3 << 20, '\0'));  // not an archive: kept as is
  EXPECT_EQ(md->objects[0].encoding, ObjectEncoding::kTorchSave);
}

// Entries sharing an item decode it once, but each gets a copy: the copies count against the
// total, so ten entries of one item cannot hand out ten times the limit.
TEST_F(DcpObjects, SharedItemsCountOncePerEntryAgainstTheTotal) {
  std::vector<std::pair<std::string, int>> entries;
  for (int i = 0; i < 10; ++i) entries.emplace_back("blob" + std::to_string(i), kBlob);
  Build(entries);
  Result<CheckpointMetadata> md = Open();
  ASSERT_TRUE(md.ok()) << md.status();
  std::vector<ObjectEntry> five(md->objects.begin(), md->objects.begin() + 5);
  ASSERT_TRUE(ReadObjectPayloads(store_, "ck", *md, five, ObjectReadLimits{1 << 20, 2 << 20}).ok());
  const uint64_t each = five[0].payload.size();
  EXPECT_GT(each, 300000u);
  for (const ObjectEntry& o : five) EXPECT_EQ(o.payload, five[0].payload);
  SP_EXPECT_ERROR(ReadObjectPayloads(store_, "ck", *md, md->objects, ObjectReadLimits{1 << 20, 2 << 20}),
                  StatusCode::kResourceExhausted,
                  "object 'blob0' (item of " + std::to_string(items_[kBlob].length) + " bytes at offset " +
                      std::to_string(items_[kBlob].offset) + " of ck/__0_0.distcp): its " +
                      std::to_string(each) + " bytes for 10 object(s) would bring the objects read at once to " +
                      std::to_string(10 * each) + " bytes, more than the limit of 2097152");
}

}  // namespace
}  // namespace sp::torch_dcp
