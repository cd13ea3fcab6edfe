// Which tensors a consolidation exports when the caller names none.
//
// A training checkpoint holds the model's weights beside the training state: optimizer moments,
// scheduler and data-loader state, step counters. Serving tools want the weights alone, so when
// the caller gives neither keys nor prefixes, and the checkpoint clearly separates the two, the
// weights are picked:
//  - the training state is every tensor whose first name component is one of
//    kTrainingStateComponents ("optimizer", "optim", "lr_scheduler", "train_state", ...);
//  - a checkpoint without such tensors is exported whole (nothing to separate);
//  - when every other tensor is under "model." (sp.save({"model": ..., "optimizer": ...})), the
//    tensors under "model." are exported with that prefix removed, which gives the model's own
//    names;
//  - otherwise (torchtitan keeps the model's names at the top level) every tensor outside the
//    training state is exported under its own name.
// The outcome says what was picked and what was left out, for the caller to report. Pure and
// thread-safe.
#ifndef SHARDPOINT_MANAGE_CONSOLIDATE_SELECT_H_
#define SHARDPOINT_MANAGE_CONSOLIDATE_SELECT_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "shardpoint/format/metadata.h"

namespace sp {

// First name components that hold training state rather than model weights.
std::span<const std::string_view> TrainingStateComponents();

struct DefaultSelection {
  bool everything = true;     // export every tensor under its own name
  std::string strip_prefix;   // when not everything: "model." or empty
  // A sentence for the caller: what was exported and what was left out.
  std::string description;

  // True when the tensor named `name` is exported.
  bool Selects(std::string_view name) const;
  // Its output name before any caller renames (the prefix removed when there is one).
  std::string OutputName(const std::string& name) const;
};

// The selection for `metadata` when no keys or prefixes are given.
DefaultSelection SelectModelWeights(const CheckpointMetadata& metadata);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_CONSOLIDATE_SELECT_H_
