#include "shardpoint/plan/ruled_plan.h"

#include <algorithm>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/plan/plan_codec_internal.h"

namespace sp {
namespace {

using plan_codec_internal::ExpectDone;
using plan_codec_internal::kMaxNameBytes;
using plan_codec_internal::kMinObjectBytes;
using plan_codec_internal::PutBoxList;
using plan_codec_internal::PutI64List;
using plan_codec_internal::PutObject;
using plan_codec_internal::ReadBoxList;
using plan_codec_internal::ReadI64List;
using plan_codec_internal::ReadObject;
using plan_codec_internal::Seal;

constexpr uint32_t kRuledPlanMagic = 0x31524C53;  // "SLR1"
// Smallest encodings, used to bound counts by the bytes that remain.
constexpr size_t kMinRuleBytes = 3 * 4;
constexpr size_t kPlacementBytes = 1 + 2 * 4;
constexpr size_t kRunBytes = 2 * 8 + 4;
constexpr size_t kMinTensorBytes = 4 + 1 + 4 + 4;
constexpr uint32_t kMaxInt32 = std::numeric_limits<int32_t>::max();

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string BoxesToString(std::span<const Box> boxes) {
  if (boxes.empty()) return "no piece";
  std::string out = boxes.size() == 1 ? "piece " : "pieces ";
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (i) out += ", ";
    out += boxes[i].ToString();
  }
  return out;
}

// The rank list as runs of equal steps.
void PutRankRuns(ByteWriter& w, const std::vector<int64_t>& ranks) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first, step) and count below
  std::vector<uint32_t> counts;
  for (size_t i = 0; i < ranks.size();) {
    size_t count = 1;
    int64_t step = 0;
    if (i + 1 < ranks.size()) {
      step = ranks[i + 1] - ranks[i];
      count = 2;
      while (i + count < ranks.size() && ranks[i + count] - ranks[i + count - 1] == step) ++count;
    }
    runs.push_back({ranks[i], step});
    counts.push_back(static_cast<uint32_t>(count));
    i += count;
  }
  w.PutU32(static_cast<uint32_t>(runs.size()));
  for (size_t i = 0; i < runs.size(); ++i) {
    w.PutI64(runs[i].first);
    w.PutI64(runs[i].second);
    w.PutU32(counts[i]);
  }
}

void PutRule(ByteWriter& w, const MeshLayout& layout) {
  PutI64List(w, layout.mesh_shape);
  w.PutU32(static_cast<uint32_t>(layout.placements.size()));
  for (const Placement& p : layout.placements) {
    w.PutU8(static_cast<uint8_t>(p.kind));
    w.PutU32(static_cast<uint32_t>(p.dim));
    w.PutU32(static_cast<uint32_t>(p.split_factor));
  }
  PutRankRuns(w, layout.rank_list);
}

std::string EncodeSharedPart(const LocalSavePlan& plan) {
  std::string rules;
  std::string tensors;
  ByteWriter rw(&rules);
  ByteWriter tw(&tensors);
  std::map<std::string, uint32_t> rule_ids;  // a rule's bytes -> its number (1-based)
  std::string rule;
  const MeshLayout* previous = nullptr;  // most tensors share the previous tensor's rule
  uint32_t previous_id = 0;
  tw.PutU32(static_cast<uint32_t>(plan.tensors.size()));
  for (const LocalTensor& t : plan.tensors) {
    uint32_t id = 0;
    if (t.layout && previous != nullptr && *t.layout == *previous) {
      id = previous_id;
    } else if (t.layout) {
      rule.clear();
      ByteWriter one(&rule);
      PutRule(one, *t.layout);
      auto [it, inserted] = rule_ids.try_emplace(rule, static_cast<uint32_t>(rule_ids.size() + 1));
      if (inserted) rw.PutRaw(rule);
      id = it->second;
      previous = &*t.layout;
      previous_id = id;
    }
    tw.PutString(t.name);
    tw.PutU8(DTypeCode(t.dtype));
    PutI64List(tw, t.shape);
    tw.PutU32(id);
  }
  std::string out;
  ByteWriter w(&out);
  w.PutU32(static_cast<uint32_t>(rule_ids.size()));
  w.PutRaw(rules);
  w.PutRaw(tensors);
  return out;
}

