#include "shardpoint/format/metadata.h"

#include <algorithm>

namespace sp {

const TensorMetadata* CheckpointMetadata::FindTensor(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorMetadata& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

const ObjectEntry* CheckpointMetadata::FindObject(std::string_view name) const {
  auto it = std::lower_bound(objects.begin(), objects.end(), name,
                             [](const ObjectEntry& o, std::string_view n) { return o.name < n; });
  return it != objects.end() && it->name == name ? &*it : nullptr;
}

}  // namespace sp
