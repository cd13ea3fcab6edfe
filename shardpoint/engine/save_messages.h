// The messages of a save that travel between ranks as bytes.
//
// RankWriteOrder: coordinator -> rank, what to write (the rank's plan and its files' headers).
// WriteReport: rank -> coordinator, the block checksums of every chunk written.
// Decoders are bounds-checked: hostile bytes give kDataLoss, never a crash.
#ifndef SHARDPOINT_ENGINE_SAVE_MESSAGES_H_
#define SHARDPOINT_ENGINE_SAVE_MESSAGES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

struct FileOrder {
  uint32_t index = 0;   // into the checkpoint's file list
  std::string name;     // relative to the checkpoint directory
  std::string header;   // bytes written at offset 0 (CheckpointWriter::LayOutFiles); its length
                        // is the file's data_start
  uint64_t size = 0;    // final file size
};

struct RankWriteOrder {
  CheckpointFormat format = CheckpointFormat::kNative;  // how chunks are framed in the files
  RankSavePlan plan;
  std::vector<FileOrder> files;
};

struct ChunkReport {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  std::vector<uint32_t> block_crc32c;
};

struct WriteReport {
  std::vector<ChunkReport> chunks;
};

std::string EncodeRankWriteOrder(const RankWriteOrder& order);
Result<RankWriteOrder> DecodeRankWriteOrder(std::string_view bytes);
std::string EncodeWriteReport(const WriteReport& report);
Result<WriteReport> DecodeWriteReport(std::string_view bytes);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_SAVE_MESSAGES_H_
