// End-to-end resharding: save a state laid out one way on N in-process ranks, load it laid out
// another way on M ranks, and compare every destination byte with a reference computed element
// by element from the global tensor.
//
// The randomized test runs SP_RESHARD_CASES cases (default 2000) from SP_RESHARD_SEED, starting
// at SP_RESHARD_FIRST_CASE; each case depends only on (seed, case index), so a failure printed as
// "seed S case C" is reproduced with SP_RESHARD_SEED=S SP_RESHARD_FIRST_CASE=C SP_RESHARD_CASES=1.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/geometry/convert.h"
#include "shardpoint/layout/mesh_layout.h"
#include "shardpoint/layout/pieces.h"
#include "shardpoint/layout/tensor_map.h"
#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/posix_store.h"

namespace sp {
namespace {

using Rng = std::mt19937_64;
using Bytes = std::vector<std::byte>;
// Per rank: the pieces of one tensor, all placed in that rank's one local buffer.
using Holdings = std::vector<std::vector<Piece>>;
// Per rank, per tensor: a local buffer with kGuard bytes on each side.
using RankBuffers = std::vector<std::vector<Bytes>>;

constexpr size_t kGuard = 16;  // keeps 16-byte element alignment after the leading guard
constexpr int64_t kMaxElements = int64_t{1} << 14;
constexpr uint64_t kDefaultSeed = 0x5eed2024ull;

int64_t Uniform(Rng& rng, int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool Chance(Rng& rng, double p) { return std::bernoulli_distribution(p)(rng); }
template <typename T>
const T& Pick(Rng& rng, const std::vector<T>& v) {
  return v[static_cast<size_t>(Uniform(rng, 0, static_cast<int64_t>(v.size()) - 1))];
}

int64_t EnvOr(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? fallback : std::strtoll(value, nullptr, 0);
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

struct Layout {
  Holdings ranks;
  std::string description;
  std::optional<MeshLayout> mesh;  // the rule the holdings follow, for a mesh layout
};

struct TensorCase {
  std::string name;
  DType dtype = DType::kFloat32;       // as saved
  DType load_dtype = DType::kFloat32;  // as loaded (different: cast on load)
  Shape shape;
  Bytes global;  // row-major, in `dtype`
  Layout save;
  Layout load;
};

struct ObjectCase {
  std::string name;
  std::vector<ObjectEntry> per_rank;  // [save rank]; empty name: the rank does not save it
};

struct Case {
  int save_ranks = 1;
  int load_ranks = 1;
  std::vector<TensorCase> tensors;
  std::vector<ObjectCase> objects;
  std::vector<std::vector<bool>> lists_on_save;  // [save rank][tensor]: in the SaveState
  std::vector<std::vector<bool>> lists_on_load;  // [load rank][tensor]: in the LoadState
  std::vector<std::vector<bool>> wants_object;   // [load rank][object]
  SaveOptions save_options;                      // comm, store and pool are filled in per rank
  LoadOptions load_options;
  uint64_t order_seed = 0;  // shuffles the order in which each rank lists its tensors
  bool one_order = false;   // every rank lists its tensors in the case's order (no shuffle)
  // The load's communicator reports its in-process ranks as separate processes of one machine
  // (Communicator::machine_ranks), each on a pool of its own.
  bool load_as_processes = false;
  // The load's communicator says its ranks do not share an address space, so shared reads send
  // their regions as bytes (payloads in rounds) rather than copy them into the destinations.
  bool load_in_separate_memory = false;
  // Every save rank of a tensor with a mesh layout saves it with its rule (SaveTensor::layout);
  // otherwise the case's seed picks which ranks do and which send the box.
  bool rules_everywhere = false;
  // Where set, each save rank's SaveStats (one per save rank).
  std::vector<SaveStats>* save_stats = nullptr;
};

// Forwards to a ThreadComm, but says its ranks are separate processes of one machine.
class OneMachineComm final : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::vector<int> machine_ranks() override {
    std::vector<int> all(static_cast<size_t>(size()));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  bool shares_memory() const override { return false; }
};

// Forwards to a ThreadComm, but says its ranks do not share an address space.
class SeparateMemoryComm final : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  bool shares_memory() const override { return false; }
};

// --- Layouts ---

Layout OneChunkPerRank(int n, const std::vector<std::optional<Box>>& boxes) {
  Layout out;
  out.ranks.resize(n);
  for (int r = 0; r < n; ++r) {
    if (boxes[r]) out.ranks[r].push_back(Piece{*boxes[r], 0});
  }
  return out;
}

// A mesh shape of `dims` dims whose volume is n (prime factors dealt out at random).
Shape RandomMeshShape(Rng& rng, int n, int dims) {
  Shape mesh(dims, 1);
  for (int p = 2; n > 1;) {
    if (n % p != 0) {
      ++p;
      continue;
    }
    mesh[Uniform(rng, 0, dims - 1)] *= p;
    n /= p;
  }
  return mesh;
}

std::vector<int64_t> MaybeShuffledRanks(Rng& rng, int n) {
  if (!Chance(rng, 0.25)) return {};
  std::vector<int64_t> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  std::shuffle(ranks.begin(), ranks.end(), rng);
  return ranks;
}

std::string RankListText(const std::vector<int64_t>& ranks) {
  return ranks.empty() ? "" : " rank_list " + ShapeToString(ranks);
}

Result<Layout> MeshCase(Rng& rng, const Shape& shape, int n) {
  MeshLayout layout;
  layout.mesh_shape = RandomMeshShape(rng, n, static_cast<int>(Uniform(rng, 1, 3)));
  std::vector<std::string> names;
  for (size_t m = 0; m < layout.mesh_shape.size(); ++m) {
    const bool shard = !shape.empty() && !Chance(rng, 0.3);
    layout.placements.push_back(
        shard ? Placement::Shard(static_cast<int>(Uniform(rng, 0, shape.size() - 1)))
              : Placement::Replicate());
    names.push_back(layout.placements.back().ToString());
  }
  layout.rank_list = MaybeShuffledRanks(rng, n);
  SP_ASSIGN_OR_RETURN(std::vector<Box> boxes, MeshChunksPerRank(shape, layout));
  std::vector<std::optional<Box>> per_rank(n);
  for (size_t i = 0; i < boxes.size(); ++i) {
    per_rank[layout.rank_list.empty() ? i : layout.rank_list[i]] = boxes[i];
  }
  Layout out = OneChunkPerRank(n, per_rank);
  out.mesh = layout;
  out.description = "mesh " + ShapeToString(layout.mesh_shape) + " (" + Join(names) + ")" +
                    RankListText(layout.rank_list);
  return out;
}

Result<Layout> TensorMapCase(Rng& rng, const Shape& shape, int n) {
  TensorMapLayout layout;
  layout.mesh_shape = RandomMeshShape(rng, n, static_cast<int>(Uniform(rng, 1, 3)));
  const int mesh_rank = static_cast<int>(layout.mesh_shape.size());
  layout.tensor_map.assign(shape.size(), {});
  for (int m = 0; m < mesh_rank; ++m) {  // m from the left; the map counts from the right
    if (shape.empty() || Chance(rng, 0.3)) continue;
    layout.tensor_map[Uniform(rng, 0, shape.size() - 1)].push_back(mesh_rank - 1 - m);
  }
  std::string map_text;
  for (std::vector<int>& dims : layout.tensor_map) {
    std::shuffle(dims.begin(), dims.end(), rng);
    if (dims.empty() && Chance(rng, 0.5)) dims.push_back(-1);
    map_text += ShapeToString(std::vector<int64_t>(dims.begin(), dims.end()));
  }
  for (int m = 0; m < mesh_rank; ++m) {
    if (Chance(rng, 0.3)) layout.uneven_mesh_dims.push_back(m);
  }
  layout.rank_list = MaybeShuffledRanks(rng, n);
  SP_ASSIGN_OR_RETURN(auto boxes, TensorMapChunksPerRank(shape, layout, n));
  Layout out = OneChunkPerRank(n, boxes);
  out.description = "tensor_map mesh " + ShapeToString(layout.mesh_shape) + " map " + map_text +
                    " uneven " + std::to_string(layout.uneven_mesh_dims.size()) +
                    RankListText(layout.rank_list);
  return out;
}

// Cuts `box` into at most `budget` boxes by random guillotine cuts.
void Tile(Rng& rng, const Box& box, int64_t budget, std::vector<Box>* out) {
  std::vector<size_t> cuttable;
  for (size_t d = 0; d < box.rank(); ++d) {
    if (box.sizes[d] >= 2) cuttable.push_back(d);
  }
  if (budget <= 1 || cuttable.empty() || Chance(rng, 0.2)) {
    out->push_back(box);
    return;
  }
  const size_t d = Pick(rng, cuttable);
  const int64_t cut = Uniform(rng, 1, box.sizes[d] - 1);
  Box low = box, high = box;
  low.sizes[d] = cut;
  high.offsets[d] += cut;
  high.sizes[d] -= cut;
  const int64_t low_budget = Uniform(rng, 1, budget - 1);
  Tile(rng, low, low_budget, out);
  Tile(rng, high, budget - low_budget, out);
}

// Explicit boxes: a random tiling, each tile held by random ranks (at least one on save: replicas
// are the same tile on several ranks), packed in random order with gaps into one buffer per rank.
Result<Layout> ExplicitCase(Rng& rng, const std::string& name, const Shape& shape, int n,
                            bool save) {
  std::vector<Box> tiles;
  Tile(rng, Box::Whole(shape), Uniform(rng, 1, 12), &tiles);
  SP_RETURN_IF_ERROR(ValidateBoxes(name, shape, tiles));
  std::vector<std::vector<Box>> held(n);
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  for (const Box& tile : tiles) {
    int64_t copies = Chance(rng, 0.3) ? Uniform(rng, save ? 1 : 0, n) : 1;
    std::shuffle(ranks.begin(), ranks.end(), rng);
    for (int64_t i = 0; i < copies; ++i) held[ranks[i]].push_back(tile);
  }
  Layout out;
  out.ranks.resize(n);
  for (int r = 0; r < n; ++r) {
    std::shuffle(held[r].begin(), held[r].end(), rng);
    int64_t offset = 0;
    for (const Box& box : held[r]) {
      offset += Uniform(rng, 0, 3);
      out.ranks[r].push_back(Piece{box, offset});
      offset += box.volume();
    }
  }
  out.description = "explicit " + std::to_string(tiles.size()) + " tiles";
  return out;
}

// Megatron: tensor parallel groups of `tp` ranks split one dim with torch.chunk; within each
// group's box, the dp ranks hold random contiguous flat ranges of its row-major flattening.
Result<Layout> FlatCase(Rng& rng, const Shape& shape, int n) {
  std::vector<int> divisors;
  for (int t = 1; t <= n; ++t) {
    if (n % t == 0) divisors.push_back(t);
  }
  const int tp = shape.empty() ? 1 : Pick(rng, divisors);
  const int dp = n / tp;
  std::vector<Box> tp_boxes(tp, Box::Whole(shape));
  const int dim = shape.empty() ? 0 : static_cast<int>(Uniform(rng, 0, shape.size() - 1));
  if (tp > 1) {
    SP_ASSIGN_OR_RETURN(tp_boxes,
                        MeshChunksPerRank(shape, MeshLayout{{tp}, {Placement::Shard(dim)}, {}}));
  }
  Layout out;
  out.ranks.resize(n);
  for (int t = 0; t < tp; ++t) {
    const int64_t volume = tp_boxes[t].volume();
    std::vector<int64_t> cuts = {0, volume};
    for (int q = 1; q < dp; ++q) cuts.push_back(Uniform(rng, 0, volume));
    std::sort(cuts.begin(), cuts.end());
    for (int q = 0; q < dp; ++q) {
      SP_ASSIGN_OR_RETURN(out.ranks[q * tp + t],
                          FlatRangePieces(shape, tp_boxes[t], cuts[q], cuts[q + 1]));
    }
  }
  out.description = "flat tp " + std::to_string(tp) + " on dim " + std::to_string(dim) + " dp " +
                    std::to_string(dp);
  return out;
}

Result<Layout> RandomLayout(Rng& rng, const std::string& name, const Shape& shape, int n,
                            bool save) {
  switch (Uniform(rng, 0, 3)) {
    case 0:
      return MeshCase(rng, shape, n);
    case 1:
      return TensorMapCase(rng, shape, n);
    case 2:
      return ExplicitCase(rng, name, shape, n, save);
    default:
      return FlatCase(rng, shape, n);
  }
}

// --- Tensors and cases ---

Shape RandomShape(Rng& rng) {
  static const std::vector<int64_t> kSizes = {1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100};
  Shape shape(Uniform(rng, 0, 4));
  for (int64_t& d : shape) d = Chance(rng, 0.04) ? 0 : Pick(rng, kSizes);
  while (ShapeVolume(shape) > kMaxElements) {
    *std::max_element(shape.begin(), shape.end()) /= 2;
  }
  return shape;
}

Bytes RandomBytes(Rng& rng, size_t size, DType dtype) {
  Bytes bytes(size);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xFF);
  if (dtype == DType::kBool) {
    for (std::byte& b : bytes) b &= std::byte{1};
  }
  return bytes;
}

bool IsComplex(DType d) { return d == DType::kComplex64 || d == DType::kComplex128; }

DType RandomLoadDType(Rng& rng, DType stored) {
  if (!Chance(rng, 0.1)) return stored;
  std::vector<DType> options;
  for (DType d : AllDTypes()) {
    if (d != stored && IsComplex(d) == IsComplex(stored) && CanConvert(stored, d)) {
      options.push_back(d);
    }
  }
  return options.empty() ? stored : Pick(rng, options);
}

Result<TensorCase> RandomTensor(Rng& rng, size_t index, int save_ranks, int load_ranks) {
  const std::vector<DType> dtypes(AllDTypes().begin(), AllDTypes().end());
  TensorCase t;
  t.name =
      std::string(1, static_cast<char>('a' + Uniform(rng, 0, 25))) + ".w" + std::to_string(index);
  t.dtype = Pick(rng, dtypes);
  t.load_dtype = RandomLoadDType(rng, t.dtype);
  t.shape = RandomShape(rng);
  t.global = RandomBytes(rng, ShapeVolume(t.shape) * DTypeSize(t.dtype), t.dtype);
  SP_ASSIGN_OR_RETURN(t.save, RandomLayout(rng, t.name, t.shape, save_ranks, true));
  SP_ASSIGN_OR_RETURN(t.load, RandomLayout(rng, t.name, t.shape, load_ranks, false));
  return t;
}

// 0-2 objects, each saved by a random non-empty set of ranks with rank-specific payloads.
std::vector<ObjectCase> RandomObjects(Rng& rng, int save_ranks) {
  std::vector<ObjectCase> objects(Uniform(rng, 0, 2));
  for (size_t k = 0; k < objects.size(); ++k) {
    ObjectCase& o = objects[k];
    o.name = "obj." + std::to_string(k);
    o.per_rank.resize(save_ranks);
    const int64_t always = Uniform(rng, 0, save_ranks - 1);
    for (int r = 0; r < save_ranks; ++r) {
      if (r != always && Chance(rng, 0.5)) continue;
      const bool json = Chance(rng, 0.7);
      o.per_rank[r] = ObjectEntry{o.name, json ? ObjectEncoding::kJson : ObjectEncoding::kBytes,
                                  json ? "{\"rank\": " + std::to_string(r) + "}"
                                       : std::string("\0\xff", 2) + std::to_string(r)};
    }
  }
  return objects;
}

void RandomOptions(Rng& rng, Case* c) {
  static const std::vector<uint64_t> kBlocks = {
      64, 96, 100, 256, 1000, 4096, kDefaultChecksumBlockBytes};
  static const std::vector<uint64_t> kBudgets = {1, 4096, 65536, uint64_t{1} << 20,
                                                 uint64_t{256} << 20};
  c->save_options.files_per_rank = static_cast<int>(Uniform(rng, 1, 3));
  c->save_options.dedup_to_lowest_rank = Chance(rng, 0.5);
  c->save_options.checksum_block_bytes = Pick(rng, kBlocks);
  c->save_options.coordinator = static_cast<int>(Uniform(rng, 0, c->save_ranks - 1));
  c->load_options.memory_budget_bytes = Pick(rng, kBudgets);
  c->load_options.verify_checksums = Chance(rng, 0.9);
  c->load_options.strict = Chance(rng, 0.5);
  c->load_options.coordinator = static_cast<int>(Uniform(rng, 0, c->load_ranks - 1));
  c->load_options.allow_cast = Chance(rng, 0.2);
  for (const TensorCase& t : c->tensors) {
    if (t.dtype != t.load_dtype) c->load_options.allow_cast = true;
  }
}

bool HoldsAny(const std::vector<Piece>& pieces) {
  for (const Piece& p : pieces) {
    if (!p.box.empty()) return true;
  }
  return false;
}

// A rank may leave out a tensor it holds nothing of: on save only when the tensor has elements
// (so that other ranks list it), on load always. A load rank wants each object or not.
void RandomListing(Rng& rng, Case* c) {
  c->lists_on_save.assign(c->save_ranks, std::vector<bool>(c->tensors.size(), true));
  c->lists_on_load.assign(c->load_ranks, std::vector<bool>(c->tensors.size(), true));
  c->wants_object.assign(c->load_ranks, std::vector<bool>(c->objects.size(), true));
  for (size_t t = 0; t < c->tensors.size(); ++t) {
    const TensorCase& tensor = c->tensors[t];
    for (int r = 0; r < c->save_ranks; ++r) {
      if (!HoldsAny(tensor.save.ranks[r]) && ShapeVolume(tensor.shape) > 0 && Chance(rng, 0.5)) {
        c->lists_on_save[r][t] = false;
      }
    }
    for (int r = 0; r < c->load_ranks; ++r) {
      if (!HoldsAny(tensor.load.ranks[r]) && Chance(rng, 0.5)) c->lists_on_load[r][t] = false;
    }
  }
  for (int r = 0; r < c->load_ranks; ++r) {
    for (size_t o = 0; o < c->objects.size(); ++o) c->wants_object[r][o] = Chance(rng, 0.75);
  }
}

Result<Case> RandomCase(uint64_t seed, int64_t index) {
  Rng rng(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index + 1)));
  Case c;
  c.save_ranks = static_cast<int>(Uniform(rng, 1, 8));
  c.load_ranks = static_cast<int>(Uniform(rng, 1, 8));
  const int64_t num_tensors = Uniform(rng, 1, 6);
  for (int64_t i = 0; i < num_tensors; ++i) {
    SP_ASSIGN_OR_RETURN(TensorCase t, RandomTensor(rng, i, c.save_ranks, c.load_ranks));
    c.tensors.push_back(std::move(t));
  }
  c.objects = RandomObjects(rng, c.save_ranks);
  RandomOptions(rng, &c);
  RandomListing(rng, &c);
  c.order_seed = rng();
  return c;
}