// Reads the runs of a rank list; at most `world_size` ranks, each in [0, world_size).
Status ReadRankRuns(ByteReader& r, size_t world_size, std::vector<int64_t>* ranks) {
  SP_ASSIGN_OR_RETURN(uint32_t num_runs, r.ReadCount(kRunBytes));
  const int64_t world = static_cast<int64_t>(world_size);
  ranks->clear();
  for (uint32_t i = 0; i < num_runs; ++i) {
    SP_ASSIGN_OR_RETURN(int64_t first, r.ReadI64());
    SP_ASSIGN_OR_RETURN(int64_t step, r.ReadI64());
    SP_ASSIGN_OR_RETURN(uint32_t count, r.ReadU32());
    if (count == 0 || count > world_size - ranks->size() || step < -world || step > world ||
        first < 0 || first >= world) {
      return DataLossError(r.what() + ": a mesh's rank run (first " + std::to_string(first) +
                           ", step " + std::to_string(step) + ", count " + std::to_string(count) +
                           ") does not fit a job of " + std::to_string(world_size) + " ranks");
    }
    for (uint32_t k = 0; k < count; ++k) {
      const int64_t rank = first + step * static_cast<int64_t>(k);
      if (rank < 0 || rank >= world) {
        return DataLossError(r.what() + ": a mesh names rank " + std::to_string(rank) +
                             ", outside a job of " + std::to_string(world_size) + " ranks");
      }
      ranks->push_back(rank);
    }
  }
  return OkStatus();
}

Result<MeshLayout> ReadRule(ByteReader& r, size_t world_size) {
  MeshLayout layout;
  SP_RETURN_IF_ERROR(ReadI64List(r, &layout.mesh_shape));
  int64_t volume = 1;
  for (int64_t n : layout.mesh_shape) {
    if (n <= 0 || __builtin_mul_overflow(volume, n, &volume) ||
        volume > static_cast<int64_t>(world_size)) {
      return DataLossError(r.what() + ": mesh " + ShapeToString(layout.mesh_shape) +
                           " has a size that is not positive or more positions than the job's " +
                           std::to_string(world_size) + " ranks");
    }
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_placements, r.ReadCount(kPlacementBytes));
  layout.placements.resize(num_placements);
  for (Placement& p : layout.placements) {
    SP_ASSIGN_OR_RETURN(uint8_t kind, r.ReadU8());
    SP_ASSIGN_OR_RETURN(uint32_t dim, r.ReadU32());
    SP_ASSIGN_OR_RETURN(uint32_t split_factor, r.ReadU32());
    if (kind > static_cast<uint8_t>(Placement::Kind::kStridedShard) || dim > kMaxInt32 ||
        split_factor > kMaxInt32) {
      return DataLossError(r.what() + ": a placement has kind " + std::to_string(kind) +
                           ", dim " + std::to_string(dim) + ", split factor " +
                           std::to_string(split_factor));
    }
    p = Placement{static_cast<Placement::Kind>(kind), static_cast<int>(dim),
                  static_cast<int>(split_factor)};
  }
  SP_RETURN_IF_ERROR(ReadRankRuns(r, world_size, &layout.rank_list));
  return layout;
}

}  // namespace

