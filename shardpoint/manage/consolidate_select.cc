#include "shardpoint/manage/consolidate_select.h"

#include <algorithm>
#include <map>

namespace sp {
namespace {

constexpr std::string_view kTrainingState[] = {
    "optimizer", "optimizers",    "optim",     "optim_state", "optimizer_state",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader",
    "train_state",  "rng_state",     "scaler",    "grad_scaler"};

constexpr std::string_view kModelPrefix = "model.";

std::string_view FirstComponent(std::string_view name) {
  return name.substr(0, name.find('.'));
}

bool IsTrainingState(std::string_view name) {
  const std::string_view first = FirstComponent(name);
  return std::find(std::begin(kTrainingState), std::end(kTrainingState), first) !=
         std::end(kTrainingState);
}

std::string Plural(size_t n, std::string_view word) {
  return std::to_string(n) + " " + std::string(word) + (n == 1 ? "" : "s");
}

}  // namespace

std::span<const std::string_view> TrainingStateComponents() { return kTrainingState; }

bool DefaultSelection::Selects(std::string_view name) const {
  if (everything) return true;
  if (IsTrainingState(name)) return false;
  return strip_prefix.empty() || name.starts_with(strip_prefix);
}

std::string DefaultSelection::OutputName(const std::string& name) const {
  if (everything || strip_prefix.empty()) return name;
  return name.substr(strip_prefix.size());
}

DefaultSelection SelectModelWeights(const CheckpointMetadata& metadata) {
  std::map<std::string, size_t> left_out;  // training-state component -> tensors
  size_t model = 0, under_model_prefix = 0;
  for (const TensorMetadata& t : metadata.tensors) {
    if (IsTrainingState(t.name)) {
      ++left_out[std::string(FirstComponent(t.name))];
      continue;
    }
    ++model;
    if (t.name.starts_with(kModelPrefix) && t.name.size() > kModelPrefix.size()) ++under_model_prefix;
  }
  DefaultSelection s;
  if (left_out.empty() || model == 0) {
    s.description = "exported every tensor (" + Plural(metadata.tensors.size(), "tensor") +
                    (left_out.empty() ? "; no training state to leave out)"
                                      : "; the checkpoint holds training state only)");
    return s;
  }
  s.everything = false;
  if (under_model_prefix == model) s.strip_prefix = std::string(kModelPrefix);
  s.description = "exported the model weights: " + Plural(model, "tensor") +
                  (s.strip_prefix.empty() ? " outside the training state"
                                          : " under 'model.' (the prefix removed)") +
                  "; left out the training state:";
  size_t i = 0;
  for (const auto& [component, n] : left_out) {
    s.description += (i++ ? ", " : " ") + component + " (" + Plural(n, "tensor") + ")";
  }
  s.description += "; pass keys or prefixes (or all tensors) to choose otherwise";
  return s;
}

}  // namespace sp
