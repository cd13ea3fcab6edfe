// Consolidation through a key mapping: fused targets streamed from multi-chunk stored tensors.
#include <gtest/gtest.h>

#include <cstring>

#include "shardpoint/manage/consolidate.h"
#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using testing::Iota;
using testing::SaveWhole;
using testing::WholeTensor;

const float* Floats(const WholeTensor& t) { return reinterpret_cast<const float*>(t.bytes.data()); }

class MappedConsolidateTest : public ::testing::Test {
 protected:
  // Two experts' w1 and w3 ([30, 600] each) and column blocks a [40, 300] and b [40, 500] per
  // expert, saved by 3 ranks (row slabs: 3 chunks per tensor) with 4 KiB checksum blocks, so
  // chunks, checksum blocks and output slabs all cut across each other.
  void SetUp() override {
    for (int e = 0; e < 2; ++e) {
      const std::string p = "experts." + std::to_string(e) + ".";
      tensors_.push_back(Iota(p + "w1", {30, 600}, 1e5f * static_cast<float>(4 * e)));
      tensors_.push_back(Iota(p + "w3", {30, 600}, 1e5f * static_cast<float>(4 * e + 1)));
      tensors_.push_back(Iota(p + "a", {40, 300}, 1e5f * static_cast<float>(4 * e + 2)));
      tensors_.push_back(Iota(p + "b", {40, 500}, 1e5f * static_cast<float>(4 * e + 3)));
    }
    tensors_.push_back(Iota("norm", {7}, -3));
    SaveOptions save;
    save.checksum_block_bytes = 4096;
    ASSERT_TRUE(SaveWhole(&store_, "/ckpt", tensors_, {}, /*ranks=*/3, save).ok());
    // gate_up [2, 60, 600] = stack(dim 0) of cat(dim 0) of w1, w3;
    // cols [40, 2, 800] = stack(dim 1) of cat(dim 1) of a, b.
    TensorPlacement gate_up{"gate_up", DType::kFloat32, {2, 60, 600}, {}};
    TensorPlacement cols{"cols", DType::kFloat32, {40, 2, 800}, {}};
    for (int64_t e = 0; e < 2; ++e) {
      const std::string p = "experts." + std::to_string(e) + ".";
      gate_up.sources.push_back({p + "w1", {e, 0, 0}, {1, 30, 600}});
      gate_up.sources.push_back({p + "w3", {e, 30, 0}, {1, 30, 600}});
      cols.sources.push_back({p + "a", {0, e, 0}, {40, 1, 300}});
      cols.sources.push_back({p + "b", {0, e, 300}, {40, 1, 500}});
    }
    options_.mapping.placements = {gate_up, cols};
    options_.mapping.renames = {{"norm", "final_norm"}};
    options_.store = &store_;
    options_.threads = 3;
    options_.memory_budget_bytes = 1;  // the smallest slabs: each target is cut many times
  }

  const WholeTensor& Get(const std::string& name) const {
    for (const WholeTensor& t : tensors_) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << name;
    return tensors_[0];
  }

  // The fused targets built element by element from their definitions.
  std::vector<float> GateUp() const {
    std::vector<float> out;
    for (const char* e : {"experts.0.", "experts.1."}) {
      for (const char* w : {"w1", "w3"}) {
        const WholeTensor& t = Get(std::string(e) + w);
        out.insert(out.end(), Floats(t), Floats(t) + 30 * 600);
      }
    }
    return out;
  }
  std::vector<float> Cols() const {
    std::vector<float> out(40 * 2 * 800);
    for (int64_t r = 0; r < 40; ++r) {
      for (int64_t e = 0; e < 2; ++e) {
        const std::string p = "experts." + std::to_string(e) + ".";
        for (int64_t c = 0; c < 800; ++c) {
          out[(r * 2 + e) * 800 + c] =
              c < 300 ? Floats(Get(p + "a"))[r * 300 + c] : Floats(Get(p + "b"))[r * 500 + c - 300];
        }
      }
    }
    return out;
  }

