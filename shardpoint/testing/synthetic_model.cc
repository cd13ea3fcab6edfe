#include "shardpoint/testing/synthetic_model.h"

#include <algorithm>
#include <cstring>

#include "shardpoint/geometry/strided_copy.h"

namespace sp::testing {
namespace {

MeshLayout Mesh2x2(Placement dp, Placement tp) { return MeshLayout{{2, 2}, {dp, tp}, {}}; }
MeshLayout Mesh3(Placement p) { return MeshLayout{{3}, {p}, {}}; }

// Adds a parameter and its two Adam moments.
void AddParam(std::vector<TensorSpec>& specs, const std::string& name, Shape shape,
              MeshLayout train, MeshLayout serve, MeshLayout transposed) {
  specs.push_back({"model." + name, DType::kBFloat16, shape, train, serve, transposed});
  for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
    specs.push_back({"optim.state." + name + moment, DType::kFloat32, shape, train, serve,
                     transposed});
  }
}

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

namespace {
// Bytes of state (bf16 weight + two fp32 moments: 10 bytes per parameter) of the parts of a model.
uint64_t FixedBytes(const ModelConfig& c) {
  return 10 * static_cast<uint64_t>(c.vocab * c.hidden + c.hidden);
}
uint64_t LayerBytes(const ModelConfig& c) {
  return 10 * static_cast<uint64_t>(4 * c.hidden * c.hidden + 3 * c.hidden * c.ffn + 2 * c.hidden);
}
}  // namespace

ModelConfig ConfigForBytes(uint64_t bytes) {
  ModelConfig config;
  // Small states: narrow the model (keeping the uneven sizes odd) until one layer fits.
  while (config.hidden > 16 && FixedBytes(config) + LayerBytes(config) > bytes) {
    config.hidden /= 2;
    config.ffn /= 2;
    config.vocab = config.vocab / 2 | 1;
  }
  if (config.hidden % 3 == 0) config.hidden += 2;
  const uint64_t fixed = FixedBytes(config), per_layer = LayerBytes(config);
  config.layers = 1;
  if (bytes > fixed) {
    config.layers = static_cast<int>(std::max<uint64_t>(1, (bytes - fixed + per_layer / 2) / per_layer));
  }
  return config;
}

std::vector<TensorSpec> ModelSpecs(const ModelConfig& c) {
  const Placement S0 = Placement::Shard(0), S1 = Placement::Shard(1), R = Placement::Replicate();
  std::vector<TensorSpec> specs;
  // Vocabulary-parallel embedding: rows split over all four ranks, then over three (uneven).
  AddParam(specs, "embed.weight", {c.vocab, c.hidden}, Mesh2x2(S0, S0), Mesh3(S0), Mesh3(S1));
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    // Column-parallel: tp splits the output rows, dp shards the rows again (FSDP on dim 0).
    for (const char* w : {"attn.wq", "attn.wk", "attn.wv"}) {
      AddParam(specs, p + w, {c.hidden, c.hidden}, Mesh2x2(S0, S0), Mesh3(S0), Mesh3(S1));
    }
    AddParam(specs, p + "mlp.w1", {c.ffn, c.hidden}, Mesh2x2(S0, S0), Mesh3(S0), Mesh3(S1));
    AddParam(specs, p + "mlp.w3", {c.ffn, c.hidden}, Mesh2x2(S0, S0), Mesh3(S0), Mesh3(S1));
    // Row-parallel: tp splits the input columns, dp shards the rows.
    AddParam(specs, p + "attn.wo", {c.hidden, c.hidden}, Mesh2x2(S0, S1), Mesh3(S1), Mesh3(S0));
    AddParam(specs, p + "mlp.w2", {c.hidden, c.ffn}, Mesh2x2(S0, S1), Mesh3(S1), Mesh3(S0));
    // Norms: replicated everywhere, or sharded by dp only; split in three (uneven) or replicated.
    AddParam(specs, p + "attn_norm.weight", {c.hidden}, Mesh2x2(R, R), Mesh3(S0), Mesh3(S0));
    AddParam(specs, p + "mlp_norm.weight", {c.hidden}, Mesh2x2(S0, R), Mesh3(R), Mesh3(R));
  }
  AddParam(specs, "final_norm.weight", {c.hidden}, Mesh2x2(R, R), Mesh3(R), Mesh3(R));
  return specs;
}

uint64_t GlobalModel::total_bytes() const {
  uint64_t total = 0;
  for (const AlignedBuffer& b : data) total += b.size();
  return total;
}

