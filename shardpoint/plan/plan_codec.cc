#include "shardpoint/plan/plan_codec.h"

#include <limits>
#include <utility>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/plan/plan_codec_internal.h"

namespace sp {
namespace {

using plan_codec_internal::ExpectDone;
using plan_codec_internal::kMaxNameBytes;
using plan_codec_internal::kMinObjectBytes;
using plan_codec_internal::Open;
using plan_codec_internal::PutBoxList;
using plan_codec_internal::PutI64List;
using plan_codec_internal::PutObject;
using plan_codec_internal::ReadBoxList;
using plan_codec_internal::ReadI64List;
using plan_codec_internal::ReadObject;
using plan_codec_internal::Seal;

constexpr uint32_t kLocalSavePlanMagic = 0x31504C53;  // "SLP1"
constexpr uint32_t kRankSavePlanMagic = 0x32505253;   // "SRP2"
// Smallest encodings, used to bound counts by the bytes that remain.
constexpr size_t kMinTensorBytes = 4 + 1 + 4 + 4;
constexpr size_t kWriteBytes = 7;  // seven one-byte varints

// Reads one tensor into `tensor`, except its name, which `name` views in the message. The
// vectors are reused: a decoder that reads many tensors into one LocalTensor allocates only
// for the largest.
Status ReadTensor(ByteReader& r, LocalTensor* tensor, std::string_view* name) {
  SP_ASSIGN_OR_RETURN(*name, r.ReadString(kMaxNameBytes));
  SP_ASSIGN_OR_RETURN(uint8_t code, r.ReadU8());
  Result<DType> dtype = DTypeFromCode(code);
  if (!dtype.ok()) {
    return DataLossError(r.what() + ": tensor '" + std::string(*name) +
                         "' has unknown dtype code " + std::to_string(code));
  }
  tensor->dtype = *dtype;
  SP_RETURN_IF_ERROR(ReadI64List(r, &tensor->shape));
  return ReadBoxList(r, &tensor->boxes);
}

}  // namespace

std::string EncodeLocalSavePlan(const LocalSavePlan& plan) {
  std::string out;
  ByteWriter w(&out);
  w.PutU32(kLocalSavePlanMagic);
  w.PutU32(static_cast<uint32_t>(plan.tensors.size()));
  for (const LocalTensor& tensor : plan.tensors) {
    w.PutString(tensor.name);
    w.PutU8(DTypeCode(tensor.dtype));
    PutI64List(w, tensor.shape);
    PutBoxList(w, tensor.boxes);
  }
  w.PutU32(static_cast<uint32_t>(plan.objects.size()));
  for (const ObjectEntry& object : plan.objects) PutObject(w, object);
  return Seal(std::move(out));
}

Result<LocalSavePlan> DecodeLocalSavePlan(std::string_view bytes) {
  SP_ASSIGN_OR_RETURN(ByteReader r,
                      Open(bytes, kLocalSavePlanMagic,
                           "local save plan of " + std::to_string(bytes.size()) + " bytes"));
  LocalSavePlan plan;
  SP_ASSIGN_OR_RETURN(uint32_t num_tensors, r.ReadCount(kMinTensorBytes));
  plan.tensors.reserve(num_tensors);
  for (uint32_t i = 0; i < num_tensors; ++i) {
    LocalTensor& tensor = plan.tensors.emplace_back();
    std::string_view name;
    SP_RETURN_IF_ERROR(ReadTensor(r, &tensor, &name));
    tensor.name = std::string(name);
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_objects, r.ReadCount(kMinObjectBytes));
  plan.objects.reserve(num_objects);
  for (uint32_t i = 0; i < num_objects; ++i) {
    SP_ASSIGN_OR_RETURN(ObjectEntry object, ReadObject(r));
    plan.objects.push_back(std::move(object));
  }
  SP_RETURN_IF_ERROR(ExpectDone(r));
  return plan;
}

Status DecodeLocalSavePlanInto(std::string_view bytes, GatheredPlans* plans) {
  SP_ASSIGN_OR_RETURN(ByteReader r,
                      Open(bytes, kLocalSavePlanMagic,
                           "local save plan of " + std::to_string(bytes.size()) + " bytes"));
  plans->BeginRank();
  SP_ASSIGN_OR_RETURN(uint32_t num_tensors, r.ReadCount(kMinTensorBytes));
  LocalTensor tensor;
  for (uint32_t i = 0; i < num_tensors; ++i) {
    std::string_view name;
    SP_RETURN_IF_ERROR(ReadTensor(r, &tensor, &name));
    plans->AddTensor(name, tensor.dtype, tensor.shape, tensor.boxes);
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_objects, r.ReadCount(kMinObjectBytes));
  for (uint32_t i = 0; i < num_objects; ++i) {
    SP_ASSIGN_OR_RETURN(ObjectEntry object, ReadObject(r));
    plans->AddObject(std::move(object));
  }
  return ExpectDone(r);
}

std::string EncodeRankSavePlan(const RankSavePlan& plan) {
  std::string out;
  ByteWriter w(&out);
  w.PutU32(kRankSavePlanMagic);
  w.PutVarint(plan.files.size());
  int64_t file = 0;
  for (uint32_t f : plan.files) w.PutIndexStep(f, &file);
  w.PutVarint(plan.writes.size());
  int64_t local_tensor = 0, write_file = 0, tensor = 0, chunk = 0;
  uint64_t next_offset = 0;  // where the write before ends
  for (const ChunkWrite& write : plan.writes) {
    w.PutIndexStep(write.local_tensor, &local_tensor);
    w.PutVarint(write.local_box);
    w.PutIndexStep(write.file, &write_file);
    w.PutIndexStep(write.tensor, &tensor);
    w.PutIndexStep(write.chunk, &chunk);
    w.PutSignedVarint(static_cast<int64_t>(write.data_offset - next_offset));
    w.PutVarint(write.byte_length);
    next_offset = write.data_offset + write.byte_length;
  }
  return Seal(std::move(out));
}

Result<RankSavePlan> DecodeRankSavePlan(std::string_view bytes) {
  SP_ASSIGN_OR_RETURN(ByteReader r,
                      Open(bytes, kRankSavePlanMagic,
                           "rank save plan of " + std::to_string(bytes.size()) + " bytes"));
  RankSavePlan plan;
  SP_ASSIGN_OR_RETURN(uint32_t num_files, r.ReadVarintCount(1));
  plan.files.resize(num_files);
  int64_t file = 0;
  for (uint32_t& f : plan.files) {
    SP_ASSIGN_OR_RETURN(f, r.ReadIndexStep("file", &file));
  }
  SP_ASSIGN_OR_RETURN(uint32_t num_writes, r.ReadVarintCount(kWriteBytes));
  plan.writes.resize(num_writes);
  int64_t local_tensor = 0, write_file = 0, tensor = 0, chunk = 0;
  uint64_t next_offset = 0;
  for (ChunkWrite& write : plan.writes) {
    SP_ASSIGN_OR_RETURN(write.local_tensor, r.ReadIndexStep("local tensor", &local_tensor));
    const size_t at = r.position();
    SP_ASSIGN_OR_RETURN(uint64_t local_box, r.ReadVarint());
    if (local_box > UINT32_MAX) {
      return DataLossError(r.what() + ": local box " + std::to_string(local_box) +
                           " out of range at byte " + std::to_string(at));
    }
    write.local_box = static_cast<uint32_t>(local_box);
    SP_ASSIGN_OR_RETURN(write.file, r.ReadIndexStep("file", &write_file));
    SP_ASSIGN_OR_RETURN(write.tensor, r.ReadIndexStep("tensor", &tensor));
    SP_ASSIGN_OR_RETURN(write.chunk, r.ReadIndexStep("chunk", &chunk));
    SP_ASSIGN_OR_RETURN(int64_t offset_step, r.ReadSignedVarint());
    write.data_offset = next_offset + static_cast<uint64_t>(offset_step);
    SP_ASSIGN_OR_RETURN(write.byte_length, r.ReadVarint());
    next_offset = write.data_offset + write.byte_length;
  }
  SP_RETURN_IF_ERROR(ExpectDone(r));
  return plan;
}

}  // namespace sp