Status CheckRuledBoxes(int64_t rank, LocalTensor* tensor) {
  if (!tensor->layout) return OkStatus();
  const MeshLayout& layout = *tensor->layout;
  Result<std::optional<Box>> chunk = MeshChunkForRank(tensor->shape, layout, rank);
  if (!chunk.ok()) {
    return InvalidArgumentError("tensor " + Quote(tensor->name) + ": " +
                                std::string(chunk.status().message()));
  }
  const std::string where = "tensor " + Quote(tensor->name) + ": rank " + std::to_string(rank);
  if (!chunk->has_value()) {
    return InvalidArgumentError(where + " is not in the mesh of its layout (" +
                                LayoutToString(layout) + ")");
  }
  const Box& expected = **chunk;
  const std::vector<Box>& boxes = tensor->boxes;
  const bool matches = expected.empty()
                           ? boxes.size() <= 1 && (boxes.empty() || boxes[0].empty())
                           : boxes.size() == 1 && boxes[0] == expected;
  if (!matches) {
    return InvalidArgumentError(where + " holds " + BoxesToString(boxes) + ", but its layout (" +
                                LayoutToString(layout) + ") gives it the chunk " +
                                expected.ToString());
  }
  tensor->boxes.assign(1, expected);
  return OkStatus();
}

Fingerprint128 SharedPartDigest(const LocalSavePlan& plan) {
  return Fingerprint(EncodeSharedPart(plan));
}

std::string EncodeRuledLocalPlan(const LocalSavePlan& plan, bool with_shared) {
  const std::string shared = EncodeSharedPart(plan);
  const Fingerprint128 digest = Fingerprint(shared);
  std::string out;
  ByteWriter w(&out);
  w.PutU32(kRuledPlanMagic);
  w.PutU64(digest.low);
  w.PutU64(digest.high);
  w.PutU8(with_shared ? 1 : 0);
  if (with_shared) w.PutString(shared);
  uint32_t ruleless = 0;
  for (const LocalTensor& t : plan.tensors) ruleless += t.layout ? 0 : 1;
  w.PutU32(ruleless);
  for (const LocalTensor& t : plan.tensors) {
    if (!t.layout) PutBoxList(w, t.boxes);
  }
  w.PutU32(static_cast<uint32_t>(plan.objects.size()));
  for (const ObjectEntry& object : plan.objects) PutObject(w, object);
  return Seal(std::move(out));
}

bool SendsSharedPart(const LocalSavePlan& plan, int64_t rank, int64_t coordinator) {
  for (const LocalTensor& t : plan.tensors) {
    if (!t.layout) continue;
    const std::vector<int64_t>& ranks = t.layout->rank_list;
    if (ranks.empty()) return rank == 0;
    return rank == *std::min_element(ranks.begin(), ranks.end());
  }
  return rank == coordinator;
}

// One shared part, decoded; once a rank of it is expanded, also a part of the GatheredPlans.
struct SharedPlans::Part {
  struct Rule {
    MeshLayout layout;
    std::vector<std::pair<int64_t, int64_t>> positions;  // (rank, position), sorted by rank
  };
  struct Tensor {
    std::string name;
    DType dtype = DType::kFloat32;
    Shape shape;
    uint32_t rule = 0;  // 0: none; else rules[rule - 1]
  };
  std::vector<Rule> rules;
  std::vector<Tensor> tensors;
  // Set by the first Expand: the part in the GatheredPlans, and for each rule the first tensor
  // that follows it (kUnset: none), which a rank outside that rule's mesh is refused for.
  uint32_t table_part = GatheredPlans::kUnset;
  std::vector<uint32_t> first_tensor_of_rule;
};

SharedPlans::SharedPlans(size_t world_size) : world_size_(world_size) {}
SharedPlans::~SharedPlans() = default;