std::string Describe(const Case& c) {
  std::string out = "save " + std::to_string(c.save_ranks) + " ranks (files_per_rank " +
                    std::to_string(c.save_options.files_per_rank) + ", dedup_to_lowest_rank " +
                    std::to_string(c.save_options.dedup_to_lowest_rank) + ", block " +
                    std::to_string(c.save_options.checksum_block_bytes) + "), load " +
                    std::to_string(c.load_ranks) + " ranks (budget " +
                    std::to_string(c.load_options.memory_budget_bytes) + ", verify " +
                    std::to_string(c.load_options.verify_checksums) + ")";
  for (const TensorCase& t : c.tensors) {
    out += "\n  '" + t.name + "' " + std::string(DTypeName(t.dtype)) + "->" +
           std::string(DTypeName(t.load_dtype)) + " " + ShapeToString(t.shape) + ": save " +
           t.save.description + "; load " + t.load.description;
  }
  return out;
}

// --- Buffers and the reference ---

int64_t BufferElements(const std::vector<Piece>& pieces) {
  int64_t end = 0;
  for (const Piece& p : pieces) end = std::max(end, p.element_offset + p.box.volume());
  return end;
}

// Writes the elements of piece.box of the global tensor (dtype `from`), converted to `to`,
// row-major at piece.element_offset of `local`: one element at a time, from its coordinates.
Status PlaceFromGlobal(const TensorCase& t, const Piece& piece, DType to, std::byte* local) {
  const size_t from_size = DTypeSize(t.dtype), to_size = DTypeSize(to);
  const size_t n = t.shape.size();
  std::vector<int64_t> index(n, 0);  // position inside piece.box
  const int64_t count = piece.box.volume();
  for (int64_t k = 0; k < count; ++k) {
    int64_t flat = 0;
    for (size_t d = 0; d < n; ++d) flat = flat * t.shape[d] + piece.box.offsets[d] + index[d];
    const std::byte* src = t.global.data() + flat * from_size;
    std::byte* dst = local + (piece.element_offset + k) * to_size;
    if (t.dtype == to) {
      std::memcpy(dst, src, to_size);
    } else {
      SP_RETURN_IF_ERROR(ConvertElements(t.dtype, src, to, dst, 1));
    }
    for (size_t d = n; d-- > 0;) {
      if (++index[d] < piece.box.sizes[d]) break;
      index[d] = 0;
    }
  }
  return OkStatus();
}

// Buffers of random bytes (the guards and gaps), with the save pieces filled in.
Result<RankBuffers> MakeBuffers(const Case& c, bool save, Rng& rng) {
  const int n = save ? c.save_ranks : c.load_ranks;
  RankBuffers buffers(n);
  for (int r = 0; r < n; ++r) {
    for (const TensorCase& t : c.tensors) {
      const std::vector<Piece>& pieces = (save ? t.save : t.load).ranks[r];
      const DType dtype = save ? t.dtype : t.load_dtype;
      Bytes bytes =
          RandomBytes(rng, 2 * kGuard + BufferElements(pieces) * DTypeSize(dtype), DType::kUInt8);
      for (const Piece& p : pieces) {
        if (save) SP_RETURN_IF_ERROR(PlaceFromGlobal(t, p, dtype, bytes.data() + kGuard));
      }
      buffers[r].push_back(std::move(bytes));
    }
  }
  return buffers;
}

// Names where `actual` first differs from `expected` in a buffer holding `pieces`.
std::string DescribeMismatch(const Bytes& actual, const Bytes& expected,
                             const std::vector<Piece>& pieces, size_t element_size) {
  size_t at = 0;
  while (at < actual.size() && actual[at] == expected[at]) ++at;
  if (at < kGuard || at >= actual.size() - kGuard) return "guard byte " + std::to_string(at);
  const int64_t element = static_cast<int64_t>((at - kGuard) / element_size);
  for (const Piece& p : pieces) {
    int64_t k = element - p.element_offset;
    if (k < 0 || k >= p.box.volume()) continue;
    std::vector<int64_t> coordinate(p.box.rank());
    for (size_t d = p.box.rank(); d-- > 0; k /= p.box.sizes[d]) {
      coordinate[d] = p.box.offsets[d] + k % p.box.sizes[d];
    }
    return "piece " + p.box.ToString() + " element at " + ShapeToString(coordinate);
  }
  return "gap element " + std::to_string(element) + " (outside every piece) was overwritten";
}

// Every loaded buffer equals its initial bytes with the reference written into its pieces.
void ExpectLoaded(const Case& c, const RankBuffers& initial, const RankBuffers& loaded) {
  for (int r = 0; r < c.load_ranks; ++r) {
    for (size_t i = 0; i < c.tensors.size(); ++i) {
      const TensorCase& t = c.tensors[i];
      Bytes expected = initial[r][i];
      if (c.lists_on_load[r][i]) {
        for (const Piece& p : t.load.ranks[r]) {
          ASSERT_TRUE(PlaceFromGlobal(t, p, t.load_dtype, expected.data() + kGuard).ok());
        }
      }
      if (loaded[r][i] != expected) {
        ADD_FAILURE() << "rank " << r << " tensor '" << t.name << "': "
                      << DescribeMismatch(loaded[r][i], expected, t.load.ranks[r],
                                          DTypeSize(t.load_dtype));
        return;
      }
    }
  }
}

// --- Running a case ---

std::vector<size_t> RankOrder(const Case& c, int rank) {
  std::vector<size_t> order(c.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  if (c.one_order) return order;
  Rng rng(c.order_seed + static_cast<uint64_t>(rank));
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

Status FirstError(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) return statuses[r].WithContext("rank " + std::to_string(r));
  }
  return OkStatus();
}

SaveState SaveStateOf(const Case& c, int r, const RankBuffers& buffers) {
  SaveState state;
  for (size_t i : RankOrder(c, r)) {
    if (!c.lists_on_save[r][i]) continue;
    const TensorCase& t = c.tensors[i];
    SaveTensor tensor{t.name, t.dtype, t.shape};
    // A tensor of a mesh layout is saved with its rule by some ranks and with its box by the
    // others (SaveTensor::layout), chosen by the case's seed.
    if (t.save.mesh && (c.rules_everywhere || ((c.order_seed >> ((7 * i + r) % 64)) & 1))) {
      tensor.layout = t.save.mesh;
    }
    for (const Piece& p : t.save.ranks[r]) {
      tensor.pieces.push_back(ConstPieceView{
          p.box, buffers[r][i].data() + kGuard + p.element_offset * DTypeSize(t.dtype)});
    }
    state.tensors.push_back(std::move(tensor));
  }
  for (const ObjectCase& o : c.objects) {
    if (!o.per_rank[r].name.empty()) state.objects.push_back(o.per_rank[r]);
  }
  return state;
}

Status SaveCase(const Case& c, const RankBuffers& buffers, Store& store, ThreadPool* pool,
                const std::string& path) {
  return FirstError(RunRanks(c.save_ranks, [&](Communicator& comm) {
    SaveOptions options = c.save_options;
    options.comm = &comm;
    options.store = &store;
    options.pool = pool;
    options.threads = pool == nullptr ? 1 + comm.rank() % 2 : 0;
    if (c.save_stats != nullptr) options.stats = &(*c.save_stats)[comm.rank()];
    return Save(SaveStateOf(c, comm.rank(), buffers), path, options);
  }));
}

LoadState LoadStateOf(const Case& c, int r, RankBuffers& buffers) {
  LoadState state;
  for (size_t i : RankOrder(c, r)) {
    if (!c.lists_on_load[r][i]) continue;
    const TensorCase& t = c.tensors[i];
    LoadTensor tensor{t.name, t.load_dtype, t.shape, {}};
    for (const Piece& p : t.load.ranks[r]) {
      tensor.pieces.push_back(PieceView{
          p.box, buffers[r][i].data() + kGuard + p.element_offset * DTypeSize(t.load_dtype)});
    }
    state.tensors.push_back(std::move(tensor));
  }
  for (size_t o = 0; o < c.objects.size(); ++o) {
    if (c.wants_object[r][o]) state.objects.push_back(c.objects[o].name);
  }
  return state;
}

// Loads on every rank; each rank's status, and its result in *results where it succeeded.
std::vector<Status> LoadEveryRank(const Case& c, RankBuffers& buffers, Store& store,
                                  ThreadPool* pool, const std::string& path,
                                  std::vector<LoadResult>* results) {
  results->assign(c.load_ranks, LoadResult{});
  return RunRanks(c.load_ranks, [&](Communicator& base) -> Status {
    OneMachineComm one_machine(base);
    SeparateMemoryComm separate(base);
    Communicator& comm = c.load_as_processes         ? static_cast<Communicator&>(one_machine)
                         : c.load_in_separate_memory ? static_cast<Communicator&>(separate)
                                                     : base;
    LoadOptions options = c.load_options;
    options.comm = &comm;
    options.store = &store;
    options.pool = c.load_as_processes ? nullptr : pool;
    options.threads = options.pool == nullptr ? 1 + comm.rank() % 2 : 0;
    SP_ASSIGN_OR_RETURN((*results)[comm.rank()],
                        Load(LoadStateOf(c, comm.rank(), buffers), path, options));
    return OkStatus();
  });
}

Result<std::vector<LoadResult>> LoadCase(const Case& c, RankBuffers& buffers, Store& store,
                                         ThreadPool* pool, const std::string& path) {
  std::vector<LoadResult> results;
  SP_RETURN_IF_ERROR(FirstError(LoadEveryRank(c, buffers, store, pool, path, &results)));
  return results;
}

// The keys, objects and (for the lowest saver) payloads each load rank must report.
void ExpectResults(const Case& c, const std::vector<LoadResult>& results) {
  for (int r = 0; r < c.load_ranks; ++r) {
    std::vector<std::string> unexpected;
    std::vector<ObjectEntry> objects;
    for (size_t i = 0; i < c.tensors.size(); ++i) {
      if (!c.lists_on_load[r][i]) unexpected.push_back(c.tensors[i].name);
    }
    for (size_t o = 0; o < c.objects.size(); ++o) {
      if (!c.wants_object[r][o]) {
        unexpected.push_back(c.objects[o].name);
        continue;
      }
      for (const ObjectEntry& e : c.objects[o].per_rank) {
        if (e.name.empty()) continue;
        objects.push_back(e);  // the lowest rank that saved it
        break;
      }
    }
    std::sort(unexpected.begin(), unexpected.end());
    EXPECT_TRUE(results[r].missing_keys.empty()) << "rank " << r;
    EXPECT_EQ(results[r].unexpected_keys, unexpected) << "rank " << r;
    ASSERT_EQ(results[r].objects.size(), objects.size()) << "rank " << r;
    for (size_t k = 0; k < objects.size(); ++k) {
      EXPECT_EQ(results[r].objects[k].name, objects[k].name) << "rank " << r;
      EXPECT_EQ(results[r].objects[k].encoding, objects[k].encoding) << "rank " << r;
      EXPECT_EQ(results[r].objects[k].payload, objects[k].payload) << "rank " << r;
    }
  }
}

