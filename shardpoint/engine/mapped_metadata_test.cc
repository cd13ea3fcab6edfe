#include "shardpoint/engine/mapped_metadata.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "shardpoint/geometry/strided_copy.h"

namespace sp {
namespace {

// A stored tensor of floats whose values are its own id times 1e6 plus the element's index, cut
// into chunks along random dims; its chunks' bytes lie in `file` at their data offsets.
struct Source {
  std::string name;
  Shape shape;
  std::vector<float> values;  // row-major
};

// Cuts `shape` into boxes along up to two random dims (several pieces each).
std::vector<Box> RandomChunks(const Shape& shape, std::mt19937& rng) {
  std::vector<Box> boxes{Box::Whole(shape)};
  for (int round = 0; round < 2 && !shape.empty(); ++round) {
    const size_t d = rng() % shape.size();
    std::vector<Box> out;
    for (const Box& b : boxes) {
      int64_t at = 0;
      while (at < b.sizes[d]) {
        const int64_t n = std::min<int64_t>(b.sizes[d] - at, 1 + static_cast<int64_t>(rng() % 3));
        Box piece = b;
        piece.offsets[d] += at;
        piece.sizes[d] = n;
        out.push_back(piece);
        at += n;
      }
    }
    boxes = std::move(out);
  }
  return boxes;
}

// Adds `s` to the metadata, chunked at random, its chunks' bytes appended to `file`.
void AddStored(const Source& s, std::mt19937& rng, CheckpointMetadata& md, std::string& file) {
  TensorMetadata t{s.name, DType::kFloat32, s.shape, {}};
  for (const Box& box : RandomChunks(s.shape, rng)) {
    std::string bytes(static_cast<size_t>(box.volume()) * 4, '\0');
    ConstChunkView whole{reinterpret_cast<const std::byte*>(s.values.data()), Box::Whole(s.shape),
                         4};
    EXPECT_TRUE(
        CopyRegion(whole, ChunkView{reinterpret_cast<std::byte*>(bytes.data()), box, 4}, box).ok());
    StoredChunk c;
    c.box = box;
    c.data_offset = file.size();
    c.byte_length = bytes.size();
    t.chunks.push_back(c);
    file += bytes;
  }
  md.tensors.push_back(std::move(t));
}

// Row-major index of `index` in `shape`.
int64_t Flat(const Shape& shape, const std::vector<int64_t>& index) {
  int64_t at = 0;
  for (size_t d = 0; d < shape.size(); ++d) at = at * shape[d] + index[d];
  return at;
}

// One random fused target: a stack (new dim `stack_dim`, `experts` entries, or no stack when 0)
// of a concatenation along `cat_dim` of parts of varying length; the reference is built element by
// element from the plain definition.
struct Case {
  std::vector<std::vector<Source>> parts;  // [expert][part]
  TensorPlacement placement;
  std::vector<float> reference;
};

Case RandomCase(std::mt19937& rng, int id) {
  Case c;
  const size_t rank = 1 + rng() % 3;
  Shape base(rank);
  for (int64_t& s : base) s = 1 + static_cast<int64_t>(rng() % 4);  // size-1 dims on purpose
  const size_t cat_dim = rng() % rank;
  const int experts = static_cast<int>(rng() % 4);  // 0: no stack
  const size_t stack_dim = rng() % (rank + 1);
  const int nparts = 1 + static_cast<int>(rng() % 3);
  std::vector<int64_t> lengths(nparts), starts(nparts);
  Shape cat = base;
  cat[cat_dim] = 0;
  for (int j = 0; j < nparts; ++j) {
    lengths[j] = 1 + static_cast<int64_t>(rng() % 3);
    starts[j] = cat[cat_dim];
    cat[cat_dim] += lengths[j];
  }
  Shape target = cat;
  if (experts > 0) target.insert(target.begin() + stack_dim, experts);
  c.placement = {"fused." + std::to_string(id), DType::kFloat32, target, {}};
  c.parts.resize(std::max(experts, 1));
  int serial = 0;
  for (size_t i = 0; i < c.parts.size(); ++i) {
    for (int j = 0; j < nparts; ++j) {
      Source s{
          "t" + std::to_string(id) + ".e" + std::to_string(i) + ".p" + std::to_string(j), base, {}};
      s.shape[cat_dim] = lengths[j];
      s.values.resize(static_cast<size_t>(ShapeVolume(s.shape)));
      ++serial;
      for (size_t k = 0; k < s.values.size(); ++k) {
        s.values[k] = static_cast<float>(id * 1000000 + serial * 1000 + static_cast<int>(k));
      }
      SourcePlacement p{s.name, std::vector<int64_t>(rank, 0), s.shape};
      p.offsets[cat_dim] = starts[j];
      if (experts > 0) {
        p.offsets.insert(p.offsets.begin() + stack_dim, static_cast<int64_t>(i));
        p.sizes.insert(p.sizes.begin() + stack_dim, 1);
      }
      c.placement.sources.push_back(p);
      c.parts[i].push_back(std::move(s));
    }
  }
  // The reference, from the definition: target[.., i, ..] = cat(parts of expert i).
  c.reference.resize(static_cast<size_t>(ShapeVolume(target)));
  std::vector<int64_t> index(target.size(), 0);
  for (float& out : c.reference) {
    std::vector<int64_t> u = index;
    size_t expert = 0;
    if (experts > 0) {
      expert = static_cast<size_t>(u[stack_dim]);
      u.erase(u.begin() + stack_dim);
    }
    int j = nparts - 1;
    while (u[cat_dim] < starts[j]) --j;
    u[cat_dim] -= starts[j];
    const Source& s = c.parts[expert][j];
    out = s.values[static_cast<size_t>(Flat(s.shape, u))];
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < target[d]) break;
      index[d] = 0;
    }
  }
  return c;
}

