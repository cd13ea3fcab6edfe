// Plan messages: the bytes that carry save plans between ranks.
//
// During a save every rank sends its LocalSavePlan to the coordinator, and the coordinator
// sends each rank its RankSavePlan back, through a Communicator that moves byte strings. These
// functions turn the plans into such strings and back.
//
// Encoding (all integers little-endian; strings and lists are a u32 count then the items):
//   message      := magic:u32 body crc32c:u32   (the CRC32C covers magic and body)
//   local plan   := magic "SLP1", tensors:list<tensor>, objects:list<object>
//     tensor     := name:string dtype:u8 (DType code) shape:list<i64> boxes:list<box>
//     box        := offsets:list<i64> sizes:list<i64>
//     object     := name:string encoding:u8 payload:string
//   rank plan    := magic "SRP2", files:vlist<index>, writes:vlist<write>
//     write      := local_tensor:index local_box:varint file:index tensor:index chunk:index
//                   data_offset:svarint byte_length:varint
//   A rank plan's numbers are LEB128 varints (svarint: zigzagged), a vlist a varint count then
//   the items. An index is the svarint step from the same field of the item before (from 0 for
//   the first), and a write's data_offset the step from where the write before it ends (its
//   offset plus its length, modulo 2^64): a rank writes its chunks back to back, so most of a
//   write's numbers take a byte. Decoded indices must fit 32 bits.
// The format is internal to one job (both ends run the same build); it is not stored on disk.
//
// Decoders treat their input as hostile: every length is checked against the bytes that remain
// before anything is allocated, and a bad checksum, magic, dtype or encoding code, truncation or
// trailing bytes give kDataLoss naming the message and the position. They never crash. They
// check structure only; PlanSave validates meaning (shapes, boxes, names).
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_PLAN_PLAN_CODEC_H_
#define SHARDPOINT_PLAN_PLAN_CODEC_H_

#include <string>
#include <string_view>

#include "shardpoint/base/result.h"
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

std::string EncodeLocalSavePlan(const LocalSavePlan& plan);
Result<LocalSavePlan> DecodeLocalSavePlan(std::string_view bytes);
// Decodes a local plan as the next rank of `plans` (the coordinator's way: no LocalSavePlan is
// built). The same checks and errors as DecodeLocalSavePlan; on an error `plans` is left with a
// partial rank and must not be planned.
Status DecodeLocalSavePlanInto(std::string_view bytes, GatheredPlans* plans);

std::string EncodeRankSavePlan(const RankSavePlan& plan);
Result<RankSavePlan> DecodeRankSavePlan(std::string_view bytes);

}  // namespace sp

#endif  // SHARDPOINT_PLAN_PLAN_CODEC_H_