// The stored chunks are the distinct non-empty save boxes, each written once by one of its
// holders (the lowest with dedup_to_lowest_rank), with one checksum per block.
void ExpectMetadata(const Case& c, const CheckpointMetadata& md) {
  EXPECT_EQ(md.world_size, c.save_ranks);
  EXPECT_EQ(md.checksum_block_bytes, c.save_options.checksum_block_bytes);
  ASSERT_EQ(md.tensors.size(), c.tensors.size());
  for (const TensorCase& t : c.tensors) {
    const TensorMetadata* stored = md.FindTensor(t.name);
    ASSERT_NE(stored, nullptr) << t.name;
    EXPECT_EQ(stored->dtype, t.dtype);
    EXPECT_EQ(stored->shape, t.shape);
    std::map<Box, std::vector<int>> holders;
    for (int r = 0; r < c.save_ranks; ++r) {
      for (const Piece& p : t.save.ranks[r]) {
        if (!p.box.empty()) holders[p.box].push_back(r);
      }
    }
    ASSERT_EQ(stored->chunks.size(), holders.size()) << t.name;
    const uint64_t bs = c.save_options.checksum_block_bytes;
    for (const StoredChunk& chunk : stored->chunks) {
      auto it = holders.find(chunk.box);
      ASSERT_NE(it, holders.end()) << t.name << " " << chunk.box.ToString();
      const int writer = md.files.at(chunk.file).writer_rank;
      EXPECT_TRUE(std::count(it->second.begin(), it->second.end(), writer)) << t.name;
      if (c.save_options.dedup_to_lowest_rank) {
        EXPECT_EQ(writer, it->second.front());
      }
      // Format 4: the checksums are in the data files' headers (ExpectHeadersOfMetadata).
      EXPECT_EQ(chunk.block_crc32c.size(),
                md.checksums_in_headers ? 0 : (chunk.byte_length + bs - 1) / bs);
    }
  }
}

// The ranks built their native files' headers themselves (CheckpointWriter::ranks_build_headers):
// each file holds, byte for byte, the header the committed metadata implies, with its chunks'
// checksums (docs/FORMAT.md §2.2: the CRC32C of each block of the chunk's bytes in the file, and
// the metadata's where it holds them too) and the CRC the metadata records, and is as long as the
// metadata says.
void ExpectHeadersOfMetadata(Store& store, const std::string& path, const CheckpointMetadata& md) {
  if (md.format != CheckpointFormat::kNative) return;
  ASSERT_TRUE(md.data_file_checksums);
  std::vector<std::string> headers = BuildDataFileHeaders(md);
  std::vector<std::vector<std::pair<std::pair<uint64_t, uint64_t>, const StoredChunk*>>> chunks(
      md.files.size());
  for (const TensorMetadata& t : md.tensors) {
    for (const StoredChunk& c : t.chunks) {
      chunks.at(c.file).push_back({{c.data_offset, c.data_offset + c.byte_length}, &c});
    }
  }
  const uint64_t bs = md.checksum_block_bytes;
  for (size_t f = 0; f < md.files.size(); ++f) {
    Result<std::unique_ptr<ReadableFile>> file = store.OpenReadable(path + "/" + md.files[f].name);
    ASSERT_TRUE(file.ok()) << file.status();
    std::stable_sort(chunks[f].begin(), chunks[f].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<uint32_t> crcs;
    for (const auto& [extent, c] : chunks[f]) {
      std::string bytes(c->byte_length, '\0');
      ASSERT_TRUE((*file)->ReadAt(md.files[f].data_start + c->data_offset,
                                  AsMutableBytes(bytes.data(), bytes.size())).ok());
      std::vector<uint32_t> own;
      for (uint64_t lo = 0; lo < bytes.size(); lo += bs) {
        own.push_back(Crc32c(std::string_view(bytes).substr(lo, bs)));
      }
      if (!md.checksums_in_headers) {
        EXPECT_EQ(own, std::vector<uint32_t>(c->block_crc32c.begin(), c->block_crc32c.end()));
      }
      crcs.insert(crcs.end(), own.begin(), own.end());
    }
    ASSERT_TRUE(FillDataFileChecksums(&headers[f], crcs).ok()) << md.files[f].name;
    EXPECT_EQ(Crc32c(headers[f]), md.files[f].header_crc32c) << md.files[f].name;
  }
  for (size_t f = 0; f < md.files.size(); ++f) {
    Result<std::unique_ptr<ReadableFile>> file = store.OpenReadable(path + "/" + md.files[f].name);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->size(), md.files[f].size) << md.files[f].name;
    ASSERT_EQ(md.files[f].data_start, headers[f].size()) << md.files[f].name;
    std::string header(headers[f].size(), '\0');
    ASSERT_TRUE((*file)->ReadAt(0, AsMutableBytes(header.data(), header.size())).ok());
    EXPECT_EQ(header, headers[f]) << md.files[f].name;
  }
}

// How many stored chunks each load rank's copy of `md` held (LoadResult::metadata_chunks): every
// chunk where the ranks share one decoded copy, on rank 0, on the coordinator (which opened it)
// and with own_chunks_only off; otherwise exactly those its boxes reach (a box of the tensor's rank, not
// empty, inside its shape, sharing a point with the chunk), none of a tensor it does not list.
void ExpectMetadataParts(const Case& c, const CheckpointMetadata& md,
                         const std::vector<LoadResult>& results) {
  uint64_t all = 0;
  for (const TensorMetadata& t : md.tensors) all += t.chunks.size();
  const bool shared_copy = !c.load_as_processes && !c.load_in_separate_memory;
  for (int r = 0; r < c.load_ranks; ++r) {
    uint64_t expected = all;
    if (!shared_copy && r != 0 && r != c.load_options.coordinator &&
        c.load_options.own_chunks_only) {
      expected = 0;
      for (size_t i = 0; i < c.tensors.size(); ++i) {
        if (!c.lists_on_load[r][i]) continue;
        const TensorMetadata* stored = md.FindTensor(c.tensors[i].name);
        for (const StoredChunk& chunk : stored->chunks) {
          for (const Piece& p : c.tensors[i].load.ranks[r]) {
            if (!p.box.empty() && Intersect(p.box, chunk.box).has_value()) {
              ++expected;
              break;
            }
          }
        }
      }
    }
    EXPECT_EQ(results[r].metadata_chunks, expected) << "load rank " << r;
  }
}

void RunCase(const Case& c, Store& store, ThreadPool* pool, const std::string& path, bool verify,
             Rng& rng) {
  Result<RankBuffers> save_buffers = MakeBuffers(c, true, rng);
  ASSERT_TRUE(save_buffers.ok()) << save_buffers.status();
  const RankBuffers before_save = *save_buffers;
  Status saved = SaveCase(c, *save_buffers, store, pool, path);
  ASSERT_TRUE(saved.ok()) << saved;
  EXPECT_TRUE(before_save == *save_buffers) << "save modified the state it was given";
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(path, &store);
  ASSERT_TRUE(md.ok()) << md.status();
  ExpectMetadata(c, *md);
  ExpectHeadersOfMetadata(store, path, *md);
  if (verify) {
    Result<VerifyReport> report = Verify(path, &store, pool);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->ok()) << Join(report->defects);
  }
  Result<RankBuffers> initial = MakeBuffers(c, false, rng);
  ASSERT_TRUE(initial.ok()) << initial.status();
  RankBuffers loaded = *initial;
  Result<std::vector<LoadResult>> results = LoadCase(c, loaded, store, pool, path);
  ASSERT_TRUE(results.ok()) << results.status();
  ExpectResults(c, *results);
  ExpectMetadataParts(c, *md, *results);
  ExpectLoaded(c, *initial, loaded);
}

