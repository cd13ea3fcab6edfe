// Convert: rewrites a checkpoint of any format shardpoint reads as a native or PyTorch DCP
// checkpoint, tensor by tensor with bounded memory.
//
// The output keeps the source's chunks (each stored chunk becomes one output chunk, so a DCP
// checkpoint converted to native and back has the same items), its objects (PyTorch DCP's
// pickled objects stay torch.save archives, never unpickled) and its attributes (the nested
// state-dict paths among them). It is one streaming save (SaveOptions::fill_piece): each chunk is
// read from the source (verified when the source has checksums) into a buffer just before it is
// written, so the memory held is at most max(memory_budget_bytes, the largest chunk) plus the
// source's metadata. The output is committed atomically by the save protocol of its format; an
// existing checkpoint at the destination is replaced only with `overwrite`.
#ifndef SHARDPOINT_MANAGE_CONVERT_H_
#define SHARDPOINT_MANAGE_CONVERT_H_

#include <cstdint>
#include <functional>
#include <string_view>

#include "shardpoint/base/status.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

struct ConvertOptions {
  CheckpointFormat format = CheckpointFormat::kNative;  // kNative or kTorchDcp
  bool megatron = false;  // with kTorchDcp: a Megatron-Core torch_dist checkpoint (SaveOptions)
  bool overwrite = false;
  int threads = 0;                                    // 0: DefaultIoThreads()
  int files = 1;                                      // data files of the output
  uint64_t memory_budget_bytes = kDefaultMemoryBudgetBytes;
  Store* source_store = nullptr;                      // null: by the path
  Store* destination_store = nullptr;                 // null: by the path
  // Called from I/O threads with the bytes of each chunk once written, and the total to write.
  std::function<void(uint64_t bytes, uint64_t total)> progress;
};

struct ConvertReport {
  CheckpointFormat source_format = CheckpointFormat::kNative;
  uint64_t tensors = 0;
  uint64_t chunks = 0;
  uint64_t objects = 0;
  uint64_t bytes = 0;
};

// Errors: kNotFound when there is no checkpoint at `source`; kAlreadyExists when one is at
// `destination` and not `overwrite`; kInvalidArgument for the same path on both sides or an
// output format that cannot be written; the source's read errors (naming its files and tensors).
Result<ConvertReport> Convert(std::string_view source, std::string_view destination,
                              const ConvertOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_CONVERT_H_