TEST(MappedMetadataTest, RandomStackAndCatLayoutsReadLikeThePlainDefinition) {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    CheckpointMetadata md;
    md.files.push_back({"data", 0, 0, 0});
    std::string file;
    std::vector<Case> cases;
    MetadataMapping mapping;
    for (int id = 0; id < 3; ++id) {
      cases.push_back(RandomCase(rng, id));
      for (const auto& expert : cases.back().parts) {
        for (const Source& s : expert) AddStored(s, rng, md, file);
      }
      mapping.placements.push_back(cases.back().placement);
    }
    // An unplaced tensor, renamed, and one kept under its own name.
    AddStored(Source{"plain.a", {2}, {1, 2}}, rng, md, file);
    AddStored(Source{"plain.b", {1}, {3}}, rng, md, file);
    mapping.renames["plain.a"] = "renamed.a";
    std::sort(md.tensors.begin(), md.tensors.end(),
              [](const TensorMetadata& a, const TensorMetadata& b) { return a.name < b.name; });
    std::shuffle(mapping.placements.begin(), mapping.placements.end(), rng);

    Result<CheckpointMetadata> mapped = MapCheckpointMetadata(md, mapping);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    std::vector<std::string> names;
    for (const TensorMetadata& t : mapped->tensors) names.push_back(t.name);
    EXPECT_EQ(names,
              (std::vector<std::string>{"fused.0", "fused.1", "fused.2", "plain.b", "renamed.a"}));
    EXPECT_EQ(mapped->FindTensor("renamed.a")->chunks, md.FindTensor("plain.a")->chunks);
    for (const Case& c : cases) {
      const TensorMetadata* t = mapped->FindTensor(c.placement.target);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->shape, c.placement.shape);
      // Every lifted chunk's bytes, copied into its box of the target, give the reference.
      std::vector<float> got(c.reference.size(), -1);
      ChunkView whole{reinterpret_cast<std::byte*>(got.data()), Box::Whole(t->shape), 4};
      int64_t covered = 0;
      for (const StoredChunk& chunk : t->chunks) {
        ASSERT_TRUE(WithinShape(chunk.box, t->shape)) << chunk.box.ToString();
        ASSERT_EQ(chunk.byte_length, static_cast<uint64_t>(chunk.box.volume()) * 4);
        ConstChunkView src{reinterpret_cast<const std::byte*>(file.data()) + chunk.data_offset,
                           chunk.box, 4};
        ASSERT_TRUE(CopyRegion(src, whole, chunk.box).ok());
        covered += chunk.box.volume();
      }
      EXPECT_EQ(covered, ShapeVolume(t->shape));
      EXPECT_EQ(got, c.reference) << "trial " << trial << " target " << t->name << " of shape "
                                  << ShapeToString(t->shape);
    }
  }
}

CheckpointMetadata TwoExperts() {
  CheckpointMetadata md;
  md.files.push_back({"data", 0, 0, 0});
  for (const char* name : {"e0.w1", "e0.w3", "e1.w1", "e1.w3"}) {
    StoredChunk chunk;
    chunk.box = Box({0, 0}, {2, 4});
    chunk.byte_length = 32;
    md.tensors.push_back({name, DType::kFloat32, {2, 4}, {chunk}});
  }
  StoredChunk chunk;
  chunk.box = Box({0}, {4});
  chunk.byte_length = 8;
  md.tensors.push_back({"norm", DType::kBFloat16, {4}, {chunk}});
  return md;
}