// On PosixStore: a fresh directory under the system temporary directory, removed afterwards.
void RunCaseOnDisk(const Case& c, ThreadPool* pool, Rng& rng) {
  std::string dir = (std::filesystem::temp_directory_path() / "sp_reshard_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  PosixStore store;
  RunCase(c, store, pool, dir + "/ckpt", true, rng);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

TEST(ReshardRandomTest, SaveWithOneLayoutLoadWithAnother) {
  const uint64_t seed = static_cast<uint64_t>(EnvOr("SP_RESHARD_SEED", kDefaultSeed));
  const int64_t first = EnvOr("SP_RESHARD_FIRST_CASE", 0);
  const int64_t cases = EnvOr("SP_RESHARD_CASES", 2000);
  ThreadPool shared_pool(2);
  for (int64_t i = first; i < first + cases; ++i) {
    Result<Case> c = RandomCase(seed, i);
    ASSERT_TRUE(c.ok()) << "seed " << seed << " case " << i << ": " << c.status();
    SCOPED_TRACE("seed " + std::to_string(seed) + " case " + std::to_string(i) + ": " +
                 Describe(*c));
    Rng rng(seed + static_cast<uint64_t>(i));
    c->load_options.share_reads = i % 4 != 1;  // every way of reading stays covered
    c->load_in_separate_memory = i % 8 >= 4;
    c->load_as_processes = i % 16 >= 12;  // shared reads through shared memory
    // Ranks in separate memory keep only the chunks their boxes reach, but in some cases.
    c->load_options.own_chunks_only = i % 11 != 3;
    ThreadPool* pool = i % 3 == 0 ? nullptr : &shared_pool;  // else a pool per rank and call
    if (i % 7 == 5) c->load_options.io_depth = 1 + static_cast<int>(i % 3);  // else tuned
    // Scattered reads for runs of any length in a fifth of the cases (by default only runs of
    // kMinScatterRunBytes, which few of these small tensors have).
    if (i % 5 == 2) c->load_options.scatter_min_run_bytes = 1;
    if (i % 50 == 49) {
      if (i % 100 == 49) {  // half the cases on disk read every extent with direct I/O
        c->load_options.direct_io = true;
        c->load_options.direct_io_min_bytes = 0;
      }
      RunCaseOnDisk(*c, pool, rng);
    } else {
      MemoryStore store;
      RunCase(*c, store, pool, "/ckpt/case" + std::to_string(i), i % 10 == 0, rng);
    }
    if (HasFailure()) {
      FAIL() << "reproduce with SP_RESHARD_SEED=" << seed << " SP_RESHARD_FIRST_CASE=" << i
             << " SP_RESHARD_CASES=1";
    }
  }
}

// --- Focused cases ---

TensorCase MakeTensor(const std::string& name, DType dtype, const Shape& shape, uint64_t seed) {
  Rng rng(seed);
  TensorCase t;
  t.name = name;
  t.dtype = t.load_dtype = dtype;
  t.shape = shape;
  t.global = RandomBytes(rng, ShapeVolume(shape) * DTypeSize(dtype), dtype);
  return t;
}

Layout MeshOf(const Shape& shape, const MeshLayout& layout) {
  Result<std::vector<Box>> boxes = MeshChunksPerRank(shape, layout);
  EXPECT_TRUE(boxes.ok()) << boxes.status();
  if (!boxes.ok()) return Layout{};
  Layout out = OneChunkPerRank(static_cast<int>(boxes->size()),
                               std::vector<std::optional<Box>>(boxes->begin(), boxes->end()));
  out.mesh = layout;
  return out;
}

// The holdings of `n` ranks under a mesh over some of them (layout.rank_list); the others hold
// nothing.
Layout SubmeshOf(const Shape& shape, const MeshLayout& layout, int n) {
  Result<std::vector<Box>> boxes = MeshChunksPerRank(shape, layout);
  EXPECT_TRUE(boxes.ok()) << boxes.status();
  if (!boxes.ok()) return Layout{};
  std::vector<std::optional<Box>> per_rank(n);
  for (size_t i = 0; i < boxes->size(); ++i) per_rank[layout.rank_list.at(i)] = (*boxes)[i];
  Layout out = OneChunkPerRank(n, per_rank);
  out.mesh = layout;
  return out;
}

MeshLayout Mesh(Shape mesh_shape, std::vector<Placement> placements) {
  return MeshLayout{std::move(mesh_shape), std::move(placements), {}};
}

// Every rank lists every tensor on both sides; no objects.
Case MakeCase(std::vector<TensorCase> tensors, int save_ranks, int load_ranks) {
  Case c;
  c.save_ranks = save_ranks;
  c.load_ranks = load_ranks;
  c.tensors = std::move(tensors);
  c.lists_on_save.assign(save_ranks, std::vector<bool>(c.tensors.size(), true));
  c.lists_on_load.assign(load_ranks, std::vector<bool>(c.tensors.size(), true));
  c.wants_object.assign(load_ranks, {});
  return c;
}

bool HasText(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class ReshardTest : public ::testing::Test {
 protected:
  void SaveOk(const Case& c, const std::string& path = "/ckpt") {
    Result<RankBuffers> buffers = MakeBuffers(c, true, rng_);
    ASSERT_TRUE(buffers.ok()) << buffers.status();
    Status saved = SaveCase(c, *buffers, store_, &pool_, path);
    ASSERT_TRUE(saved.ok()) << saved;
  }
  // Loads into fresh buffers (initial_ keeps their first contents, loaded_ the result).
  std::vector<Status> LoadAll(const Case& c, const std::string& path = "/ckpt") {
    initial_ = MakeBuffers(c, false, rng_).value();
    loaded_ = initial_;
    return LoadEveryRank(c, loaded_, store_, &pool_, path, &results_);
  }
  void LoadOk(const Case& c, const std::string& path = "/ckpt") {
    Status loaded = FirstError(LoadAll(c, path));
    ASSERT_TRUE(loaded.ok()) << loaded;
  }
  // Flips bits `mask` of byte `at` of a stored chunk of the checkpoint at /ckpt.
  void FlipStoredByte(const CheckpointMetadata& md, const StoredChunk& chunk, uint64_t at,
                      uint8_t mask) {
    const std::string path = JoinPath("/ckpt", md.files[chunk.file].name);
    Result<std::string> bytes = store_.ReadFile(path);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    (*bytes)[md.files[chunk.file].data_start + chunk.data_offset + at] ^= static_cast<char>(mask);
    Result<std::unique_ptr<WritableFile>> file = store_.NewWritableFile(path);
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_TRUE((*file)->WriteAt(0, AsBytes(*bytes)).ok());
    ASSERT_TRUE((*file)->Close().ok());
  }
  // Flips a stored byte of `chunk` of tensor `name`, loads, and expects every rank to fail with
  // the same kDataLoss naming the tensor, the chunk, its file and the rank that read it.
  void ExpectCorruptChunkFailsEveryRank(const Case& c, const CheckpointMetadata& md,
                                        const std::string& name, const StoredChunk& chunk,
                                        uint64_t at, uint8_t mask) {
    const std::string path = JoinPath("/ckpt", md.files[chunk.file].name);
    ASSERT_NO_FATAL_FAILURE(FlipStoredByte(md, chunk, at, mask));
    std::vector<Status> statuses = LoadAll(c);
    ASSERT_FALSE(statuses[0].ok());
    EXPECT_EQ(statuses[0].code(), StatusCode::kDataLoss);
    EXPECT_TRUE(HasText(statuses[0].message(), "checksum mismatch in tensor '" + name +
                                                    "' chunk " + chunk.box.ToString() +
                                                    " (file " + path))
        << statuses[0];
    EXPECT_TRUE(HasText(statuses[0].message(), "rank ")) << statuses[0];  // which rank read it
    for (const Status& s : statuses) EXPECT_EQ(s, statuses[0]);
  }
  CheckpointMetadata Metadata(const std::string& path = "/ckpt") {
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(path, &store_);
    EXPECT_TRUE(md.ok()) << md.status();
    return md.ok() ? *md : CheckpointMetadata{};
  }

  MemoryStore store_;
  ThreadPool pool_{2};
  Rng rng_{7};
  RankBuffers initial_;
  RankBuffers loaded_;
  std::vector<LoadResult> results_;
};

TEST_F(ReshardTest, SameLayoutFourToFourIsBitExactAndReadsTheStoredBytesOnce) {
  // 1 MiB contiguous chunks take the direct path; the others are coalesced.
  TensorCase big = MakeTensor("big", DType::kFloat32, {1024, 1024}, 1);
  big.save = big.load = MeshOf(big.shape, Mesh({4}, {Placement::Shard(0)}));
  TensorCase grid = MakeTensor("grid", DType::kBFloat16, {64, 13}, 2);
  grid.save = grid.load =
      MeshOf(grid.shape, Mesh({2, 2}, {Placement::Shard(1), Placement::Shard(0)}));
  TensorCase odd = MakeTensor("odd", DType::kComplex128, {7, 3, 5}, 3);
  odd.save = odd.load = MeshOf(odd.shape, Mesh({4}, {Placement::Shard(2)}));
  Case c = MakeCase({big, grid, odd}, 4, 4);
  c.save_options.checksum_block_bytes = 4096;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
  ExpectResults(c, results_);

  uint64_t stored = 0, chunks = 0, read = 0;
  for (const TensorMetadata& t : Metadata().tensors) {
    for (const StoredChunk& chunk : t.chunks) stored += chunk.byte_length;
    chunks += t.chunks.size();
  }
  for (const LoadResult& r : results_) read += r.bytes_read;
  EXPECT_EQ(stored, big.global.size() + grid.global.size() + odd.global.size());
  EXPECT_GE(read, stored);
  EXPECT_LE(read, stored + chunks * c.save_options.checksum_block_bytes);
}

TEST_F(ReshardTest, ManyReadsOfOneFileOnManyThreadsReadEachStoredByteOnce) {
  // One file of 40 MiB read by one rank with 4 I/O threads: the reads of the file are cut into
  // several 16 MiB extents that the threads share, each read exactly once.
  std::vector<TensorCase> tensors;
  for (int i = 0; i < 5; ++i) {
    TensorCase t = MakeTensor("t" + std::to_string(i), DType::kFloat32, {1024 + 8 * i, 2048},
                              40 + static_cast<uint64_t>(i));
    t.save = t.load = MeshOf(t.shape, Mesh({1}, {Placement::Replicate()}));
    tensors.push_back(std::move(t));
  }
  Case c = MakeCase(std::move(tensors), 1, 1);
  c.save_options.files_per_rank = 1;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ThreadPool pool(4);
  initial_ = MakeBuffers(c, false, rng_).value();
  loaded_ = initial_;
  Status loaded = FirstError(LoadEveryRank(c, loaded_, store_, &pool, "/ckpt", &results_));
  ASSERT_TRUE(loaded.ok()) << loaded;
  ExpectLoaded(c, initial_, loaded_);
  uint64_t stored = 0;
  for (const TensorMetadata& t : Metadata().tensors) {
    for (const StoredChunk& chunk : t.chunks) stored += chunk.byte_length;
  }
  EXPECT_EQ(results_[0].bytes_read, stored);
}

TEST_F(ReshardTest, WorkedExampleTenByFourShardedOnFourRanksLoadsOnThree) {
  TensorCase t = MakeTensor("w", DType::kFloat32, {10, 4}, 4);
  t.save = MeshOf(t.shape, Mesh({4}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({3}, {Placement::Shard(0)}));
  ASSERT_EQ(t.load.ranks[2], (std::vector<Piece>{Piece{Box({8, 0}, {2, 4}), 0}}));
  Case c = MakeCase({t}, 4, 3);
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  const CheckpointMetadata md = Metadata();
  ASSERT_EQ(md.tensors.size(), 1u);
  std::vector<Box> boxes;
  for (const StoredChunk& chunk : md.tensors[0].chunks) boxes.push_back(chunk.box);
  EXPECT_EQ(boxes, (std::vector<Box>{Box({0, 0}, {3, 4}), Box({3, 0}, {3, 4}), Box({6, 0}, {3, 4}),
                                     Box({9, 0}, {1, 4})}));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
  // Rank 2's rows 8 and 9 come from two stored chunks: compare them directly as well.
  EXPECT_EQ(0, std::memcmp(loaded_[2][0].data() + kGuard, t.global.data() + 8 * 4 * 4, 2 * 4 * 4));
}

TEST_F(ReshardTest, ChunkLargerThanTheBudgetIsReadInSlabsForAColumnReshard) {
  // 256 KiB row chunks; each load rank wants a column block of both. With a 16 KiB budget the
  // staging window is one checksum block, far below the rows a column block spans.
  TensorCase t = MakeTensor("wide", DType::kFloat32, {256, 512}, 5);
  t.save = MeshOf(t.shape, Mesh({2}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({4}, {Placement::Shard(1)}));
  TensorCase u = MakeTensor("tall", DType::kFloat16, {300, 3, 40}, 6);
  u.save = MeshOf(u.shape, Mesh({2}, {Placement::Replicate()}));
  u.load = MeshOf(u.shape, Mesh({2, 2}, {Placement::Shard(2), Placement::Shard(1)}));
  Case c = MakeCase({t, u}, 2, 4);
  c.save_options.checksum_block_bytes = 4096;
  c.load_options.memory_budget_bytes = 16 << 10;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
}

TEST_F(ReshardTest, DirectReadsStartingInsideAChecksumBlockAreVerified) {
  // 4 MB row chunks on 2 ranks read by 3 ranks: each region is one contiguous run of at least
  // 1 MiB in both chunks (the direct path) whose ends fall inside 1000-byte checksum blocks.
  TensorCase t = MakeTensor("rows", DType::kFloat32, {1000, 2000}, 12);
  t.save = MeshOf(t.shape, Mesh({2}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({3}, {Placement::Shard(0)}));
  Case c = MakeCase({t}, 2, 3);
  c.save_options.checksum_block_bytes = 1000;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
}

// fp32 values with the cases a narrowing cast must get right, then random ones.
TensorCase Float32Specials(const std::string& name, const Shape& shape) {
  TensorCase t = MakeTensor(name, DType::kFloat32, shape, 8);
  using Limits = std::numeric_limits<float>;
  const float max = Limits::max(), inf = Limits::infinity(), nan = Limits::quiet_NaN();
  const float tiny = Limits::denorm_min();
  const float special[] = {0.0f,     -0.0f, 1.0f, -1.5f, 1.00390625f, 1.01171875f, 1e-40f,
                           65504.0f, max,   inf,  -inf,  nan,         tiny};
  std::memcpy(t.global.data(), special, sizeof(special));
  return t;
}

Case CastCase() {
  TensorCase t = Float32Specials("model.w", {33, 20});
  t.load_dtype = DType::kBFloat16;
  t.save = MeshOf(t.shape, Mesh({2}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({3}, {Placement::Shard(1)}));
  return MakeCase({t}, 2, 3);
}

TEST_F(ReshardTest, CastOnLoadMatchesConvertElements) {
  Case c = CastCase();
  c.load_options.allow_cast = true;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  // The reference: the whole global tensor converted by ConvertElements, then placed unchanged.
  Case expected = c;
  TensorCase& t = expected.tensors[0];
  Bytes converted(ShapeVolume(t.shape) * DTypeSize(DType::kBFloat16));
  ASSERT_TRUE(ConvertElements(DType::kFloat32, t.global.data(), DType::kBFloat16, converted.data(),
                              ShapeVolume(t.shape))
                  .ok());
  t.dtype = DType::kBFloat16;
  t.global = std::move(converted);
  ExpectLoaded(expected, initial_, loaded_);
}

// Chunks smaller than a checksum block, split by column on load: without shared reads every rank
// reads each chunk whole; with them one rank reads it and sends the others their columns.
Case ColumnSplitCase() {
  TensorCase w = MakeTensor("w", DType::kFloat32, {64, 96}, 11);
  w.save = MeshOf(w.shape, Mesh({2}, {Placement::Shard(0)}));
  w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(1)}));
  TensorCase v = MakeTensor("v", DType::kBFloat16, {10, 7, 9}, 12);
  v.save = MeshOf(v.shape, Mesh({2}, {Placement::Replicate()}));
  v.load = MeshOf(v.shape, Mesh({3}, {Placement::Shard(2)}));
  TensorCase big = MakeTensor("big", DType::kFloat32, {256, 256}, 13);  // 4 blocks per chunk
  big.save = MeshOf(big.shape, Mesh({2}, {Placement::Shard(0)}));
  big.load = MeshOf(big.shape, Mesh({3}, {Placement::Shard(0)}));
  Case c = MakeCase({w, v, big}, 2, 3);
  c.save_options.checksum_block_bytes = 64 << 10;
  c.load_options.share_reads = true;
  return c;
}

uint64_t StoredBytes(const CheckpointMetadata& md) {
  uint64_t total = 0;
  for (const TensorMetadata& t : md.tensors) {
    for (const StoredChunk& chunk : t.chunks) total += chunk.byte_length;
  }
  return total;
}

// How the ranks of a load see each other.
enum class RankKind { kThreads, kSeparateMemory, kProcessesOfOneMachine };

void SetRankKind(Case& c, RankKind kind) {
  c.load_in_separate_memory = kind == RankKind::kSeparateMemory;
  c.load_as_processes = kind == RankKind::kProcessesOfOneMachine;
}

const char* RankKindName(RankKind kind) {
  switch (kind) {
    case RankKind::kThreads:
      return "ranks sharing memory";
    case RankKind::kSeparateMemory:
      return "ranks in separate memory";
    case RankKind::kProcessesOfOneMachine:
      return "processes of one machine";
  }
  return "";
}

constexpr RankKind kRankKinds[] = {RankKind::kThreads, RankKind::kSeparateMemory,
                                   RankKind::kProcessesOfOneMachine};

// The names loads put in /dev/shm (read gates, exchange objects) that are there now.
std::set<std::string> LoadObjectsInDevShm() {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("shardpoint-io-", 0) == 0 || name.rfind("shardpoint-xchg-", 0) == 0) {
      names.insert(name);
    }
  }
  return names;
}

// Nothing a load put in /dev/shm stays there. Each name is one load's (it carries the load's
// nonce), and a load holds it only until its ranks have attached: a test running beside this one
// may hold one for a moment, but a name still there 5 s later was left behind.
void ExpectNoSharedMemoryLeft() {
  std::set<std::string> seen = LoadObjectsInDevShm();
  for (int i = 0; i < 500 && !seen.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const std::set<std::string> now = LoadObjectsInDevShm();
    std::erase_if(seen, [&](const std::string& name) { return !now.count(name); });
  }
  for (const std::string& name : seen) ADD_FAILURE() << "/dev/shm/" << name << " was left behind";
}

TEST_F(ReshardTest, SharedReadsReadEachStoredByteOnceAndMatchReadingAlone) {
  for (RankKind kind : kRankKinds) {
    SCOPED_TRACE(RankKindName(kind));
    Case c = ColumnSplitCase();
    SetRankKind(c, kind);
    c.save_options.overwrite = true;
    ASSERT_NO_FATAL_FAILURE(SaveOk(c));
    const uint64_t stored = StoredBytes(Metadata());
    auto total_read = [&] {
      uint64_t read = 0;
      for (const LoadResult& r : results_) read += r.bytes_read;
      return read;
    };
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
    EXPECT_EQ(total_read(), stored);

    c.load_options.share_reads = false;
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
    const uint64_t alone = total_read();
    // Unset, reads are shared across machines, between ranks that share memory (threads of
    // one process) and between the processes of one machine (through shared memory); ranks that
    // say neither (a communicator that cannot tell where its ranks run) read alone.
    c.load_options.share_reads.reset();
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
    EXPECT_EQ(total_read(), kind == RankKind::kSeparateMemory ? alone : stored);
    // Alone, each of the 3 ranks reads every chunk of "w" and "v" whole, and the checksum blocks
    // where "big"'s rows split (one in each chunk) are read by two ranks (or more: partial blocks
    // of direct reads are read on their own).
    const uint64_t w_and_v = 64 * 96 * 4 + 10 * 7 * 9 * 2;
    EXPECT_GE(alone, stored + 2 * w_and_v + 2 * (64 << 10));
  }
  ExpectNoSharedMemoryLeft();
}

TEST_F(ReshardTest, ProcessesOfOneMachineReadThroughOneGate) {
  Case c = ColumnSplitCase();
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  auto gate_ranks = [&] {
    std::vector<int> ranks;
    for (const LoadResult& r : results_) ranks.push_back(r.read_gate_ranks);
    return ranks;
  };
  const std::vector<int> alone(static_cast<size_t>(c.load_ranks), 1);
  const std::vector<int> together(static_cast<size_t>(c.load_ranks), c.load_ranks);
  // In-process ranks share their pool's gate, not a machine's.
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  EXPECT_EQ(gate_ranks(), alone);
  // Reported as processes of one machine, each on its own pool: one shared gate when each reads
  // its own, each its own gate when they share their reads through shared memory (the exchange
  // gives each stored byte one reader already); the same bytes either way.
  c.load_as_processes = true;
  for (bool share : {false, true}) {
    c.load_options.share_reads = share;
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
    ExpectResults(c, results_);
    EXPECT_EQ(gate_ranks(), share ? alone : together) << "share_reads " << share;
  }
  c.load_options.share_reads = false;
  // A fixed depth per rank, or sharing turned off: each its own.
  c.load_options.io_depth = 2;
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
  EXPECT_EQ(gate_ranks(), alone);
  c.load_options.io_depth = 0;
  c.load_options.machine_read_gate = false;
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  EXPECT_EQ(gate_ranks(), alone);
  ExpectNoSharedMemoryLeft();
}

TEST_F(ReshardTest, SharedReadsCastOnTheReceivingRank) {
  for (RankKind kind : kRankKinds) {
    SCOPED_TRACE(RankKindName(kind));
    Case c = ColumnSplitCase();
    SetRankKind(c, kind);
    c.save_options.overwrite = true;
    for (TensorCase& t : c.tensors) t.load_dtype = DType::kFloat64;
    c.load_options.allow_cast = true;
    ASSERT_NO_FATAL_FAILURE(SaveOk(c));
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    Case expected = c;
    for (TensorCase& t : expected.tensors) {
      Bytes converted(ShapeVolume(t.shape) * 8);
      ASSERT_TRUE(ConvertElements(t.dtype, t.global.data(), DType::kFloat64, converted.data(),
                                  ShapeVolume(t.shape))
                      .ok());
      t.dtype = DType::kFloat64;
      t.global = std::move(converted);
    }
    ExpectLoaded(expected, initial_, loaded_);
  }
}

TEST_F(ReshardTest, SharedReadsInRoundsUnderASmallBudget) {
  // A 48 KiB budget allows 16 KiB of exchange per rank and round: "w"'s two 12 KiB chunks and
  // "v" go in separate rounds; the result is the same.
  Case c = ColumnSplitCase();
  c.load_options.memory_budget_bytes = 48 << 10;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  for (RankKind kind : {RankKind::kSeparateMemory, RankKind::kProcessesOfOneMachine}) {
    SCOPED_TRACE(RankKindName(kind));
    SetRankKind(c, kind);
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
  }
}

TEST_F(ReshardTest, CorruptSharedChunkFailsEveryRankWithTheReadersError) {
  for (RankKind kind : kRankKinds) {
    SCOPED_TRACE(RankKindName(kind));
    Case c = ColumnSplitCase();
    SetRankKind(c, kind);
    c.save_options.overwrite = true;
    ASSERT_NO_FATAL_FAILURE(SaveOk(c));
    const CheckpointMetadata md = Metadata();
    const TensorMetadata* w = nullptr;
    for (const TensorMetadata& t : md.tensors) {
      if (t.name == "w") w = &t;
    }
    ASSERT_NE(w, nullptr);
    ASSERT_NO_FATAL_FAILURE(ExpectCorruptChunkFailsEveryRank(c, md, "w", w->chunks[1], 5, 0x01));
  }
}

TEST_F(ReshardTest, CorruptChunkInALaterRoundFailsEveryRankWhileTheNextRoundReads) {
  // 16 row chunks of 2 KiB, each split by columns over 2 ranks: with a 6 KiB budget a round
  // carries 2 KiB of exchange per rank, two chunks, so the load runs in about 8 rounds, and the
  // next round is being read while a round's payloads are exchanged. A corrupt chunk in a late
  // round fails every rank with its reader's error, and nothing is left running.
  TensorCase t = MakeTensor("rows", DType::kFloat32, {128, 64}, 16);
  t.save = MeshOf(t.shape, Mesh({16}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({2}, {Placement::Shard(1)}));
  Case c = MakeCase({t}, 16, 2);
  c.load_options.share_reads = true;
  c.load_in_separate_memory = true;
  c.load_options.memory_budget_bytes = 6 << 10;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);

  const CheckpointMetadata md = Metadata();
  ASSERT_EQ(md.tensors.size(), 1u);
  ASSERT_EQ(md.tensors[0].chunks.size(), 16u);
  ASSERT_NO_FATAL_FAILURE(
      ExpectCorruptChunkFailsEveryRank(c, md, "rows", md.tensors[0].chunks[13], 100, 0x40));
  // The same through shared memory: the rounds alternate between the two slots of each rank.
  c.load_as_processes = true;
  ASSERT_NO_FATAL_FAILURE(
      ExpectCorruptChunkFailsEveryRank(c, md, "rows", md.tensors[0].chunks[13], 101, 0x40));
  ExpectNoSharedMemoryLeft();
}

// Columns of rows read scattered: a 16.8 MB chunk (more than one extent, so it is cut at 16 MiB
// inside a run and inside a checksum block) loaded as columns by 3 ranks, each run of 1.3 KiB
// landing in place, in every way of reading; and a flipped byte, between the runs a rank keeps
// (read through staging) or inside one (read in place), is still caught.
TEST_F(ReshardTest, ColumnsOfRowsLandInPlaceAndEveryBlockIsStillVerified) {
  TensorCase t = MakeTensor("cols", DType::kFloat32, {4100, 1024}, 17);
  t.save = MeshOf(t.shape, Mesh({1}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({3}, {Placement::Shard(1)}));
  TensorCase narrow = MakeTensor("narrow", DType::kBFloat16, {64, 96}, 18);  // runs of 64 bytes
  narrow.save = MeshOf(narrow.shape, Mesh({1}, {Placement::Shard(0)}));
  narrow.load = MeshOf(narrow.shape, Mesh({3}, {Placement::Shard(1)}));
  Case c = MakeCase({t, narrow}, 1, 3);
  c.save_options.checksum_block_bytes = 1000;  // blocks that neither rows nor runs line up with
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  const CheckpointMetadata md = Metadata();
  const uint64_t stored = StoredBytes(md);
  for (RankKind kind : kRankKinds) {
    for (bool share : {true, false}) {
      for (uint64_t min_run : {kMinScatterRunBytes, std::numeric_limits<uint64_t>::max()}) {
        SCOPED_TRACE(std::string(RankKindName(kind)) + (share ? ", shared" : ", alone") +
                     (min_run == kMinScatterRunBytes ? ", scattered" : ", staged"));
        SetRankKind(c, kind);
        c.load_options.share_reads = share;
        c.load_options.scatter_min_run_bytes = min_run;
        ASSERT_NO_FATAL_FAILURE(LoadOk(c));
        ExpectLoaded(c, initial_, loaded_);
        uint64_t read = 0;
        for (const LoadResult& r : results_) read += r.bytes_read;
        if (!share) {
          // Every rank reads the rows whole, from its first run to its last (a scattered read
          // leaves out the head of the first row and the tail of the last, up to a block).
          EXPECT_LE(read, 3 * stored);
          EXPECT_GE(read, 3 * stored - 3 * 1024 * 4);
        } else if (min_run == kMinScatterRunBytes) {
          EXPECT_EQ(read, stored);  // one read of the chunk serves the three ranks
        }
      }
    }
  }
  c.load_options.scatter_min_run_bytes = kMinScatterRunBytes;
  // Within the memory budget: a rank reading alone stages the other ranks' columns between its
  // runs, and a band of the chunk stages at most one window (budget / (3 x the pool's threads)).
  {
    SetRankKind(c, RankKind::kThreads);
    c.load_options.share_reads = false;
    c.load_options.memory_budget_bytes = 3 * 2 * (256 << 10);  // a window of 256 KiB
    ThreadPool pool(2);
    initial_ = MakeBuffers(c, false, rng_).value();
    loaded_ = initial_;
    ASSERT_TRUE(FirstError(LoadEveryRank(c, loaded_, store_, &pool, "/ckpt", &results_)).ok());
    ExpectLoaded(c, initial_, loaded_);
    EXPECT_GT(pool.staging().largest_asked(), 0u);
    EXPECT_LE(pool.staging().largest_asked(), uint64_t{256} << 10);
    c.load_options.memory_budget_bytes = kDefaultMemoryBudgetBytes;
  }
  const TensorMetadata* cols = md.FindTensor("cols");
  ASSERT_NE(cols, nullptr);
  ASSERT_EQ(cols->chunks.size(), 1u);
  // Row 10, column 700: rank 2's column, which rank 0 reads through when it reads alone.
  const uint64_t between = (10 * 1024 + 700) * 4;
  c.load_options.share_reads = false;
  SetRankKind(c, RankKind::kThreads);
  c.lists_on_load[1][0] = c.lists_on_load[2][0] = false;  // only rank 0 reads `cols`
  c.load_options.strict = false;
  ASSERT_NO_FATAL_FAILURE(FlipStoredByte(md, cols->chunks[0], between, 0x08));
  for (const Status& s : LoadAll(c)) {
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    EXPECT_TRUE(HasText(s.message(), "rank 0: ")) << s;
    EXPECT_TRUE(HasText(s.message(), "checksum mismatch in tensor 'cols' chunk " +
                                         cols->chunks[0].box.ToString() + " (file ")) << s;
    EXPECT_TRUE(HasText(s.message(), "chunk bytes 43000..44000)")) << s;
  }
  ASSERT_NO_FATAL_FAILURE(FlipStoredByte(md, cols->chunks[0], between, 0x08));  // mended
  c.lists_on_load[1][0] = c.lists_on_load[2][0] = true;
  c.load_options.strict = true;
  c.load_options.share_reads = true;  // one rank reads the rows, into every rank's destination
  // Row 4099, column 5: in rank 0's run, past the first 16 MiB of the file.
  ASSERT_NO_FATAL_FAILURE(
      ExpectCorruptChunkFailsEveryRank(c, md, "cols", cols->chunks[0],
                                       (4099 * 1024 + 5) * 4, 0x02));
}

TEST_F(ReshardTest, DirectReadsCompleteTheirPartialBlocksAndCatchCorruptionThere) {
  // Rows split 2 -> 3 inside 4 KiB blocks: each middle piece is contiguous in its stored chunk
  // (a direct read) but starts and ends inside blocks whose other bytes belong to other ranks.
  TensorCase t = MakeTensor("rows", DType::kFloat32, {300, 37}, 15);
  t.save = MeshOf(t.shape, Mesh({2}, {Placement::Shard(0)}));
  t.load = MeshOf(t.shape, Mesh({3}, {Placement::Shard(0)}));
  Case c = MakeCase({t}, 2, 3);
  c.save_options.checksum_block_bytes = 4096;
  c.load_options.share_reads = false;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);

  // Rank 1 wants rows 100..199: from chunk 0 (rows 0..149) bytes 100*37*4 = 14800 onwards, in
  // the block 12288..16384 whose head (12288..14800) no rank 1 row needs. Corrupt that head.
  const CheckpointMetadata md = Metadata();
  const StoredChunk& chunk = md.tensors[0].chunks[0];
  ASSERT_EQ(chunk.box, Box({0, 0}, {150, 37}));
  const std::string path = JoinPath("/ckpt", md.files[chunk.file].name);
  ASSERT_NO_FATAL_FAILURE(FlipStoredByte(md, chunk, 13000, 0x10));
  c.lists_on_load[0][0] = c.lists_on_load[2][0] = false;  // only rank 1 reads, so only its edge
  c.load_options.strict = false;
  std::vector<Status> statuses = LoadAll(c);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    EXPECT_TRUE(HasText(s.message(), "rank 1: ")) << s;
    EXPECT_TRUE(HasText(s.message(), "checksum mismatch in tensor 'rows' chunk " +
                                         chunk.box.ToString() + " (file " + path +
                                         ", chunk bytes 12288..16384)"))
        << s;
    EXPECT_EQ(s, statuses[0]);
  }
}

// Direct I/O on POSIX files: loads in the saved layout and resharded, with and without shared
// reads, are bit-exact, and a flipped byte is still caught by its checksum. (On a file system
// without O_DIRECT the same loads go through the page cache.)
TEST(DirectIoLoadTest, LoadsAreBitExactAndCorruptionIsCaught) {
  std::string dir = (std::filesystem::temp_directory_path() / "sp_direct_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  PosixStore store;
  ThreadPool pool(3);
  Rng rng(5);
  TensorCase big = MakeTensor("big", DType::kFloat32, {1000, 1031}, 21);  // odd sizes: unaligned
  big.save = MeshOf(big.shape, Mesh({4}, {Placement::Shard(0)}));
  TensorCase small = MakeTensor("small", DType::kBFloat16, {37, 11}, 22);
  small.save = MeshOf(small.shape, Mesh({2, 2}, {Placement::Shard(1), Placement::Shard(0)}));
  for (int load_ranks : {4, 3}) {
    big.load = load_ranks == 4 ? big.save : MeshOf(big.shape, Mesh({3}, {Placement::Shard(1)}));
    small.load = load_ranks == 4 ? small.save : MeshOf(small.shape, Mesh({3}, {Placement::Shard(0)}));
    for (bool share : {false, true}) {
      Case c = MakeCase({big, small}, 4, load_ranks);
      c.save_options.checksum_block_bytes = 4096;
      c.load_options.direct_io = true;
      c.load_options.direct_io_min_bytes = 0;
      // Saved with direct writes for the 4-rank loads, through the page cache for the others.
      c.save_options.direct_io = load_ranks == 4;
      c.save_options.direct_io_min_bytes = 0;
      c.load_options.share_reads = share;
      SCOPED_TRACE("load ranks " + std::to_string(load_ranks) + (share ? ", shared" : ""));
      const std::string path = dir + "/ckpt";
      Result<RankBuffers> buffers = MakeBuffers(c, true, rng);
      ASSERT_TRUE(buffers.ok()) << buffers.status();
      c.save_options.overwrite = true;
      ASSERT_TRUE(SaveCase(c, *buffers, store, &pool, path).ok());
      RankBuffers initial = MakeBuffers(c, false, rng).value();
      RankBuffers loaded = initial;
      std::vector<LoadResult> results;
      Status s = FirstError(LoadEveryRank(c, loaded, store, &pool, path, &results));
      ASSERT_TRUE(s.ok()) << s;
      ExpectLoaded(c, initial, loaded);
    }
  }
  // A flipped byte in the middle of rank 0's chunk of `big`.
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(dir + "/ckpt", &store);
  ASSERT_TRUE(md.ok()) << md.status();
  const TensorMetadata* t = md->FindTensor("big");
  ASSERT_NE(t, nullptr);
  const StoredChunk& chunk = t->chunks[0];
  const std::string file = dir + "/ckpt/" + md->files[chunk.file].name;
  {
    Result<std::string> bytes = store.ReadFile(file);
    ASSERT_TRUE(bytes.ok());
    (*bytes)[md->files[chunk.file].data_start + chunk.data_offset + 100000] ^= 0x04;
    Result<std::unique_ptr<WritableFile>> out = store.NewWritableFile(file);
    ASSERT_TRUE(out.ok());
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(*bytes)).ok());
    ASSERT_TRUE((*out)->Sync().ok());
    ASSERT_TRUE((*out)->Close().ok());
  }
  big.load = big.save;
  small.load = small.save;
  Case c = MakeCase({big, small}, 4, 4);
  c.load_options.direct_io = true;
  c.load_options.direct_io_min_bytes = 0;
  c.load_options.share_reads = false;
  RankBuffers loaded = MakeBuffers(c, false, rng).value();
  std::vector<LoadResult> results;
  Status s = FirstError(LoadEveryRank(c, loaded, store, &pool, dir + "/ckpt", &results));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_TRUE(HasText(s.message(), "checksum mismatch in tensor 'big' chunk " + chunk.box.ToString()))
      << s;
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// LoadOptions::direct_io unset: a load right after the save (its files in the page cache) reads
// through the cache; once the files are dropped from the cache their extents are read directly;
// both bit-exact. direct_io false never reads directly, however cold the files.
TEST(DirectIoLoadTest, UnsetReadsColdFilesDirectlyAndWarmOnesThroughTheCache) {
  std::string dir = (std::filesystem::temp_directory_path() / "sp_direct_auto_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  PosixStore posix;
  FaultStore store(&posix);  // counts the direct reads
  ThreadPool pool(3);
  Rng rng(7);
  TensorCase big = MakeTensor("big", DType::kFloat32, {512, 1031}, 31);
  big.save = MeshOf(big.shape, Mesh({2}, {Placement::Shard(0)}));
  big.load = big.save;
  Case c = MakeCase({big}, 2, 2);
  c.load_options.direct_io = std::nullopt;
  c.load_options.direct_io_min_bytes = 0;
  c.load_options.share_reads = false;
  const std::string path = dir + "/ckpt";
  Result<RankBuffers> buffers = MakeBuffers(c, true, rng);
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  ASSERT_TRUE(SaveCase(c, *buffers, store, &pool, path).ok());
  auto load = [&](const char* what) {
    SCOPED_TRACE(what);
    RankBuffers initial = MakeBuffers(c, false, rng).value();
    RankBuffers loaded = initial;
    std::vector<LoadResult> results;
    store.ResetCounts();
    Status s = FirstError(LoadEveryRank(c, loaded, store, &pool, path, &results));
    ASSERT_TRUE(s.ok()) << s;
    ExpectLoaded(c, initial, loaded);
  };
  // Warm: every data file still mostly in the page cache (a busy machine may have evicted some of
  // it since the save; then the load rightly reads that part directly, and only that is checked).
  auto warm = [&]() -> bool {
    for (const auto& entry : std::filesystem::directory_iterator(path)) {
      if (entry.path().extension() != ".safetensors") continue;
      Result<std::unique_ptr<ReadableFile>> file = posix.OpenReadable(entry.path().string());
      if (!file.ok()) return false;
      std::optional<double> cached = (*file)->CachedFraction(0, (*file)->size());
      if (!cached.has_value() || *cached < kColdFraction) return false;
    }
    return true;
  };
  const bool was_warm = warm();
  load("warm");
  if (was_warm) {
    EXPECT_EQ(store.direct_reads(), 0);
  }
  // Cold: every data file dropped from the page cache (possible where it is apart from the file).
  auto drop = [&]() -> bool {
    bool cold = true;
    for (const auto& entry : std::filesystem::directory_iterator(path)) {
      if (entry.path().extension() != ".safetensors") continue;
      Result<std::unique_ptr<ReadableFile>> file = posix.OpenReadable(entry.path().string());
      EXPECT_TRUE(file.ok()) << file.status();
      if (!file.ok() || (*file)->direct_io_alignment() == 0 || !(*file)->DropCache().ok()) {
        return false;
      }
      std::optional<double> cached = (*file)->CachedFraction(0, (*file)->size());
      cold = cold && cached.has_value() && *cached < kColdFraction;
    }
    return cold;
  };
  if (!drop()) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "the file system under " << dir << " cannot drop files from its cache";
  }
  load("cold");
  EXPECT_GT(store.direct_reads(), 0);
  ASSERT_TRUE(drop());
  c.load_options.direct_io = false;
  load("cold, direct_io false");
  EXPECT_EQ(store.direct_reads(), 0);
  // Three ranks splitting the columns of the saved row halves: each reads whole rows and keeps a
  // third of them (the others read the same rows), so the cache serves them, cold or not.
  ASSERT_TRUE(drop());
  big.load = MeshOf(big.shape, Mesh({3}, {Placement::Shard(1)}));
  c = MakeCase({big}, 2, 3);
  c.load_options.direct_io = std::nullopt;
  c.load_options.direct_io_min_bytes = 0;
  c.load_options.share_reads = false;
  load("cold, columns");
  EXPECT_EQ(store.direct_reads(), 0);
  // Four ranks on a 2 x 2 mesh: each reads the rows of its saved half whole and keeps half of
  // their columns (516 or 515 of 1,031); its neighbour reads the same rows for the other half, so
  // those rows would cross the device twice if read directly: the cache serves the second read.
  ASSERT_TRUE(drop());
  big.load = MeshOf(big.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Shard(1)}));
  c = MakeCase({big}, 2, 4);
  c.load_options.direct_io = std::nullopt;
  c.load_options.direct_io_min_bytes = 0;
  c.load_options.share_reads = false;
  load("cold, half the columns");
  EXPECT_EQ(store.direct_reads(), 0);
  std::filesystem::remove_all(dir);
}

