// The one place a save's format picks its writer (writer.h).
#include "shardpoint/format/writer.h"

#include "shardpoint/format/native/native_writer.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint_writer.h"

namespace sp {

Result<std::unique_ptr<CheckpointWriter>> MakeCheckpointWriter(CheckpointFormat format,
                                                               bool megatron) {
  if (format != CheckpointFormat::kNative && format != CheckpointFormat::kTorchDcp) {
    return InvalidArgumentError("cannot save in the safetensors format (use consolidation)");
  }
  if (megatron && format != CheckpointFormat::kTorchDcp) {
    return InvalidArgumentError("a Megatron checkpoint is a torch-dcp checkpoint "
                                "(format kTorchDcp)");
  }
  if (format == CheckpointFormat::kNative) return MakeNativeWriter();
  return torch_dcp::MakeDcpCheckpointWriter(megatron);
}

std::vector<std::unique_ptr<CheckpointWriter>> AllCheckpointWriters() {
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  writers.push_back(MakeNativeWriter());
  writers.push_back(torch_dcp::MakeDcpCheckpointWriter(/*megatron=*/false));
  writers.push_back(torch_dcp::MakeDcpCheckpointWriter(/*megatron=*/true));
  return writers;
}

}  // namespace sp
