#include "shardpoint/engine/save_messages.h"

#include "shardpoint/base/coding.h"
#include "shardpoint/plan/plan_codec.h"

namespace sp {
namespace {
constexpr uint32_t kMaxHeaderBytes = 100'000'000;  // the safetensors header cap

// A message's kind (its first byte, at most `last`) and plan id (the next eight).
template <typename Kind>
Status ReadKindAndPlanId(ByteReader& r, Kind last, const char* what, Kind* kind,
                         uint64_t* plan_id) {
  SP_ASSIGN_OR_RETURN(uint8_t k, r.ReadU8());
  if (k > static_cast<uint8_t>(last)) {
    return DataLossError(std::string(what) + ": unknown kind " + std::to_string(k));
  }
  *kind = static_cast<Kind>(k);
  SP_ASSIGN_OR_RETURN(*plan_id, r.ReadU64());
  return OkStatus();
}
}  // namespace

std::string EncodeRankWriteOrder(const RankWriteOrder& order) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(static_cast<uint8_t>(order.format));
  std::string plan = EncodeRankSavePlan(order.plan);
  w.PutU64(plan.size());
  w.PutRaw(plan);
  w.PutU32(static_cast<uint32_t>(order.files.size()));
  for (const FileOrder& f : order.files) {
    w.PutU32(f.index);
    w.PutString(f.name);
    w.PutString(f.header);
    w.PutU64(f.size);
  }
  return out;
}

Result<RankWriteOrder> DecodeRankWriteOrder(std::string_view bytes) {
  ByteReader r(bytes, "rank write order");
  RankWriteOrder order;
  SP_ASSIGN_OR_RETURN(uint8_t format, r.ReadU8());
  if (format > static_cast<uint8_t>(CheckpointFormat::kTorchDcp)) {
    return DataLossError("rank write order: unknown format " + std::to_string(format));
  }
  order.format = static_cast<CheckpointFormat>(format);
  SP_ASSIGN_OR_RETURN(uint64_t plan_size, r.ReadU64());
  if (plan_size > r.remaining()) return DataLossError("rank write order: plan size out of range");
  SP_ASSIGN_OR_RETURN(std::string_view plan, r.ReadRaw(plan_size));
  SP_ASSIGN_OR_RETURN(order.plan, DecodeRankSavePlan(plan));
  SP_ASSIGN_OR_RETURN(uint32_t n, r.ReadCount(4 + 4 + 4 + 8));
  order.files.resize(n);
  for (FileOrder& f : order.files) {
    SP_ASSIGN_OR_RETURN(f.index, r.ReadU32());
    SP_ASSIGN_OR_RETURN(std::string_view name, r.ReadString(4096));
    SP_ASSIGN_OR_RETURN(std::string_view header, r.ReadString(kMaxHeaderBytes));
    SP_ASSIGN_OR_RETURN(f.size, r.ReadU64());
    f.name = std::string(name);
    f.header = std::string(header);
  }
  if (!r.done()) return DataLossError("rank write order: trailing bytes");
  return order;
}

std::string EncodePlanRequest(const PlanRequest& request) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(static_cast<uint8_t>(request.kind));
  w.PutU64(request.plan_id);
  w.PutString(request.files_save_id);
  w.PutRaw(request.plan);
  return out;
}

Result<PlanRequest> DecodePlanRequest(std::string_view bytes) {
  ByteReader r(bytes, "plan request");
  PlanRequest request;
  SP_RETURN_IF_ERROR(ReadKindAndPlanId(r, PlanRequest::Kind::kRuled, "plan request",
                                       &request.kind, &request.plan_id));
  SP_ASSIGN_OR_RETURN(std::string_view files_save_id, r.ReadString(4096));
  request.files_save_id = std::string(files_save_id);
  SP_ASSIGN_OR_RETURN(std::string_view plan, r.ReadRaw(r.remaining()));
  request.plan = std::string(plan);
  return request;
}

std::string EncodePlanReply(const PlanReply& reply) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(static_cast<uint8_t>(reply.kind));
  w.PutU64(reply.plan_id);
  w.PutString(reply.save_id);
  w.PutRaw(EncodeRankWriteOrder(reply.order));
  return out;
}

std::optional<PlanReply::Kind> PlanReplyKind(std::string_view bytes) {
  if (bytes.empty()) return std::nullopt;
  const uint8_t kind = static_cast<uint8_t>(bytes[0]);
  if (kind > static_cast<uint8_t>(PlanReply::Kind::kResendShared)) return std::nullopt;
  return static_cast<PlanReply::Kind>(kind);
}