Result<SharedPlans::Message> SharedPlans::Open(std::string_view bytes) {
  SP_ASSIGN_OR_RETURN(
      ByteReader r, plan_codec_internal::Open(bytes, kRuledPlanMagic,
                                              "ruled local save plan of " +
                                                  std::to_string(bytes.size()) + " bytes"));
  Message message;
  SP_ASSIGN_OR_RETURN(message.digest.low, r.ReadU64());
  SP_ASSIGN_OR_RETURN(message.digest.high, r.ReadU64());
  SP_ASSIGN_OR_RETURN(uint8_t has_shared, r.ReadU8());
  if (has_shared > 1) {
    return DataLossError(r.what() + ": bad shared-part flag " + std::to_string(has_shared));
  }
  if (has_shared) {
    SP_ASSIGN_OR_RETURN(message.shared, r.ReadString(plan_codec_internal::kMaxPayloadBytes));
  }
  SP_ASSIGN_OR_RETURN(message.own, r.ReadRaw(r.remaining()));
  return message;
}

bool SharedPlans::Has(const Fingerprint128& digest) const { return parts_.count(digest) > 0; }

Status SharedPlans::Add(const Message& message) {
  if (!message.shared || Has(message.digest)) return OkStatus();
  const Fingerprint128 actual = Fingerprint(*message.shared);
  if (actual != message.digest) {
    return DataLossError("ruled local save plan: its shared part has digest " + actual.ToHex() +
                         ", but the message says " + message.digest.ToHex());
  }
  ByteReader r(*message.shared, "shared part " + message.digest.ToHex());
  auto part = std::make_unique<Part>();
  SP_ASSIGN_OR_RETURN(uint32_t num_rules, r.ReadCount(kMinRuleBytes));
  part->rules.resize(num_rules);
  for (Part::Rule& rule : part->rules) {
    SP_ASSIGN_OR_RETURN(rule.layout, ReadRule(r, world_size_));
    const std::vector<int64_t>& ranks = rule.layout.rank_list;
    int64_t volume = 1;
    for (int64_t n : rule.layout.mesh_shape) volume *= n;  // checked by ReadRule
    if (!ranks.empty() && static_cast<int64_t>(ranks.size()) != volume) {
      return DataLossError(r.what() + ": mesh " + ShapeToString(rule.layout.mesh_shape) +
                           " lists " + std::to_string(ranks.size()) + " ranks for " +
                           std::to_string(volume) + " positions");
    }
    rule.positions.resize(volume);
    for (int64_t p = 0; p < volume; ++p) {
      rule.positions[p] = {ranks.empty() ? p : ranks[p], p};
    }
    std::sort(rule.positions.begin(), rule.positions.end());
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_tensors, r.ReadCount(kMinTensorBytes));
  part->tensors.resize(num_tensors);
  for (Part::Tensor& t : part->tensors) {
    SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString(kMaxNameBytes));
    t.name = std::string(name);
    SP_ASSIGN_OR_RETURN(uint8_t code, r.ReadU8());
    Result<DType> dtype = DTypeFromCode(code);
    if (!dtype.ok()) {
      return DataLossError(r.what() + ": tensor " + Quote(t.name) + " has unknown dtype code " +
                           std::to_string(code));
    }
    t.dtype = *dtype;
    SP_RETURN_IF_ERROR(ReadI64List(r, &t.shape));
    SP_ASSIGN_OR_RETURN(t.rule, r.ReadU32());
    if (t.rule > num_rules) {
      return DataLossError(r.what() + ": tensor " + Quote(t.name) + " refers to rule " +
                           std::to_string(t.rule) + " of " + std::to_string(num_rules));
    }
  }
  SP_RETURN_IF_ERROR(ExpectDone(r));
  parts_.emplace(message.digest, std::move(part));
  return OkStatus();
}