TEST_F(ReshardTest, RankFailingBeforeSharedReadsFailsEveryRankIdentically) {
  Case c = ColumnSplitCase();
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  c.tensors.push_back(MakeTensor("absent", DType::kFloat32, {4}, 14));
  c.tensors.back().save = MeshOf({4}, Mesh({2}, {Placement::Replicate()}));
  c.tensors.back().load = MeshOf({4}, Mesh({3}, {Placement::Replicate()}));
  for (auto& listed : c.lists_on_load) listed.push_back(false);
  c.lists_on_load[1].back() = true;  // only rank 1 asks for a key the checkpoint lacks
  std::vector<Status> statuses = LoadAll(c);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
    EXPECT_TRUE(HasText(s.message(), "rank 1: ")) << s;
    EXPECT_TRUE(HasText(s.message(), "absent")) << s;
    EXPECT_EQ(s, statuses[0]);
  }
}

TEST_F(ReshardTest, DTypeMismatchWithoutAllowCastNamesBothDTypesOnEveryRank) {
  Case c = CastCase();
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  std::vector<Status> statuses = LoadAll(c);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(HasText(s.message(), "float32")) << s;
    EXPECT_TRUE(HasText(s.message(), "bfloat16")) << s;
    EXPECT_TRUE(HasText(s.message(), "model.w")) << s;
    EXPECT_EQ(s, statuses[0]);
  }
  EXPECT_EQ(loaded_, initial_);  // nothing was written
}

