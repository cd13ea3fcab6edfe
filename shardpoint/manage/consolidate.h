// Consolidation: any checkpoint shardpoint reads, written as whole tensors in the files serving
// tools expect.
//
// Outputs (Hugging Face's names and size-based sharding, as `save_pretrained(max_shard_size=...)`):
//  - safetensors: `model.safetensors` when everything fits in one shard, else
//    `model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json`
//    ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}});
//  - torch: `pytorch_model.bin`, or `pytorch_model-0000K-of-0000N.bin` plus
//    `pytorch_model.bin.index.json` (torch.save archives; see format/torch_dcp/torch_save.h).
// Tensors are assigned to shards in name order: a shard is closed when the next tensor would take
// it past max_shard_bytes; a tensor larger than that gets a shard of its own.
//
// Streaming with bounded memory: every output file's layout is computed up front from the
// source's metadata, each file is created under a temporary hidden name (".NAME.partial") and
// preallocated, and tensors are read in row slabs (through the load engine: resharding, casts,
// verified checksums) straight into their place in the file. Memory beyond the metadata stays
// under `memory_budget_bytes` whatever the tensor and checkpoint sizes. A file is renamed to its
// final name only once complete and synced; the index is written last. A failure removes the
// temporaries and leaves earlier outputs untouched.
//
// Thread-safety: one call at a time per output directory; the call uses `pool` (or its own).
#ifndef SHARDPOINT_MANAGE_CONSOLIDATE_H_
#define SHARDPOINT_MANAGE_CONSOLIDATE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/mapped_metadata.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/store/store.h"

namespace sp {

enum class ConsolidateFormat : uint8_t { kSafetensors, kTorch };

// Hugging Face's default max_shard_size, "5GB".
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;

struct ConsolidateOptions {
  // A key mapping applied to the source's metadata before anything else (mapped_metadata.h):
  // fused targets are read straight from their stored tensors, slab by slab like any tensor, and
  // selection, renaming and dtype below apply to the target names. Empty: the stored tensors.
  MetadataMapping mapping;
  ConsolidateFormat format = ConsolidateFormat::kSafetensors;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  // Floating-point tensors (float16, bfloat16, float32, float64) are converted to this dtype with
  // torch's rounding (`tensor.to(dtype)`); other tensors keep theirs. Unset: no conversion.
  std::optional<DType> dtype;
  // Selection. A key selects the tensor of that name and every tensor under it
  // ("model.layers.0" selects "model.layers.0.mlp.w1"); a prefix selects every name that starts
  // with it. A key or prefix that selects nothing is an error. Both empty: the model weights when
  // the checkpoint separates them from the training state (consolidate_select.h), else every
  // tensor; `all_tensors` exports every tensor regardless.
  std::vector<std::string> keys;
  std::vector<std::string> prefixes;
  bool all_tensors = false;
  // Renaming of the selected tensors: the first pair whose first element starts the name replaces
  // that start with the second element.
  std::vector<std::pair<std::string, std::string>> rename;
  bool overwrite = false;   // replace existing outputs of the same format in the directory
  Store* store = nullptr;   // null: the store for the source's URL (also used for the output)
  ThreadPool* pool = nullptr;
  int threads = 0;          // 0: DefaultIoThreads()
  uint64_t memory_budget_bytes = kDefaultMemoryBudgetBytes;  // shardpoint/checkpoint.h
  // Called with (bytes written, total bytes) as tensors land, from worker threads, one call at a
  // time, at most about every 1% of the total; and once at the end.
  std::function<void(uint64_t, uint64_t)> progress;
};

struct ConsolidateResult {
  std::vector<std::string> files;  // the data files written, in shard order
  std::string index_file;          // empty when there is one data file
  uint64_t tensors = 0;
  uint64_t total_bytes = 0;        // tensor bytes written (the index's total_size)
  uint64_t bytes_read = 0;         // bytes read from the source
  std::string selection;           // what was exported and what was left out, in a sentence
};

// Consolidates the checkpoint at `source` (any format ReadCheckpointMetadata opens) into
// `out_dir` (created when absent). Errors:
//   kNotFound: no checkpoint at `source`; a key or prefix that selects nothing; a stored tensor
//     the mapping names missing;
//   kAlreadyExists: an output of this format already in `out_dir` (without `overwrite`);
//   kInvalidArgument: a mapping whose placements do not tile their targets (MapCheckpointMetadata);
//     out_dir is the source; two tensors renamed to one name; a conversion the
//     dtype policy refuses (complex); max_shard_bytes or the budget is 0;
//   kUnimplemented: the torch format for a dtype torch.save archives cannot hold here;
//   read errors of the source (kDataLoss naming file and tensor), write errors naming the file.
Result<ConsolidateResult> Consolidate(std::string_view source, std::string_view out_dir,
                                      const ConsolidateOptions& options);

// Parses a size as Hugging Face writes max_shard_size: an integer number of bytes ("1000"), or a
// number (decimals allowed) with a unit: KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB
// (powers of 1024), case-insensitive, optional space ("5GB", "500MB", "2GiB", "1.5 GB").
// kInvalidArgument naming the text for anything else, for 0 and for sizes past 2^63.
Result<uint64_t> ParseByteSize(std::string_view text);

// Parses a dtype name for conversion: torch names and aliases ("bfloat16", "half"), safetensors
// names in either case ("BF16", "bf16"), and "fp16", "fp32", "fp64". kInvalidArgument otherwise.
Result<DType> ParseConsolidateDType(std::string_view text);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_CONSOLIDATE_H_
