// The torch-dcp reader on hostile checkpoints: every size computed from the files is checked
// before it sizes a buffer or a copy (issue 13, defect 1).
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>

#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/store/memory_store.h"

namespace sp::torch_dcp {
namespace {

// 3 * 0x5555555555555556 wraps to 2 in 64 bits.
constexpr int64_t kWrapping = 0x5555555555555556;

TEST(DcpCheckpointTest, AStride0ItemIsDecodedIntoRowMajorBytes) {
  // The hostile case below, at a sane size: a [3, 4] view of 4 floats repeated along dim 0.
  MemoryStore store;
  WriteOneItemDcp(store, "/dcp", "w", {3, 4}, FloatTensorItem(4, {3, 4}, {0, 1}));
  Result<CheckpointMetadata> md = OpenCheckpointMetadata(store, "/dcp", nullptr);
  ASSERT_TRUE(md.ok()) << md.status();
  const TensorMetadata& t = md->tensors.at(0);
  const StoredChunk& c = t.chunks.at(0);
  ASSERT_EQ(c.encoding, ChunkEncoding::kDriverDecoded);
  EXPECT_EQ(c.byte_length, 48u);
  // Opening indexed its one chunk as a grid of one cell.
  ASSERT_TRUE(t.grid.has_value());
  EXPECT_EQ(t.grid->bounds, (std::vector<std::vector<int64_t>>{{0, 3}, {0, 4}}));
  std::string stored = store.ReadFile("/dcp/__0_0.distcp").value();
  float out[12];
  ASSERT_TRUE(DecodeStoredChunk(*md, t, c, AsBytes(stored), reinterpret_cast<std::byte*>(out)).ok());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out[i], static_cast<float>(i % 4)) << i;
}

TEST(DcpCheckpointTest, ASizeWhoseElementCountWrapsIsRefused) {
  MemoryStore store;
  WriteOneItemDcp(store, "/dcp", "w", {3, kWrapping}, FloatTensorItem(1, {3, kWrapping}, {0, 0}));
  SP_EXPECT_ERROR(OpenCheckpointMetadata(store, "/dcp", nullptr).status(), StatusCode::kDataLoss,
                  "DCP metadata /dcp/.metadata: key 'w' size: dimension 1 of shape [3, "
                  "6148914691236517206] is out of range [0, 2^62]");
}

TEST(DcpCheckpointTest, ADecodedViewThatDoesNotFillTheChunkIsRefused) {
  // Metadata built by hand (not through the reader's checks): a chunk of 8 bytes whose item
  // holds a view of 3 floats must not be copied into the 8-byte buffer.
  const std::string item = FloatTensorItem(1, {3}, {0});
  CheckpointMetadata md;
  md.format = CheckpointFormat::kTorchDcp;
  md.files.push_back(DataFile{"__0_0.distcp", 0, item.size(), 0});
  TensorMetadata t{"w", DType::kFloat32, {3}, {}};
  StoredChunk c;
  c.box = Box({0}, {3});
  c.byte_length = 8;
  c.encoding = ChunkEncoding::kDriverDecoded;
  c.driver_tag = kDcpItemPlain;
  c.stored_length = item.size();
  std::byte out[8];
  SP_EXPECT_ERROR(DecodeStoredChunk(md, t, c, AsBytes(item), out), StatusCode::kDataLoss,
                  "the item's view of shape [3] holds 12 bytes, the chunk 8");
}

}  // namespace
}  // namespace sp::torch_dcp