// Saves "a" [5, 3] and "b" [2] as float32 and the object "step" from one rank at /ckpt.
class KeysTest : public ReshardTest {
 protected:
  void SetUp() override {
    TensorCase a = MakeTensor("a", DType::kFloat32, {5, 3}, 9);
    TensorCase b = MakeTensor("b", DType::kFloat32, {2}, 10);
    a.save = a.load = MeshOf(a.shape, Mesh({1}, {Placement::Replicate()}));
    b.save = b.load = MeshOf(b.shape, Mesh({1}, {Placement::Replicate()}));
    case_ = MakeCase({a, b}, 1, 1);
    case_.objects.push_back(
        ObjectCase{"step", {ObjectEntry{"step", ObjectEncoding::kJson, "1200"}}});
    ASSERT_NO_FATAL_FAILURE(SaveOk(case_));
  }
  Result<LoadResult> LoadOne(const LoadState& state, const LoadOptions& options) {
    LoadOptions with_store = options;
    with_store.store = &store_;
    with_store.pool = &pool_;
    return Load(state, "/ckpt", with_store);
  }
  Case case_;
};

TEST_F(KeysTest, StrictMissingTensorOrObjectIsNotFoundNamingTheKey) {
  Bytes a(15 * 4);
  LoadState state;
  state.tensors.push_back(
      LoadTensor{"a", DType::kFloat32, {5, 3}, {PieceView{Box({0, 0}, {5, 3}), a.data()}}});
  state.tensors.push_back(LoadTensor{"absent.weight", DType::kFloat32, {4}, {}});
  Result<LoadResult> result = LoadOne(state, LoadOptions{});
  EXPECT_EQ(result.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasText(result.status().message(), "'absent.weight'")) << result.status();
  state.tensors.pop_back();
  state.objects.push_back("absent.object");
  result = LoadOne(state, LoadOptions{});
  EXPECT_EQ(result.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasText(result.status().message(), "'absent.object'")) << result.status();
}

TEST_F(KeysTest, NonStrictListsMissingAndUnexpectedKeys) {
  Bytes a(15 * 4), ghost(4 * 4, std::byte{0x5a});
  LoadState state;
  state.tensors.push_back(
      LoadTensor{"a", DType::kFloat32, {5, 3}, {PieceView{Box({0, 0}, {5, 3}), a.data()}}});
  state.tensors.push_back(
      LoadTensor{"ghost", DType::kFloat32, {4}, {PieceView{Box({0}, {4}), ghost.data()}}});
  state.objects.push_back("ghost.object");
  LoadOptions options;
  options.strict = false;
  Result<LoadResult> result = LoadOne(state, options);
  ASSERT_TRUE(result.ok()) << result.status();
  std::vector<std::string> missing = result->missing_keys;
  std::sort(missing.begin(), missing.end());
  EXPECT_EQ(missing, (std::vector<std::string>{"ghost", "ghost.object"}));
  EXPECT_EQ(result->unexpected_keys, (std::vector<std::string>{"b", "step"}));
  EXPECT_TRUE(result->objects.empty());
  EXPECT_EQ(a, case_.tensors[0].global);
  EXPECT_EQ(ghost, Bytes(4 * 4, std::byte{0x5a}));
}

TEST_F(KeysTest, ShapeMismatchNamesBothShapes) {
  Bytes a(15 * 4);
  LoadState state;
  state.tensors.push_back(
      LoadTensor{"a", DType::kFloat32, {3, 5}, {PieceView{Box({0, 0}, {3, 5}), a.data()}}});
  Result<LoadResult> result = LoadOne(state, LoadOptions{});
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(result.status().message(), "'a'")) << result.status();
  EXPECT_TRUE(HasText(result.status().message(), "[5, 3]")) << result.status();
  EXPECT_TRUE(HasText(result.status().message(), "[3, 5]")) << result.status();
}

TEST_F(ReshardTest, ObjectsRoundTripAndTheLowestRankWins) {
  auto json = [](const std::string& name, const std::string& payload) {
    return ObjectEntry{name, ObjectEncoding::kJson, payload};
  };
  const std::string blob("\0\x01\xfe\xff binary", 12);
  Case c = MakeCase({}, 3, 2);
  c.objects.push_back(ObjectCase{
      "config", {ObjectEntry{}, json("config", "{\"lr\": 0.1}"), json("config", "{\"lr\": 0.2}")}});
  c.objects.push_back(
      ObjectCase{"step", {json("step", "100"), json("step", "101"), json("step", "102")}});
  c.objects.push_back(ObjectCase{
      "blob", {ObjectEntry{}, ObjectEntry{}, ObjectEntry{"blob", ObjectEncoding::kBytes, blob}}});
  c.wants_object.assign(2, std::vector<bool>(3, true));
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectResults(c, results_);
  ASSERT_EQ(results_[1].objects.size(), 3u);
  EXPECT_EQ(results_[1].objects[0].payload, "{\"lr\": 0.1}");
  EXPECT_EQ(results_[1].objects[1].payload, "100");
  EXPECT_EQ(results_[1].objects[2].payload, blob);
  const CheckpointMetadata md = Metadata();
  ASSERT_NE(md.FindObject("config"), nullptr);
  EXPECT_EQ(md.FindObject("config")->payload, "{\"lr\": 0.1}");
}

TEST_F(ReshardTest, RankHoldingNothingOnSaveAndOnLoad) {
  TensorCase t = MakeTensor("w", DType::kInt64, {6, 5}, 11);
  t.save.ranks = {{Piece{Box({0, 0}, {3, 5}), 0}}, {}, {Piece{Box({3, 0}, {3, 5}), 0}}};
  t.load.ranks = {{Piece{Box({0, 0}, {6, 5}), 0}}, {}, {Piece{Box({2, 1}, {3, 3}), 0}}};
  Case c = MakeCase({t}, 3, 3);
  c.lists_on_save[1][0] = false;  // rank 1's SaveState is empty
  c.lists_on_load[1][0] = false;  // rank 1's LoadState is empty
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  const CheckpointMetadata md = Metadata();
  for (const DataFile& f : md.files) EXPECT_NE(f.writer_rank, 1) << f.name;
  for (bool separate : {true, false}) {
    SCOPED_TRACE(separate ? "ranks in separate memory" : "ranks sharing memory");
    c.load_in_separate_memory = separate;
    ASSERT_NO_FATAL_FAILURE(LoadOk(c));
    ExpectLoaded(c, initial_, loaded_);
    ExpectResults(c, results_);
    EXPECT_EQ(results_[1].unexpected_keys, std::vector<std::string>{"w"});
    // Reading for itself, rank 1 reads nothing (the others each read both chunks whole, a
    // checksum block being larger than a chunk); sharing memory, the ranks split the reads of
    // both chunks, whoever needs them, and read each stored byte once.
    const uint64_t total =
        results_[0].bytes_read + results_[1].bytes_read + results_[2].bytes_read;
    if (separate) {
      EXPECT_EQ(results_[1].bytes_read, 0u);
      EXPECT_EQ(total, 2u * 2 * 3 * 5 * 8);
    } else {
      EXPECT_EQ(total, 2u * 3 * 5 * 8);
    }
    // Each rank's time before its first read ends inside its call; a rank that reads nothing
    // has spent the whole call before reading.
    for (const LoadResult& r : results_) {
      EXPECT_GT(r.seconds, 0);
      if (r.bytes_read == 0) {
        EXPECT_EQ(r.before_reads_seconds, r.seconds);
      } else {
        EXPECT_GT(r.before_reads_seconds, 0);
        EXPECT_LT(r.before_reads_seconds, r.seconds);
      }
    }
  }
}

// Four ranks each hold the same eight equal tensors.
Case ReplicatedCase() {
  std::vector<TensorCase> tensors;
  for (int k = 0; k < 8; ++k) {
    TensorCase t = MakeTensor("rep." + std::to_string(k), DType::kFloat32, {16, 16}, 20 + k);
    t.save = MeshOf(t.shape, Mesh({4}, {Placement::Replicate()}));
    t.load = MeshOf(t.shape, Mesh({2}, {Placement::Shard(1)}));
    tensors.push_back(std::move(t));
  }
  return MakeCase(std::move(tensors), 4, 2);
}

// Chunks written per rank, checking that every tensor is stored as one chunk.
std::map<int, int> ChunksPerWriter(const CheckpointMetadata& md) {
  std::map<int, int> per_rank;
  for (const TensorMetadata& t : md.tensors) {
    EXPECT_EQ(t.chunks.size(), 1u) << t.name;
    for (const StoredChunk& chunk : t.chunks) ++per_rank[md.files.at(chunk.file).writer_rank];
  }
  return per_rank;
}

TEST_F(ReshardTest, ReplicatedTensorsAreWrittenOnceWithBalancedOwnership) {
  Case c = ReplicatedCase();
  ASSERT_NO_FATAL_FAILURE(SaveOk(c, "/balanced"));
  EXPECT_EQ(ChunksPerWriter(Metadata("/balanced")),
            (std::map<int, int>{{0, 2}, {1, 2}, {2, 2}, {3, 2}}));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c, "/balanced"));
  ExpectLoaded(c, initial_, loaded_);

  c.save_options.dedup_to_lowest_rank = true;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c, "/lowest"));
  EXPECT_EQ(ChunksPerWriter(Metadata("/lowest")), (std::map<int, int>{{0, 8}}));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c, "/lowest"));
  ExpectLoaded(c, initial_, loaded_);
}

