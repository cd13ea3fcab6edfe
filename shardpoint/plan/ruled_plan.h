// Ruled local plans: a rank's save plan sent as the part other ranks share and its own part.
//
// At thousands of ranks most ranks list the same tensors (names, dtypes, shapes) laid out by the
// same device-mesh rules, and only their boxes differ; a rule gives a rank's box from the rank
// alone. So a rank sends the coordinator
//   - the digest (base/fingerprint.h) of its shared part: its tensors in order, each with name,
//     dtype, shape and its mesh layout when it has one (LocalTensor::layout);
//   - the shared part itself only where asked to (or where it guesses it is the first of its
//     group: see SendsSharedPart);
//   - its own part: the boxes of its tensors without a rule, and its objects.
// The coordinator keeps one shared part per digest (SharedPlans) and rebuilds each rank's plan
// from it and the rank's own part, straight into GatheredPlans: the part's ruled tensors once for
// all its ranks (GatheredPlans::Part), each rank's tensors without a rule as it sent them. The
// plan is the one the ranks would have sent whole (EncodeLocalSavePlan), so planning, its checks
// and its errors are unchanged; what changes is that the names, shapes and rules of a group of
// ranks cross the network once instead of once per rank.
//
// Encoding (little-endian; strings and lists are a u32 count then the items; docs/DESIGN.md,
// save step 2):
//   message   := magic "SLR1", digest:u64 u64 (low, high), has_shared:u8, [shared:string],
//                own:list<boxes>, objects:list<object>, crc32c:u32 (of everything before it)
//   shared    := rules:list<rule>, tensors:list<tensor>
//     rule    := mesh_shape:list<i64>, placements:list<placement>, ranks:list<run>
//     placement := kind:u8 (0 Replicate, 1 Shard, 2 StridedShard) dim:u32 split_factor:u32
//     run     := first:i64 step:i64 count:u32   (rank_list is the runs concatenated; none: the
//                                               identity)
//     tensor  := name:string dtype:u8 shape:list<i64> rule:u32 (0: none; else rules[rule - 1])
//   boxes     := list<box> for each tensor without a rule, in order; box as in plan_codec.h
// The digest is over the shared bytes exactly. Like plan_codec.h, the format is internal to one
// job and decoders treat bytes as hostile: kDataLoss for structure, before anything large is
// allocated (a rule's mesh may not hold more positions than the job has ranks).
// All functions are thread-safe; a SharedPlans object is used by one thread.
#ifndef SHARDPOINT_PLAN_RULED_PLAN_H_
#define SHARDPOINT_PLAN_RULED_PLAN_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "shardpoint/base/fingerprint.h"
#include "shardpoint/base/result.h"
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

// Checks a tensor with a layout on rank `rank` and sets its boxes to the rule's: the rank must be
// in the mesh, and its boxes must be the rule's chunk for it (one box; none, or one empty box,
// where the chunk is empty). kInvalidArgument names the tensor, the rank, the layout, the chunk
// the rule gives and the boxes found. A tensor without a layout is left alone.
Status CheckRuledBoxes(int64_t rank, LocalTensor* tensor);

// The digest of `plan`'s shared part (what EncodeRuledLocalPlan puts in the message).
Fingerprint128 SharedPartDigest(const LocalSavePlan& plan);

// The message of `plan`, with its shared part when `with_shared`.
std::string EncodeRuledLocalPlan(const LocalSavePlan& plan, bool with_shared);

// Whether a rank sends its shared part unasked: when it is the lowest rank of the mesh of its
// first tensor with a layout, or, with no layout, when it is `coordinator`. Most groups of ranks
// that share a part then send it once; a group that does not is asked (PlanReply::kResendShared).
bool SendsSharedPart(const LocalSavePlan& plan, int64_t rank, int64_t coordinator);

// The coordinator's table of shared parts, by digest.
class SharedPlans {
 public:
  // `world_size`: the job's ranks (a rule may not name another rank or hold more positions).
  explicit SharedPlans(size_t world_size);
  ~SharedPlans();
  SharedPlans(const SharedPlans&) = delete;
  SharedPlans& operator=(const SharedPlans&) = delete;

  struct Message {
    Fingerprint128 digest;
    std::optional<std::string_view> shared;  // views the message's bytes
    std::string_view own;                    // the own part and objects (views the message)
  };
  // Opens a ruled message (checksum, magic, structure of the envelope). kDataLoss when bad. The
  // Message views `bytes`, which must outlive it.
  static Result<Message> Open(std::string_view bytes);

  // Registers a message's shared part, when it has one and its digest is new: checks the digest
  // against the bytes and decodes them. kDataLoss for a digest that does not match or bad bytes.
  Status Add(const Message& message);
  bool Has(const Fingerprint128& digest) const;

  // Appends `rank`'s plan to `plans` as its next rank (plans->world_size() == rank before): the
  // shared part of its digest (which must have been added) with the boxes of its own part and
  // its rules. A rule's chunks are stored in `plans` once, for all the ranks that use them, so
  // every call must pass the same `plans` (kInternal otherwise, and for a digest never added).
  // kDataLoss for an own part that does not fit the shared part; kInvalidArgument for a rule
  // that is malformed (naming the tensor) or does not hold `rank`.
  Status Expand(const Message& message, uint32_t rank, GatheredPlans* plans);

 private:
  struct Part;
  // Adds `part` to the table (GatheredPlans::AddPart) with its ruled tensors and their chunks.
  static Status AddToTable(Part& part, GatheredPlans* plans);
  size_t world_size_;
  const GatheredPlans* into_ = nullptr;  // the table every Expand fills
  std::map<Fingerprint128, std::unique_ptr<Part>> parts_;
};

}  // namespace sp

#endif  // SHARDPOINT_PLAN_RULED_PLAN_H_