GlobalModel MakeGlobalModel(const ModelConfig& config, uint64_t seed) {
  GlobalModel model;
  model.specs = ModelSpecs(config);
  for (const TensorSpec& spec : model.specs) {
    const size_t bytes = static_cast<size_t>(ShapeVolume(spec.shape)) * DTypeSize(spec.dtype);
    AlignedBuffer buffer(bytes);
    uint64_t state = seed ^ std::hash<std::string>()(spec.name);
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      uint64_t v = SplitMix(state);
      std::memcpy(buffer.data() + i, &v, 8);
    }
    for (uint64_t v = SplitMix(state); i < bytes; ++i, v >>= 8) {
      buffer.data()[i] = static_cast<std::byte>(v & 0xFF);
    }
    model.data.push_back(std::move(buffer));
  }
  return model;
}

Result<std::vector<RankShards>> ShardModel(const GlobalModel& model, Which which, bool fill) {
  const int world = which == Which::kTrain ? 4 : which == Which::kWhole ? 1 : 3;
  auto boxes_of = [which](const TensorSpec& spec) -> Result<std::vector<Box>> {
    switch (which) {
      case Which::kTrain: return MeshChunksPerRank(spec.shape, spec.train);
      case Which::kServe: return MeshChunksPerRank(spec.shape, spec.serve);
      case Which::kTransposed: return MeshChunksPerRank(spec.shape, spec.transposed);
      case Which::kWhole: return std::vector<Box>{Box::Whole(spec.shape)};
    }
    return InternalError("unknown layout");
  };
  std::vector<RankShards> ranks(world);
  for (RankShards& r : ranks) {
    r.boxes.resize(model.specs.size());
    r.buffers.resize(model.specs.size());
  }
  for (size_t t = 0; t < model.specs.size(); ++t) {
    const TensorSpec& spec = model.specs[t];
    SP_ASSIGN_OR_RETURN(std::vector<Box> boxes, boxes_of(spec));
    const size_t es = DTypeSize(spec.dtype);
    ConstChunkView whole{model.data[t].data(), Box::Whole(spec.shape), es};
    for (int r = 0; r < world; ++r) {
      AlignedBuffer buffer(static_cast<size_t>(boxes[r].volume()) * es);
      if (fill && !boxes[r].empty()) {
        SP_RETURN_IF_ERROR(CopyRegion(whole, ChunkView{buffer.data(), boxes[r], es}, boxes[r]));
      } else if (buffer.size() > 0) {
        std::memset(buffer.data(), 0, buffer.size());
      }
      ranks[r].boxes[t].push_back(boxes[r]);
      ranks[r].buffers[t].push_back(std::move(buffer));
    }
  }
  return ranks;
}

SaveState RankShards::AsSaveState(const GlobalModel& model) const {
  SaveState state;
  for (size_t t = 0; t < model.specs.size(); ++t) {
    SaveTensor tensor{model.specs[t].name, model.specs[t].dtype, model.specs[t].shape, {}};
    for (size_t p = 0; p < boxes[t].size(); ++p) {
      tensor.pieces.push_back(ConstPieceView{boxes[t][p], buffers[t][p].data()});
    }
    state.tensors.push_back(std::move(tensor));
  }
  state.objects.push_back(ObjectEntry{"train.step", ObjectEncoding::kJson, "1200"});
  return state;
}

LoadState RankShards::AsLoadState(const GlobalModel& model) {
  LoadState state;
  for (size_t t = 0; t < model.specs.size(); ++t) {
    LoadTensor tensor{model.specs[t].name, model.specs[t].dtype, model.specs[t].shape, {}};
    for (size_t p = 0; p < boxes[t].size(); ++p) {
      tensor.pieces.push_back(PieceView{boxes[t][p], buffers[t][p].data()});
    }
    state.tensors.push_back(std::move(tensor));
  }
  state.objects.push_back("train.step");
  return state;
}

int64_t CountMismatches(const GlobalModel& model, const std::vector<RankShards>& ranks,
                        std::string* first_mismatch) {
  int64_t mismatches = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (size_t t = 0; t < model.specs.size(); ++t) {
      const TensorSpec& spec = model.specs[t];
      const size_t es = DTypeSize(spec.dtype);
      for (size_t p = 0; p < ranks[r].boxes[t].size(); ++p) {
        const Box& box = ranks[r].boxes[t][p];
        if (box.empty()) continue;
        AlignedBuffer expected(static_cast<size_t>(box.volume()) * es);
        Status s = CopyRegion(ConstChunkView{model.data[t].data(), Box::Whole(spec.shape), es},
                              ChunkView{expected.data(), box, es}, box);
        if (!s.ok() || std::memcmp(expected.data(), ranks[r].buffers[t][p].data(),
                                   expected.size()) != 0) {
          if (mismatches++ == 0 && first_mismatch != nullptr) {
            *first_mismatch = "rank " + std::to_string(r) + " tensor '" + spec.name + "' piece " +
                              box.ToString();
          }
        }
      }
    }
  }
  return mismatches;
}

}  // namespace sp::testing
