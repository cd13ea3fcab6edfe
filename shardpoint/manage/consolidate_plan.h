// Consolidation planning: which tensors go to which output file, under which name and dtype, at
// which byte offset. Pure: metadata and options in, plan out; no I/O. See consolidate.h for the
// outputs this describes. Thread-safe.
#ifndef SHARDPOINT_MANAGE_CONSOLIDATE_PLAN_H_
#define SHARDPOINT_MANAGE_CONSOLIDATE_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/manage/consolidate.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp {

struct OutputTensor {
  std::string name;                        // in the output
  const TensorMetadata* source = nullptr;  // points into the source metadata
  DType dtype = DType::kFloat32;           // in the output
  uint64_t bytes = 0;                      // volume * DTypeSize(dtype)
  uint64_t file_offset = 0;                // of its first byte in its output file
};

struct OutputFile {
  std::string name;
  std::vector<OutputTensor> tensors;  // in file order
  std::string head;                   // bytes at offset 0 (safetensors header, archive head)
  uint64_t size = 0;                  // total bytes
  // Torch files: the archive layout, whose framing after each tensor needs its CRC-32.
  std::shared_ptr<const torch_save::TorchSaveLayout> torch;
};

struct ConsolidationPlan {
  std::vector<OutputFile> files;
  std::string index_name;  // empty when there is a single file
  std::string index_json;
  uint64_t total_bytes = 0;  // tensor bytes over all files
  uint64_t tensors = 0;
  std::string selection;  // ConsolidateResult::selection
};

// The output names of `format`: the single file, the index, and the k-th (1-based) of n shards.
std::string SingleFileName(ConsolidateFormat format);
std::string IndexFileName(ConsolidateFormat format);
std::string ShardFileName(ConsolidateFormat format, size_t k, size_t n);
// True for a name `format` may write (single, index or any shard name), for overwrite checks.
bool IsOutputFileName(ConsolidateFormat format, std::string_view name);

// Selects, renames and types the tensors (sorted by output name); `selection`, when given,
// receives the sentence that says what was selected. Errors as Consolidate's kNotFound /
// kInvalidArgument cases.
Result<std::vector<OutputTensor>> SelectOutputTensors(const CheckpointMetadata& metadata,
                                                      const ConsolidateOptions& options,
                                                      std::string* selection = nullptr);

// Groups tensors into shards of at most `max_shard_bytes` (a larger tensor alone in its shard).
std::vector<std::vector<OutputTensor>> SplitIntoShards(std::vector<OutputTensor> tensors,
                                                       uint64_t max_shard_bytes);

// The whole plan: names, headers (safetensors: {"format": "pt"} metadata; torch: the torch.save
// archive of the shard's dict), offsets and the index.
Result<ConsolidationPlan> PlanConsolidation(const CheckpointMetadata& metadata,
                                            const ConsolidateOptions& options);

// {"metadata": {"total_size": N}, "weight_map": {...}} with two-space indents and sorted keys, as
// Hugging Face writes it.
std::string BuildIndexJson(const std::vector<OutputFile>& files, uint64_t total_bytes);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_CONSOLIDATE_PLAN_H_
