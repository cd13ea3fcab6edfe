// A synthetic transformer-like training state, laid out on in-process ranks.
//
// Used by `shardpoint demo`, the benchmarks and the end-to-end tests. The model has token
// embeddings with an uneven vocabulary, attention and MLP matrices, norms, and Adam moments for
// every parameter: bf16 parameters, fp32 optimizer state. Three layouts are defined:
//   - training, on a 2x2 (dp, tp) mesh: column-parallel matrices split on dim 0 by both mesh dims,
//     row-parallel ones split on dim 1 by tp and on dim 0 by dp (fully sharded), the embedding
//     split unevenly on all four ranks, norms replicated or sharded by dp only;
//   - serving, on 3 ranks (tensor parallel 3, as when training ends and inference starts):
//     the same tensor dims split three ways, unevenly, norms replicated or split;
//   - transposed, on 3 ranks: every matrix split along the OTHER dim, the worst case for
//     resharding (each stored chunk is needed in part by two ranks);
//   - whole, on 1 rank: every tensor whole, as consolidation or a single-process restart reads
//     the state.
// Global tensor contents are pseudo-random bytes, so every byte is checked on reload.
#ifndef SHARDPOINT_TESTING_SYNTHETIC_MODEL_H_
#define SHARDPOINT_TESTING_SYNTHETIC_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/layout/mesh_layout.h"

namespace sp::testing {

struct ModelConfig {
  int layers = 9;
  int64_t hidden = 448;   // not divisible by 3: uneven splits on 3 ranks
  int64_t ffn = 1152;
  int64_t vocab = 8191;  // not divisible by 2, 3 or 4: uneven shards
};

// A config whose state is about `bytes` (layers scaled; at least 1).
ModelConfig ConfigForBytes(uint64_t bytes);

struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  MeshLayout train;       // on the 2x2 mesh
  MeshLayout serve;       // on 3 ranks
  MeshLayout transposed;  // on 3 ranks
};

std::vector<TensorSpec> ModelSpecs(const ModelConfig& config);

// The whole model: one contiguous buffer per tensor, filled from `seed`.
struct GlobalModel {
  std::vector<TensorSpec> specs;
  std::vector<AlignedBuffer> data;  // row-major, one per spec
  uint64_t total_bytes() const;
};
GlobalModel MakeGlobalModel(const ModelConfig& config, uint64_t seed);

// One rank's shards: its own contiguous copy of each piece it holds.
struct RankShards {
  std::vector<std::vector<Box>> boxes;             // [tensor][piece]
  std::vector<std::vector<AlignedBuffer>> buffers;  // [tensor][piece]
  SaveState AsSaveState(const GlobalModel& model) const;
  LoadState AsLoadState(const GlobalModel& model);
};

enum class Which { kTrain, kServe, kTransposed, kWhole };

// The shards of every rank under one layout; with `fill`, copied from the model, else zeroed.
Result<std::vector<RankShards>> ShardModel(const GlobalModel& model, Which layout, bool fill);

// Compares every byte of every rank's shards with the model. Returns the number of mismatching
// tensors pieces and describes the first in *first_mismatch.
int64_t CountMismatches(const GlobalModel& model, const std::vector<RankShards>& ranks,
                        std::string* first_mismatch);

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_SYNTHETIC_MODEL_H_