TEST_F(ReshardTest, PartiallyReplicatedMeshStoresEachChunkOnce) {
  TensorCase t = MakeTensor("m", DType::kFloat8E4M3FN, {9, 4}, 30);
  t.save = MeshOf(t.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Replicate()}));
  t.load = MeshOf(t.shape, Mesh({1}, {Placement::Replicate()}));
  Case c = MakeCase({t}, 4, 1);
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  const CheckpointMetadata md = Metadata();
  ExpectMetadata(c, md);
  ASSERT_EQ(md.tensors.size(), 1u);
  EXPECT_EQ(md.tensors[0].chunks.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
}

// A job at scale, in one process: 1,024 ranks on an (8 dp, 16 fsdp, 8 tp) mesh save a small
// model in the layouts of 3-D parallel training (row-sharded over every rank, some left empty,
// FSDP x TP grids replicated over dp, replicated norms), and 768 ranks on a (96, 8) mesh load it
// with other splits. Every stored chunk is written once, and every byte arrives.
TEST_F(ReshardTest, ThousandAndTwentyFourRanksSaveAndSevenHundredSixtyEightLoad) {
  const Placement R = Placement::Replicate();
  TensorCase emb = MakeTensor("emb", DType::kBFloat16, {4099, 24}, 40);
  emb.save = MeshOf(emb.shape, Mesh({1024}, {Placement::Shard(0)}));
  emb.load = MeshOf(emb.shape, Mesh({96, 8}, {Placement::Shard(0), Placement::Shard(1)}));
  TensorCase qkv = MakeTensor("qkv", DType::kFloat32, {192, 80}, 41);
  qkv.save = MeshOf(qkv.shape, Mesh({8, 16, 8}, {R, Placement::Shard(0), Placement::Shard(1)}));
  qkv.load = MeshOf(qkv.shape, Mesh({96, 8}, {R, Placement::Shard(0)}));
  TensorCase out = MakeTensor("out", DType::kBFloat16, {80, 192}, 42);
  out.save = MeshOf(out.shape, Mesh({8, 16, 8}, {R, Placement::Shard(1), Placement::Shard(0)}));
  out.load = MeshOf(out.shape, Mesh({96, 8}, {Placement::Shard(1), R}));
  TensorCase norm = MakeTensor("norm", DType::kFloat32, {80}, 43);
  norm.save = MeshOf(norm.shape, Mesh({1024}, {R}));
  norm.load = MeshOf(norm.shape, Mesh({96, 8}, {R, Placement::Shard(0)}));
  Case c = MakeCase({emb, qkv, out, norm}, 1024, 768);
  ASSERT_NO_FATAL_FAILURE(SaveOk(c));
  const CheckpointMetadata md = Metadata();
  ExpectMetadata(c, md);
  // emb: torch.chunk of 4,099 rows in 1,024 pieces gives 819 of 5 rows, one of 4, and 204 empty
  // ranks; qkv and out: 128 blocks each (16 x 8, each held by the 8 dp replicas); norm: one chunk.
  std::map<std::string, size_t> chunks;
  for (const TensorMetadata& t : md.tensors) chunks[t.name] = t.chunks.size();
  EXPECT_EQ(chunks, (std::map<std::string, size_t>{
                        {"emb", 820}, {"norm", 1}, {"out", 128}, {"qkv", 128}}));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c));
  ExpectLoaded(c, initial_, loaded_);
}


// --- Cached save plans (engine/save_plan_cache.h) ---

// Rotates every tensor's global bytes by whole elements: new values, the same layout.
void NewValues(Case* c, size_t step) {
  for (TensorCase& t : c->tensors) {
    const size_t element = DTypeSize(t.dtype);
    if (t.global.size() <= element) continue;
    const size_t by = (step % (t.global.size() / element)) * element;
    std::rotate(t.global.begin(), t.global.begin() + static_cast<std::ptrdiff_t>(by), t.global.end());
  }
}

// Two checkpoints of one layout hold the same tensors, chunks, files and objects: only the save
// id, the file names and the checksums may differ.
void ExpectSamePlan(CheckpointMetadata a, CheckpointMetadata b) {
  for (CheckpointMetadata* m : {&a, &b}) {
    m->save_id.clear();
    for (DataFile& f : m->files) f.name.clear(), f.header_crc32c = 0;  // headers name the save
    for (TensorMetadata& t : m->tensors) {
      for (StoredChunk& chunk : t.chunks) chunk.block_crc32c.clear();
    }
  }
  EXPECT_EQ(a.files, b.files);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) EXPECT_EQ(a.tensors[i], b.tensors[i]) << i;
}


// --- Layout rules in the save plan (plan/ruled_plan.h) ---

// Two pipeline stages of four ranks, each stage's tensors on a 2 x 2 mesh of its own ranks
// (rank lists 0-3 and 4-7), saved by every rank with its rule, then again with stage 1 sending
// boxes instead (its group's shared part, sent by no rank, is asked for), and through a cache
// where one rank changes: each loads bit-exactly, and the chunks are those of the rules.
TEST_F(ReshardTest, PipelineStagesSaveTheirMeshRulesAndLoadExactly) {
  std::vector<TensorCase> tensors;
  for (int stage = 0; stage < 2; ++stage) {
    MeshLayout mesh = Mesh({2, 2}, {Placement::Shard(0), Placement::Shard(1)});
    for (int64_t i = 0; i < 4; ++i) mesh.rank_list.push_back(stage * 4 + i);
    TensorCase w = MakeTensor("stage" + std::to_string(stage) + ".w", DType::kBFloat16, {10, 6},
                              80 + stage);
    w.save = SubmeshOf(w.shape, mesh, 8);
    w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(1)}));
    TensorCase norm = MakeTensor("stage" + std::to_string(stage) + ".norm", DType::kFloat32, {6},
                                 90 + stage);
    MeshLayout replicated = Mesh({2, 2}, {Placement::Replicate(), Placement::Replicate()});
    replicated.rank_list = mesh.rank_list;
    norm.save = SubmeshOf(norm.shape, replicated, 8);
    norm.load = MeshOf(norm.shape, Mesh({3}, {Placement::Replicate()}));
    tensors.push_back(std::move(w));
    tensors.push_back(std::move(norm));
  }
  Case c = MakeCase(tensors, 8, 3);
  for (int r = 0; r < 8; ++r) {
    for (size_t t = 0; t < tensors.size(); ++t) c.lists_on_save[r][t] = (r / 4 == int(t) / 2);
  }
  c.rules_everywhere = true;
  c.one_order = true;  // as a model's state dict lists them (ranks in other orders differ in part)
  std::vector<SaveStats> stats(8);
  c.save_stats = &stats;
  // Ranks 0 and 4 (the lowest of each stage's mesh) send their stages' parts: one exchange.
  ASSERT_NO_FATAL_FAILURE(SaveOk(c, "/stages/rules"));
  for (const SaveStats& s : stats) EXPECT_EQ(s.plan_exchanges, 1);
  ASSERT_NO_FATAL_FAILURE(LoadOk(c, "/stages/rules"));
  ExpectLoaded(c, initial_, loaded_);
  const CheckpointMetadata md = Metadata("/stages/rules");
  ExpectMetadata(c, md);
  ASSERT_NE(md.FindTensor("stage1.w"), nullptr);
  EXPECT_EQ(md.FindTensor("stage1.w")->chunks.size(), 4u);
  EXPECT_EQ(md.FindTensor("stage1.norm")->chunks.size(), 1u);

  Case boxes = c;  // stage 1 sends boxes: its ranks' part is the coordinator's to guess, not theirs
  for (size_t t = 2; t < 4; ++t) boxes.tensors[t].save.mesh.reset();
  // No rank of stage 1 sends its part (the coordinator guesses for ranks without a rule, and it
  // is in stage 0): a second exchange asks rank 4 for it.
  ASSERT_NO_FATAL_FAILURE(SaveOk(boxes, "/stages/boxes"));
  for (const SaveStats& s : stats) EXPECT_EQ(s.plan_exchanges, 2);
  ASSERT_NO_FATAL_FAILURE(LoadOk(boxes, "/stages/boxes"));
  ExpectLoaded(boxes, initial_, loaded_);
  ExpectSamePlan(Metadata("/stages/rules"), Metadata("/stages/boxes"));

  // Through a cache: rank 5 stops using its rule (its layout key is the same: the boxes are), then
  // stage 0 changes dtype and so plans afresh while stage 1 sent only the id.
  SavePlanCache cache;
  for (Case* each : {&c, &boxes}) {
    each->save_options.plan_cache = &cache;
    each->save_options.overwrite = true;
  }
  ASSERT_NO_FATAL_FAILURE(SaveOk(c, "/stages/cached"));
  ASSERT_NO_FATAL_FAILURE(SaveOk(boxes, "/stages/cached"));
  EXPECT_EQ(cache.hits(), 8u);
  Case changed = c;
  changed.tensors[1] = MakeTensor("stage0.norm", DType::kFloat64, {6}, 95);
  changed.tensors[1].save = c.tensors[1].save;
  changed.tensors[1].load = c.tensors[1].load;
  ASSERT_NO_FATAL_FAILURE(SaveOk(changed, "/stages/cached"));
  EXPECT_EQ(cache.misses(), 16u);
  // Stage 1 sent ids, then its plans; rank 4, the lowest of its mesh, sent its part with them.
  for (const SaveStats& s : stats) EXPECT_EQ(s.plan_exchanges, 2);
  ASSERT_NO_FATAL_FAILURE(LoadOk(changed, "/stages/cached"));
  ExpectLoaded(changed, initial_, loaded_);
}

// A rank whose piece is not the chunk its rule gives it fails the save on every rank, with an
// error that names the tensor, the rank, the rule's chunk and the piece, and writes nothing.
TEST_F(ReshardTest, APieceThatIsNotItsRulesChunkFailsEveryRank) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {8, 4}, 99);
  w.save = MeshOf(w.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Replicate()}));
  w.save.mesh = Mesh({2, 2}, {Placement::Replicate(), Placement::Shard(0)});  // not the holdings
  w.load = MeshOf(w.shape, Mesh({1}, {Placement::Replicate()}));
  Case c = MakeCase({w}, 4, 1);
  c.rules_everywhere = true;
  Result<RankBuffers> buffers = MakeBuffers(c, true, rng_);
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  const std::vector<Status> statuses = RunRanks(4, [&](Communicator& comm) {
    SaveOptions options = c.save_options;
    options.comm = &comm;
    options.store = &store_;
    options.pool = &pool_;
    return Save(SaveStateOf(c, comm.rank(), *buffers), "/wrong", options);
  });
  for (const Status& status : statuses) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(),
              "rank 1: tensor 'w': rank 1 holds piece [0:4, 0:4], but its layout (mesh [2, 2] "
              "placements (R, S(0))) gives it the chunk [4:8, 0:4]");
  }
  Result<std::vector<DirEntry>> left = store_.ListDir("/wrong");
  EXPECT_TRUE(!left.ok() || left->empty());
}

class PlanCacheTest : public ReshardTest {
 protected:
  // Saves `c` at `path` through `cache` and checks how many of its ranks took the cached plan.
  void SaveThrough(Case c, SavePlanCache& cache, const std::string& path, bool expect_hit) {
    c.save_options.plan_cache = &cache;
    c.save_options.overwrite = true;
    const uint64_t hits = cache.hits(), misses = cache.misses();
    ASSERT_NO_FATAL_FAILURE(SaveOk(c, path));
    const uint64_t ranks = static_cast<uint64_t>(c.save_ranks);
    EXPECT_EQ(cache.hits() - hits, expect_hit ? ranks : 0) << path;
    EXPECT_EQ(cache.misses() - misses, expect_hit ? 0 : ranks) << path;
  }
  // Checks that between saves the coordinator's part of `cache` holds the native metadata file
  // committed at `path` and nothing else of its plan: no chunk list, no rank's writes.
  void ExpectPlanKeptAsItsFile(const SavePlanCache& cache, const std::string& path) {
    Result<std::string> file = store_.ReadFile(JoinPath(path, "shardpoint.metadata"));
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(cache.plan_bytes(), file->size()) << path;
  }
};

// Random layouts and options: the second save of each takes the cached plan, stores the new
// values bit-exactly (loaded in another layout), and lays out its checkpoint exactly as the
// first; an overwrite through the cache replaces it.
TEST_F(PlanCacheTest, RepeatedSavesOfRandomLayoutsTakeTheCachedPlanAndStayBitExact) {
  for (int64_t i = 0; i < 60; ++i) {
    Result<Case> c = RandomCase(0xcace, i);
    ASSERT_TRUE(c.ok()) << c.status();
    SCOPED_TRACE("case " + std::to_string(i) + ": " + Describe(*c));
    // One for every in-process rank of the group, keeping even these small plans as their files.
    SavePlanCache cache(0);
    const std::string dir = "/cache" + std::to_string(i);
    ASSERT_NO_FATAL_FAILURE(SaveThrough(*c, cache, dir + "/a", false));
    ExpectPlanKeptAsItsFile(cache, dir + "/a");
    NewValues(&*c, 1 + static_cast<size_t>(i));
    // The plan's chunks come back from /a's file, and /b's file, larger by an attribute, is kept
    // instead.
    c->save_options.attributes["saved as"] = "b";
    ASSERT_NO_FATAL_FAILURE(SaveThrough(*c, cache, dir + "/b", true));
    ExpectPlanKeptAsItsFile(cache, dir + "/b");
    ASSERT_NO_FATAL_FAILURE(LoadOk(*c, dir + "/b"));
    ExpectLoaded(*c, initial_, loaded_);
    ExpectSamePlan(Metadata(dir + "/a"), Metadata(dir + "/b"));
    // Every file's name and header carry the new save's id (renamed from the cached layout).
    const CheckpointMetadata b = Metadata(dir + "/b");
    EXPECT_NE(b.save_id, Metadata(dir + "/a").save_id);
    ExpectHeadersOfMetadata(store_, dir + "/a", Metadata(dir + "/a"));
    ExpectHeadersOfMetadata(store_, dir + "/b", b);
    Result<VerifyReport> verified = Verify(dir + "/b", &store_);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_TRUE(verified->ok()) << (verified->defects.empty() ? "" : verified->defects[0]);
    EXPECT_EQ(verified->files_checked, b.files.size());
    if (i % 10 == 0) {
      NewValues(&*c, 3);
      ASSERT_NO_FATAL_FAILURE(SaveThrough(*c, cache, dir + "/b", true));
      ASSERT_NO_FATAL_FAILURE(LoadOk(*c, dir + "/b"));
      ExpectLoaded(*c, initial_, loaded_);
    }
    if (HasFailure()) return;
  }
}