Status SharedPlans::AddToTable(Part& part, GatheredPlans* plans) {
  std::vector<GatheredPlans::Rule> rules(part.rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    rules[i].rank_at.resize(part.rules[i].positions.size());
    for (const auto& [rank, position] : part.rules[i].positions) {
      rules[i].rank_at[position] = rank;
    }
  }
  const uint32_t id = plans->AddPart(std::move(rules));
  part.first_tensor_of_rule.assign(part.rules.size(), GatheredPlans::kUnset);
  // A rule's chunks are stored once for every tensor of its shape.
  std::map<std::pair<uint32_t, Shape>, uint64_t> chunks_of;
  for (uint32_t i = 0; i < part.tensors.size(); ++i) {
    const Part::Tensor& t = part.tensors[i];
    if (t.rule == 0) continue;
    uint32_t& first = part.first_tensor_of_rule[t.rule - 1];
    if (first == GatheredPlans::kUnset) first = i;
    auto it = chunks_of.find({t.rule, t.shape});
    if (it == chunks_of.end()) {
      Result<std::vector<Box>> chunks = MeshChunksPerRank(t.shape, part.rules[t.rule - 1].layout);
      if (!chunks.ok()) {
        return InvalidArgumentError("tensor " + Quote(t.name) + ": " +
                                    std::string(chunks.status().message()));
      }
      it = chunks_of.emplace(std::pair{t.rule, t.shape}, plans->AddSharedBoxes(*chunks)).first;
    }
    plans->AddRuledTensor(id, t.name, t.dtype, t.shape, i, t.rule - 1, it->second);
  }
  part.table_part = id;
  return OkStatus();
}

Status SharedPlans::Expand(const Message& message, uint32_t rank, GatheredPlans* plans) {
  if (into_ == nullptr) into_ = plans;
  if (into_ != plans) {
    return InternalError("ruled plans are expanded into one table, not several");
  }
  auto found = parts_.find(message.digest);
  if (found == parts_.end()) {
    return InternalError("rank " + std::to_string(rank) + " sent shared part " +
                         message.digest.ToHex() + ", which no rank sent");
  }
  Part& part = *found->second;
  // This rank's position in each mesh (-1: not in it).
  std::vector<int64_t> position(part.rules.size(), -1);
  for (size_t i = 0; i < part.rules.size(); ++i) {
    const auto& positions = part.rules[i].positions;
    auto it = std::lower_bound(positions.begin(), positions.end(),
                               std::pair<int64_t, int64_t>{rank, -1});
    if (it != positions.end() && it->first == rank) position[i] = it->second;
  }
  ByteReader r(message.own, "own part of the ruled save plan of rank " + std::to_string(rank));
  SP_ASSIGN_OR_RETURN(uint32_t ruleless, r.ReadU32());
  size_t expected = 0;
  for (const Part::Tensor& t : part.tensors) expected += t.rule == 0 ? 1 : 0;
  if (ruleless != expected) {
    return DataLossError(r.what() + ": " + std::to_string(ruleless) +
                         " tensors without a rule, but its shared part has " +
                         std::to_string(expected));
  }
  if (part.table_part == GatheredPlans::kUnset) SP_RETURN_IF_ERROR(AddToTable(part, plans));
  plans->BeginRank();
  plans->UsePart(part.table_part);
  std::vector<Box> boxes;
  for (uint32_t i = 0; i < part.tensors.size(); ++i) {
    const Part::Tensor& t = part.tensors[i];
    if (t.rule == 0) {
      SP_RETURN_IF_ERROR(ReadBoxList(r, &boxes));
      plans->AddTensor(t.name, t.dtype, t.shape, boxes, i);
    } else if (part.first_tensor_of_rule[t.rule - 1] == i && position[t.rule - 1] < 0) {
      return InvalidArgumentError("tensor " + Quote(t.name) + ": rank " + std::to_string(rank) +
                                  " is not in the mesh of its layout (" +
                                  LayoutToString(part.rules[t.rule - 1].layout) + ")");
    }
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_objects, r.ReadCount(kMinObjectBytes));
  for (uint32_t i = 0; i < num_objects; ++i) {
    SP_ASSIGN_OR_RETURN(ObjectEntry object, ReadObject(r));
    plans->AddObject(std::move(object));
  }
  return ExpectDone(r);
}

}  // namespace sp