Result<PlanReply> DecodePlanReply(std::string_view bytes) {
  ByteReader r(bytes, "plan reply");
  PlanReply reply;
  SP_RETURN_IF_ERROR(ReadKindAndPlanId(r, PlanReply::Kind::kResendShared, "plan reply", &reply.kind,
                                       &reply.plan_id));
  SP_ASSIGN_OR_RETURN(std::string_view save_id, r.ReadString(4096));
  reply.save_id = std::string(save_id);
  SP_ASSIGN_OR_RETURN(std::string_view order, r.ReadRaw(r.remaining()));
  SP_ASSIGN_OR_RETURN(reply.order, DecodeRankWriteOrder(order));
  return reply;
}

// A write report's numbers are varints: a chunk's tensor and chunk numbers as the zigzagged steps
// from those of the chunk before (from 0 for the first), its checksum count, then the checksums
// at four bytes each (ChunkReportView points at them); a file's index as the step from the index
// of the file before, its data start and size, then its header's CRC at four bytes.
std::string EncodeWriteReport(const WriteReport& report) {
  std::string out;
  ByteWriter w(&out);
  w.PutVarint(report.chunks.size());
  int64_t tensor = 0, chunk = 0;
  for (const ChunkReport& c : report.chunks) {
    w.PutIndexStep(c.tensor, &tensor);
    w.PutIndexStep(c.chunk, &chunk);
    w.PutVarint(c.block_crc32c.size());
    for (uint32_t crc : c.block_crc32c) w.PutU32(crc);
  }
  w.PutVarint(report.files.size());
  int64_t file = 0;
  for (const FileReport& f : report.files) {
    w.PutIndexStep(f.index, &file);
    w.PutVarint(f.data_start);
    w.PutVarint(f.size);
    w.PutU32(f.header_crc32c);
  }
  return out;
}

Status ScanWriteReport(std::string_view bytes,
                       const std::function<Status(const ChunkReportView&)>& on_chunk,
                       const std::function<Status(const FileReport&)>& on_file) {
  ByteReader r(bytes, "write report");
  SP_ASSIGN_OR_RETURN(uint32_t chunks, r.ReadVarintCount(3));
  int64_t tensor = 0, chunk = 0;
  for (uint32_t i = 0; i < chunks; ++i) {
    ChunkReportView c;
    SP_ASSIGN_OR_RETURN(c.tensor, r.ReadIndexStep("tensor", &tensor));
    SP_ASSIGN_OR_RETURN(c.chunk, r.ReadIndexStep("chunk", &chunk));
    SP_ASSIGN_OR_RETURN(c.crc_count, r.ReadVarintCount(4));
    SP_ASSIGN_OR_RETURN(std::string_view crcs, r.ReadRaw(sizeof(uint32_t) * c.crc_count));
    c.crcs = crcs.data();
    SP_RETURN_IF_ERROR(on_chunk(c));
  }
  SP_ASSIGN_OR_RETURN(uint32_t files, r.ReadVarintCount(7));
  int64_t file = 0;
  for (uint32_t i = 0; i < files; ++i) {
    FileReport f;
    SP_ASSIGN_OR_RETURN(f.index, r.ReadIndexStep("file", &file));
    SP_ASSIGN_OR_RETURN(f.data_start, r.ReadVarint());
    SP_ASSIGN_OR_RETURN(f.size, r.ReadVarint());
    SP_ASSIGN_OR_RETURN(f.header_crc32c, r.ReadU32());
    SP_RETURN_IF_ERROR(on_file(f));
  }
  if (!r.done()) return DataLossError("write report: trailing bytes");
  return OkStatus();
}

Result<WriteReport> DecodeWriteReport(std::string_view bytes) {
  WriteReport report;
  SP_RETURN_IF_ERROR(ScanWriteReport(
      bytes,
      [&](const ChunkReportView& c) {
        ChunkReport& chunk = report.chunks.emplace_back();
        chunk.tensor = c.tensor;
        chunk.chunk = c.chunk;
        chunk.block_crc32c.resize(c.crc_count);
        c.CopyCrcs(chunk.block_crc32c.data());
        return OkStatus();
      },
      [&](const FileReport& f) {
        report.files.push_back(f);
        return OkStatus();
      }));
  return report;
}

}  // namespace sp