// Any change of layout or of the planning options plans afresh, and the checkpoint is what a
// save without a cache writes.
TEST_F(PlanCacheTest, EveryChangeOfLayoutOrOptionsPlansAfresh) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {12, 8}, 50);
  w.save = MeshOf(w.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Replicate()}));
  w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(1)}));
  TensorCase b = MakeTensor("b", DType::kBFloat16, {8}, 51);
  b.save = MeshOf(b.shape, Mesh({4}, {Placement::Replicate()}));
  b.load = MeshOf(b.shape, Mesh({3}, {Placement::Replicate()}));
  const Case base = MakeCase({w, b}, 4, 3);
  SavePlanCache cache;
  ASSERT_NO_FATAL_FAILURE(SaveThrough(base, cache, "/c/0", false));
  ASSERT_NO_FATAL_FAILURE(SaveThrough(base, cache, "/c/1", true));

  std::vector<std::pair<std::string, Case>> changes;
  Case dtype = base;  // the same shapes and boxes, another dtype
  dtype.tensors[1] = MakeTensor("b", DType::kFloat32, {8}, 52);
  dtype.tensors[1].save = base.tensors[1].save;
  dtype.tensors[1].load = base.tensors[1].load;
  changes.push_back({"dtype", dtype});
  Case boxes = base;  // w split along the other dim
  boxes.tensors[0].save =
      MeshOf(w.shape, Mesh({2, 2}, {Placement::Replicate(), Placement::Shard(1)}));
  changes.push_back({"boxes", boxes});
  Case added = base;  // one more tensor
  TensorCase extra = MakeTensor("extra", DType::kInt32, {5}, 53);
  extra.save = MeshOf(extra.shape, Mesh({4}, {Placement::Shard(0)}));
  extra.load = MeshOf(extra.shape, Mesh({3}, {Placement::Replicate()}));
  added = MakeCase({w, b, extra}, 4, 3);
  changes.push_back({"tensor added", added});
  Case order = base;  // the same tensors, listed in another order
  order.order_seed = 99;
  changes.push_back({"order", order});
  Case files = base;
  files.save_options.files_per_rank = 2;
  changes.push_back({"files_per_rank", files});
  Case dedup = base;
  dedup.save_options.dedup_to_lowest_rank = true;
  changes.push_back({"dedup_to_lowest_rank", dedup});
  Case block = base;
  block.save_options.checksum_block_bytes = 16;
  changes.push_back({"checksum_block_bytes", block});
  Case coordinator = base;
  coordinator.save_options.coordinator = 2;
  changes.push_back({"coordinator", coordinator});

  int k = 0;
  for (auto& [what, changed] : changes) {
    SCOPED_TRACE(what);
    const std::string dir = "/changed" + std::to_string(k++);
    ASSERT_NO_FATAL_FAILURE(SaveThrough(changed, cache, dir + "/cached", false));
    ASSERT_NO_FATAL_FAILURE(LoadOk(changed, dir + "/cached"));
    ExpectLoaded(changed, initial_, loaded_);
    ASSERT_NO_FATAL_FAILURE(SaveOk(changed, dir + "/plain"));
    ExpectSamePlan(Metadata(dir + "/plain"), Metadata(dir + "/cached"));
    // The changed layout is the cached one now; back to the base, afresh again.
    ASSERT_NO_FATAL_FAILURE(SaveThrough(changed, cache, dir + "/again", true));
    ASSERT_NO_FATAL_FAILURE(SaveThrough(base, cache, dir + "/base", false));
  }
}

// Ranks whose layout is unchanged send only the plan's id; when another rank's changed, they are
// asked for their local plans in a second exchange, and the save is still exact. Objects change
// freely between cached saves, and the lowest rank's value still wins.
TEST_F(PlanCacheTest, OneRankChangingMakesTheOthersSendTheirPlansAndObjectsTravelEverySave) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {8, 6}, 60);
  w.save = MeshOf(w.shape, Mesh({3}, {Placement::Shard(0)}));
  w.load = MeshOf(w.shape, Mesh({2}, {Placement::Shard(1)}));
  TensorCase only = MakeTensor("only.rank2", DType::kInt64, {4}, 61);
  only.save.ranks = {{}, {}, {Piece{Box({0}, {4}), 0}}};
  only.load = MeshOf(only.shape, Mesh({2}, {Placement::Replicate()}));
  Case c = MakeCase({w, only}, 3, 2);
  c.lists_on_save[0][1] = c.lists_on_save[1][1] = false;
  c.lists_on_save[2][1] = false;  // first without rank 2's own tensor
  auto step = [](const std::string& v) { return ObjectEntry{"step", ObjectEncoding::kJson, v}; };
  c.objects.push_back(ObjectCase{"step", {step("1"), step("1"), step("1")}});
  c.wants_object.assign(2, std::vector<bool>(1, true));
  Case first = c;
  first.tensors[1].save.ranks[2].clear();
  first.tensors[1].load.ranks.assign(2, {});
  first.lists_on_load.assign(2, {true, false});
  SavePlanCache cache(0);  // keeps even this small plan as its file
  ASSERT_NO_FATAL_FAILURE(SaveThrough(first, cache, "/one/0", false));
  first.objects[0].per_rank = {step("2"), step("3"), step("4")};
  ASSERT_NO_FATAL_FAILURE(SaveThrough(first, cache, "/one/1", true));
  ExpectPlanKeptAsItsFile(cache, "/one/1");
  ASSERT_NO_FATAL_FAILURE(LoadOk(first, "/one/1"));
  ExpectLoaded(first, initial_, loaded_);
  ASSERT_EQ(results_[0].objects.size(), 1u);
  EXPECT_EQ(results_[0].objects[0].payload, "2");
  // An object of 200 KB makes the committed file larger than the plan's chunks by more than the
  // cache's slack: the cache keeps the plan whole, and the next save, whose file is small again,
  // commits from it and keeps its file instead.
  const std::string big = "\"" + std::string(200000, 'x') + "\"";
  first.objects[0].per_rank = {step(big), step("3"), step("4")};
  ASSERT_NO_FATAL_FAILURE(SaveThrough(first, cache, "/one/big", true));
  Result<std::string> big_file = store_.ReadFile("/one/big/shardpoint.metadata");
  ASSERT_TRUE(big_file.ok()) << big_file.status();
  EXPECT_GT(big_file->size(), 200000u);
  EXPECT_GT(cache.plan_bytes(), 0u);
  EXPECT_LT(cache.plan_bytes(), big_file->size() - 200000);
  ASSERT_NO_FATAL_FAILURE(LoadOk(first, "/one/big"));
  ASSERT_EQ(results_[0].objects.size(), 1u);
  EXPECT_EQ(results_[0].objects[0].payload, big);
  first.objects[0].per_rank = {step("2"), step("3"), step("4")};
  ASSERT_NO_FATAL_FAILURE(SaveThrough(first, cache, "/one/small", true));
  ExpectPlanKeptAsItsFile(cache, "/one/small");
  ASSERT_NO_FATAL_FAILURE(LoadOk(first, "/one/small"));
  ExpectLoaded(first, initial_, loaded_);
  // Rank 2 now lists a tensor of its own: ranks 0 and 1 sent the id, then their plans.
  c.lists_on_save[2][1] = true;
  c.objects[0].per_rank = {ObjectEntry{}, step("5"), step("6")};
  ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, "/one/2", false));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c, "/one/2"));
  ExpectLoaded(c, initial_, loaded_);
  ASSERT_EQ(results_[0].objects.size(), 1u);
  EXPECT_EQ(results_[0].objects[0].payload, "5");
  ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, "/one/3", true));
  EXPECT_NE(Metadata("/one/3").FindTensor("only.rank2"), nullptr);
}

// A name that becomes an object while it is a tensor of the cached plan is refused exactly as
// without a cache.
TEST_F(PlanCacheTest, AnObjectNamedLikeACachedTensorIsRefused) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {4, 4}, 70);
  w.save.ranks = {{Piece{Box({0, 0}, {2, 4}), 0}}, {Piece{Box({2, 0}, {2, 4}), 0}}, {}};
  w.load = MeshOf(w.shape, Mesh({1}, {Placement::Replicate()}));
  Case c = MakeCase({w}, 3, 1);
  c.lists_on_save[2][0] = false;  // rank 2 holds none of w
  SavePlanCache cache;
  c.save_options.plan_cache = &cache;
  ASSERT_NO_FATAL_FAILURE(SaveOk(c, "/obj/0"));
  c.objects.push_back(ObjectCase{
      "w", {ObjectEntry{}, ObjectEntry{}, ObjectEntry{"w", ObjectEncoding::kJson, "1"}}});
  Result<RankBuffers> buffers = MakeBuffers(c, true, rng_);
  ASSERT_TRUE(buffers.ok());
  Status saved = SaveCase(c, *buffers, store_, &pool_, "/obj/1");
  EXPECT_EQ(saved.code(), StatusCode::kInvalidArgument) << saved;
  EXPECT_TRUE(HasText(saved.message(), "name 'w' is a tensor on rank 0 and an object on rank 2"))
      << saved;
  EXPECT_FALSE(store_.Exists("/obj/1/shardpoint.metadata").value());
  EXPECT_EQ(cache.hits(), 0u);
}

// Saves through one cache that alternate between the native and the torch-dcp formats: a save in
// the format of the one before takes the cached writes; one in the other format gets whole
// orders (its writer places the chunks otherwise); every one loads bit-exactly, and the native
// ones verify clean.
TEST_F(PlanCacheTest, SavesAlternatingFormatsThroughOneCacheStayExact) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {12, 6}, 90);
  w.save = MeshOf(w.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Shard(1)}));
  w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(0)}));
  TensorCase n = MakeTensor("n", DType::kBFloat16, {6}, 91);
  n.save = MeshOf(n.shape, Mesh({4}, {Placement::Replicate()}));
  n.load = MeshOf(n.shape, Mesh({3}, {Placement::Replicate()}));
  Case c = MakeCase({w, n}, 4, 3);
  std::vector<SaveStats> stats(4);
  c.save_stats = &stats;
  SavePlanCache cache(0);  // keeps even this small plan as its file
  const CheckpointFormat formats[] = {CheckpointFormat::kNative, CheckpointFormat::kNative,
                                      CheckpointFormat::kTorchDcp, CheckpointFormat::kTorchDcp,
                                      CheckpointFormat::kNative, CheckpointFormat::kNative,
                                      CheckpointFormat::kTorchDcp};
  const int kExchanges[] = {2, 1, 3, 1, 1, 1, 1};
  for (size_t k = 0; k < std::size(formats); ++k) {
    SCOPED_TRACE("save " + std::to_string(k));
    c.save_options.format = formats[k];
    NewValues(&c, 1 + k);
    const std::string path = "/alternate/" + std::to_string(k);
    ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, path, k > 0 && formats[k] == formats[k - 1]));
    // After the first save the ranks send the id of their cached plan. Save 0 also sends a shared
    // part the coordinator asks for (2 exchanges). The native plan it makes is kept without the
    // ranks' writes (their files are renamed), so save 2 cannot lay it out again for torch-dcp:
    // it asks for the ranks' plans and then a shared part (3). Save 2's plan is kept with the
    // writes (torch-dcp moves chunks), and saves 4 and 6 lay it out again in one exchange.
    EXPECT_EQ(stats[0].plan_exchanges, kExchanges[k]);
    for (const SaveStats& s : stats) EXPECT_EQ(s.plan_exchanges, stats[0].plan_exchanges);
    ASSERT_NO_FATAL_FAILURE(LoadOk(c, path));
    ExpectLoaded(c, initial_, loaded_);
    if (formats[k] == CheckpointFormat::kNative) {
      // A native plan is kept as its committed file (saves 4 and 5 take save 2's torch-dcp plan,
      // which is kept whole, writes and all).
      if (k < 2) ExpectPlanKeptAsItsFile(cache, path);
      Result<VerifyReport> verified = Verify(path, &store_);
      ASSERT_TRUE(verified.ok()) << verified.status();
      EXPECT_TRUE(verified->ok()) << (verified->defects.empty() ? "" : verified->defects[0]);
    }
  }
}

// A cache keeps a plan whose chunk lists take no more than its threshold whole between saves
// (the default: 64 MiB), and the next save takes it without decoding anything.
TEST_F(PlanCacheTest, ASmallPlanIsKeptWholeByDefault) {
  TensorCase w = MakeTensor("w", DType::kFloat32, {12, 8}, 70);
  w.save = MeshOf(w.shape, Mesh({2, 2}, {Placement::Shard(0), Placement::Shard(1)}));
  w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(1)}));
  Case c = MakeCase({w}, 4, 3);
  // A native plan holds the tensor's four chunks, a grid, as four cells of 12 bytes each (its
  // file and offset; SavePlanOptions::chunk_cells): kept whole at the threshold, as the file above
  // it.
  const uint64_t cells_bytes = 4 * (sizeof(uint32_t) + sizeof(uint64_t));
  for (uint64_t above : {SavePlanCache::kDefaultKeepFileAboveBytes, cells_bytes}) {
    SCOPED_TRACE("keep_file_above_bytes " + std::to_string(above));
    SavePlanCache cache(above);
    const std::string dir = "/small" + std::to_string(above);
    ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, dir + "/0", false));
    EXPECT_EQ(cache.plan_bytes(), cells_bytes);
    NewValues(&c, 5);
    ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, dir + "/1", true));
    EXPECT_EQ(cache.plan_bytes(), cells_bytes);
    ASSERT_NO_FATAL_FAILURE(LoadOk(c, dir + "/1"));
    ExpectLoaded(c, initial_, loaded_);
  }
  SavePlanCache cache(cells_bytes - 1);
  ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, "/small/file", false));
  ExpectPlanKeptAsItsFile(cache, "/small/file");
}

// A cached plan serves torch-dcp saves too (whose writer frames and names the files itself).
TEST_F(PlanCacheTest, TorchDcpSavesTakeTheCachedPlan) {
  TensorCase w = MakeTensor("w", DType::kBFloat16, {10, 6}, 80);
  w.save = MeshOf(w.shape, Mesh({2, 2}, {Placement::Shard(1), Placement::Replicate()}));
  w.load = MeshOf(w.shape, Mesh({3}, {Placement::Shard(0)}));
  Case c = MakeCase({w}, 4, 3);
  c.save_options.format = CheckpointFormat::kTorchDcp;
  SavePlanCache cache;
  ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, "/dcp/0", false));
  NewValues(&c, 7);
  ASSERT_NO_FATAL_FAILURE(SaveThrough(c, cache, "/dcp/0", true));
  ASSERT_NO_FATAL_FAILURE(LoadOk(c, "/dcp/0"));
  ExpectLoaded(c, initial_, loaded_);
}
}  // namespace
}  // namespace sp