// Experts stacked on dim 0, w1 and w3 concatenated on dim 1 (after the stack): [2, 4, 4].
TensorPlacement GateUp() {
  TensorPlacement p{"gate_up", DType::kFloat32, {2, 4, 4}, {}};
  for (int64_t e = 0; e < 2; ++e) {
    for (int64_t k = 0; k < 2; ++k) {
      p.sources.push_back(
          {"e" + std::to_string(e) + (k ? ".w3" : ".w1"), {e, 2 * k, 0}, {1, 2, 4}});
    }
  }
  return p;
}

std::string MapError(const CheckpointMetadata& md, const MetadataMapping& mapping) {
  Result<CheckpointMetadata> r = MapCheckpointMetadata(md, mapping);
  return r.ok() ? "ok" : r.status().ToString();
}

TEST(MappedMetadataTest, LiftsChunkBoxesIntoTheTarget) {
  Result<CheckpointMetadata> mapped = MapCheckpointMetadata(TwoExperts(), {{GateUp()}, {}});
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  const TensorMetadata& t = *mapped->FindTensor("gate_up");
  ASSERT_EQ(t.chunks.size(), 4u);
  EXPECT_EQ(t.chunks[3].box, Box({1, 2, 0}, {1, 2, 4}));
  EXPECT_EQ(mapped->tensors.size(), 2u);  // gate_up and norm; the sources are used
  Result<Box> lifted = LiftChunkBox(Box({1, 0}, {1, 4}), {2, 4}, {"s", {3, 0, 2, 0}, {1, 2, 1, 4}});
  ASSERT_TRUE(lifted.ok()) << lifted.status();
  EXPECT_EQ(*lifted, Box({3, 1, 2, 0}, {1, 1, 1, 4}));
}

TEST(MappedMetadataTest, ErrorsNameTheTargetTheSourcesExpectedAndFound) {
  const CheckpointMetadata md = TwoExperts();
  TensorPlacement p = GateUp();
  p.sources[1].source = "e0.w2";
  EXPECT_EQ(MapError(md, {{p}, {}}),
            "NOT_FOUND: target 'gate_up' of shape [2, 4, 4]: stored tensor 'e0.w2' is missing from "
            "the checkpoint");
  p = GateUp();
  p.sources[1].sizes = {1, 4, 2};
  EXPECT_EQ(
      MapError(md, {{p}, {}}),
      "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4]: stored tensor 'e0.w3' has shape "
      "[2, 4], which does not give its placement's sizes [1, 4, 2] by inserting dims of size 1");
  p = GateUp();
  p.sources[2].offsets = {0, 2, 0};  // e1.w1 onto e0.w3
  EXPECT_EQ(MapError(md, {{p}, {}}),
            "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4]: stored tensors 'e0.w3' at "
            "[0:1, 2:4, 0:4] and 'e1.w1' at [0:1, 2:4, 0:4] overlap");
  p = GateUp();
  p.sources[3].offsets = {1, 3, 0};
  EXPECT_EQ(
      MapError(md, {{p}, {}}),
      "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4]: stored tensor 'e1.w3' placed at "
      "[1:2, 3:5, 0:4] lies outside it");
  p = GateUp();
  p.sources.pop_back();
  EXPECT_EQ(MapError(md, {{p}, {}}),
            "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4]: its stored tensors ['e0.w1', "
            "'e0.w3', 'e1.w1'] cover 24 of its 32 elements");
  p = GateUp();
  p.dtype = DType::kBFloat16;
  EXPECT_EQ(MapError(md, {{p}, {}}),
            "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4] has dtype bfloat16, stored "
            "tensor 'e0.w1' has dtype float32");
  p = GateUp();
  p.sources[0].offsets = {0, 0};
  EXPECT_EQ(
      MapError(md, {{p}, {}}),
      "INVALID_ARGUMENT: target 'gate_up' of shape [2, 4, 4]: stored tensor 'e0.w1' is placed "
      "with 2 offsets and 3 sizes, expected 3 of each");
  EXPECT_EQ(MapError(md, {{GateUp()}, {{"norm", "gate_up"}}}),
            "INVALID_ARGUMENT: both fused target 'gate_up' and stored tensor 'norm' (renamed) are "
            "named 'gate_up'");
  EXPECT_EQ(MapError(md, {{GateUp()}, {{"e0.w1", "x"}}}),
            "INVALID_ARGUMENT: stored tensor 'e0.w1' is renamed to 'x' but also placed in target "
            "'gate_up'");
  EXPECT_EQ(MapError(md, {{}, {{"lm_head", "x"}}}),
            "NOT_FOUND: stored tensor 'lm_head' renamed to 'x' is missing from the checkpoint");
}

}  // namespace
}  // namespace sp
