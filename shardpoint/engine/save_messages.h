// The messages of a save that travel between ranks as bytes.
//
// PlanRequest: rank -> coordinator, its local plan (ruled: plan/ruled_plan.h), or the id of the
// cached plan it still has.
// PlanReply: coordinator -> rank, a RankWriteOrder (whole, or its files only when the rank's
// cached writes stand), or the request to send the local plan (or its shared part) after all.
// RankWriteOrder: coordinator -> rank, what to write (the rank's plan and its files' headers).
// WriteReport: rank -> coordinator, the block checksums of every chunk written, and where the
// data of each of its files starts and ends.
// Decoders are bounds-checked: hostile bytes give kDataLoss, never a crash.
#ifndef SHARDPOINT_ENGINE_SAVE_MESSAGES_H_
#define SHARDPOINT_ENGINE_SAVE_MESSAGES_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

struct FileOrder {
  uint32_t index = 0;   // into the checkpoint's file list
  std::string name;     // relative to the checkpoint directory
  std::string header;   // bytes written at offset 0 (CheckpointWriter::LayOutFiles, or built by
                        // the rank where the format's ranks_build_headers()); its length is the
                        // file's data_start
  uint64_t size = 0;    // final file size (0 until the rank has built the header)
};

struct RankWriteOrder {
  CheckpointFormat format = CheckpointFormat::kNative;  // how chunks are framed in the files
  RankSavePlan plan;
  std::vector<FileOrder> files;
};

// The first message of a save from each rank to the coordinator (engine/save_plan_cache.h).
struct PlanRequest {
  enum class Kind : uint8_t {
    kFull = 0,     // `plan` is the rank's LocalSavePlan
    kCached = 1,   // unchanged since plan `plan_id`; `plan` is a LocalSavePlan of its objects only
    kNothing = 2,  // (in a later exchange) the rank's request of an earlier one stands
    kRuled = 3,    // `plan` is the rank's plan as a ruled message (plan/ruled_plan.h)
  };
  Kind kind = Kind::kFull;
  uint64_t plan_id = 0;
  std::string files_save_id;  // kCached: the save whose files (names, headers) the rank holds
  std::string plan;  // EncodeLocalSavePlan
};

struct PlanReply {
  enum class Kind : uint8_t {
    kOrder = 0,      // the whole order
    kFilesOnly = 1,  // order.format and order.files; the writes are those of plan `plan_id`
    kResend = 2,     // a plan is needed and some request is missing: a rank that sent kCached
                     // sends its local plan (kRuled), the others kNothing
    kRenamed = 3,    // order empty: the rank's cached files and writes of plan `plan_id`, renamed
                     // for save `save_id` (CheckpointWriter::RenameForSave)
    kResendShared = 4,  // no rank sent the shared part of this rank's ruled plan: send the
                        // plan again with it
  };
  Kind kind = Kind::kOrder;
  uint64_t plan_id = 0;  // the plan's id for the ranks' caches (0: none kept)
  std::string save_id;   // the save's id (the files' names and headers carry it)
  RankWriteOrder order;
};

struct ChunkReport {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  std::vector<uint32_t> block_crc32c;
};

struct FileReport {
  uint32_t index = 0;       // into the checkpoint's file list
  uint64_t data_start = 0;  // the length of its header
  uint64_t size = 0;        // the file's size
  uint32_t header_crc32c = 0;  // the CRC32C of its bytes [0, data_start)

  friend bool operator==(const FileReport&, const FileReport&) = default;
};

struct WriteReport {
  std::vector<ChunkReport> chunks;
  std::vector<FileReport> files;
};

std::string EncodeRankWriteOrder(const RankWriteOrder& order);
Result<RankWriteOrder> DecodeRankWriteOrder(std::string_view bytes);
std::string EncodePlanRequest(const PlanRequest& request);
Result<PlanRequest> DecodePlanRequest(std::string_view bytes);
std::string EncodePlanReply(const PlanReply& reply);
Result<PlanReply> DecodePlanReply(std::string_view bytes);
// The kind of an encoded reply without decoding the rest (its order may be large); nullopt when
// `bytes` does not start with a known kind.
std::optional<PlanReply::Kind> PlanReplyKind(std::string_view bytes);
std::string EncodeWriteReport(const WriteReport& report);
Result<WriteReport> DecodeWriteReport(std::string_view bytes);

// A chunk of an encoded write report, its checksums left in the report's bytes.
struct ChunkReportView {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint32_t crc_count = 0;
  const char* crcs = nullptr;  // crc_count u32s, little-endian

  // Copies the checksums to `out`, which has room for crc_count of them (x86-64/LE only, as
  // base/coding.h).
  void CopyCrcs(uint32_t* out) const {
    if (crc_count > 0) std::memcpy(out, crcs, sizeof(uint32_t) * crc_count);
  }
};

// Walks an encoded write report without building it (a commit at 8,192 ranks x 1,000 tensors
// takes 4.9 million chunk reports, and a WriteReport allocates for each): `on_chunk` for each
// chunk, then `on_file` for each file, in the order encoded. Returns the first error of a
// callback, or kDataLoss where the bytes are not a report; the bytes are checked as they are
// walked, so the callbacks may have run for what precedes the damage.
Status ScanWriteReport(std::string_view bytes,
                       const std::function<Status(const ChunkReportView&)>& on_chunk,
                       const std::function<Status(const FileReport&)>& on_file);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_SAVE_MESSAGES_H_