  MemoryStore store_;
  std::vector<WholeTensor> tensors_;
  ConsolidateOptions options_;
};

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST_F(MappedConsolidateTest, FusedTargetsFromMultiChunkSourcesAreBitExact) {
  CheckpointMetadata md = *ReadCheckpointMetadata("/ckpt", &store_);
  ASSERT_EQ(md.FindTensor("experts.1.w3")->chunks.size(), 3u);
  // Several checksum blocks a chunk: the reads verify blocks they cut through.
  ASSERT_GT(md.FindTensor("experts.1.w3")->chunks[0].byte_length, md.checksum_block_bytes);
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->tensors, 3u);
  EXPECT_EQ(result->total_bytes, (2 * 60 * 600 + 40 * 2 * 800 + 7) * 4u);
  const std::string file = *store_.ReadFile("/out/model.safetensors");
  Result<SafetensorsHeader> h = ParseSafetensorsHeader(file, file.size(), "out");
  ASSERT_TRUE(h.ok()) << h.status();
  std::map<std::string, std::pair<Shape, std::string>> got;
  for (const SafetensorsEntry& e : h->entries) {
    got[e.name] = {e.shape, file.substr(h->data_start + e.begin, e.end - e.begin)};
  }
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got.at("gate_up").first, (Shape{2, 60, 600}));
  EXPECT_TRUE(got.at("gate_up").second == Bytes(GateUp()));
  EXPECT_EQ(got.at("cols").first, (Shape{40, 2, 800}));
  EXPECT_TRUE(got.at("cols").second == Bytes(Cols()));
  const WholeTensor& norm = Get("norm");
  EXPECT_TRUE(got.at("final_norm").second ==
              std::string(reinterpret_cast<const char*>(norm.bytes.data()), norm.bytes.size()));
  // With slabs of whole tensors every stored byte is read once, straight from the source files;
  // the slab of cols also reads through expert 0's w1 and w3 rows, which lie between its sources
  // in each rank's file (gaps under kMaxGapBytes are read through to keep the reads sequential).
  options_.memory_budget_bytes = uint64_t{64} << 20;
  Result<ConsolidateResult> whole = Consolidate("/ckpt", "/out2", options_);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->bytes_read, whole->total_bytes + 2 * 30 * 600 * 4);
  EXPECT_TRUE(*store_.ReadFile("/out2/model.safetensors") == file);
}

TEST_F(MappedConsolidateTest, ChecksumsOfTheStoredChunksAreVerified) {
  CheckpointMetadata md = *ReadCheckpointMetadata("/ckpt", &store_);
  const StoredChunk& chunk = md.FindTensor("experts.1.b")->chunks[2];
  const DataFile& victim = md.files[chunk.file];
  {  // flip one byte in the last checksum block of the chunk
    std::string bytes = *store_.ReadFile(JoinPath("/ckpt", victim.name));
    bytes[victim.data_start + chunk.data_offset + chunk.byte_length - 3] ^= 1;
    auto out = store_.NewWritableFile(JoinPath("/ckpt", victim.name));
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
  }
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_EQ(result.status().code(), StatusCode::kDataLoss) << result.status();
  // The lifted chunk: rows 26..40 of expert 1's b, at columns 300..800 of cols.
  EXPECT_NE(result.status().message().find(
                "consolidating tensor 'cols' into model.safetensors: checksum mismatch in tensor "
                "'cols' chunk [26:40, 1:2, 300:800]"),
            std::string::npos)
      << result.status();
  EXPECT_FALSE(*store_.Exists("/out"));
}

TEST_F(MappedConsolidateTest, AMappingThatDoesNotTileFailsBeforeAnyOutput) {
  options_.mapping.placements[1].sources.pop_back();
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  EXPECT_EQ(
      result.status().ToString(),
      "INVALID_ARGUMENT: mapping the tensors of /ckpt: target 'cols' of shape [40, 2, 800]: its "
      "stored tensors ['experts.0.a', 'experts.0.b', 'experts.1.a'] cover 44000 of its 64000 "
      "elements");
  EXPECT_FALSE(*store_.Exists("/out"));
}

}  // namespace
}  // namespace sp
