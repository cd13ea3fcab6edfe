// Collectives whose errors travel as data, so that every rank returns the same error.
//
// A save or load is a sequence of collective phases (gather local plans, scatter final plans,
// agree that every write succeeded). When one rank fails inside a phase, the others must not hang
// waiting for it and must not carry on with a partial result: each helper here sends a rank's
// failure through the same collective as its payload, and every rank of the group returns the
// same error from the same call (docs/DESIGN.md decision 5). Ranks keep calling the same helpers in
// the same order; after a helper fails, a protocol simply returns its error on every rank.
//
// Which error wins: the lowest-numbered failing rank's Status, with its message prefixed
// "rank R: " (so every rank reports where the failure came from). A transport failure of the
// underlying Communicator (a rank left, a timeout, mismatched calls) is returned as is; the
// communicator reports such failures identically on every rank of the round.
//
// Wire format. An envelope is the payload followed by one tag byte: 0x00 for a value (the bytes
// before it are the payload, untouched), 0x01 for an error (the bytes before it are an encoded
// Status). An encoded Status is little-endian: u32 code, u32 message length, message bytes.
// Decoders treat the bytes as hostile: a malformed envelope yields kDataLoss naming the collective
// and the sending rank.
//
// Thread-safety: the helpers are free functions; each call uses `comm` from its own rank's
// thread, like any Communicator call.
#ifndef SHARDPOINT_COMM_COLLECTIVE_H_
#define SHARDPOINT_COMM_COLLECTIVE_H_

#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"

namespace sp {

// Root receives every rank's payload, indexed by rank, when every rank's `local` holds a value;
// other ranks receive an empty vector. If any rank's `local` is an error, every rank returns that
// error (lowest failing rank, message prefixed "rank R: "). Two collectives: a Gather and a
// Broadcast of the verdict.
Result<std::vector<std::string>> GatherOrFail(Communicator& comm, Result<std::string> local,
                                              int root);

// Root computes one payload per rank, or fails; rank r receives root_payloads[r], or every rank
// returns root's error prefixed "rank <root>: ". Root's payload count must equal comm.size(),
// otherwise every rank returns kInvalidArgument. `root_payloads` is ignored on other ranks. One
// Scatter.
Result<std::string> ScatterOrFail(Communicator& comm,
                                  Result<std::vector<std::string>> root_payloads, int root);

// Every rank receives root's value, or every rank returns root's error prefixed "rank <root>: ".
// `root_value` is ignored on other ranks. One Broadcast.
Result<std::string> BroadcastOrFail(Communicator& comm, Result<std::string> root_value, int root);

// Every rank receives every rank's payload, indexed by rank, or every rank returns the lowest
// failing rank's error prefixed "rank R: ". One AllGather.
Result<std::vector<std::string>> AllGatherOrFail(Communicator& comm, Result<std::string> local);

// Rank r sends local[q] to rank q and receives, indexed by sender, what every rank sent it; or,
// when any rank's `local` is an error (or holds other than one payload per rank), every rank
// returns the lowest failing rank's error prefixed "rank R: ". One AllToAll. A payload with one
// byte of spare capacity travels without being copied.
Result<std::vector<std::string>> AllToAllOrFail(Communicator& comm,
                                                Result<std::vector<std::string>> local);

// Every rank learns whether every rank succeeded: returns OK on all ranks, or on all ranks the
// lowest failing rank's status prefixed "rank R: ". One AnyRank, and an AllGather of the
// statuses only when some rank failed.
Status AgreeOnStatus(Communicator& comm, Status local);

// Encodes `status` (code and message) as bytes; OK encodes as code 0 with an empty message.
std::string EncodeStatus(const Status& status);

// Decodes bytes written by EncodeStatus into *decoded. Returns kDataLoss (and leaves *decoded
// untouched) when the bytes are truncated, carry trailing bytes, an unknown code, or an OK code
// with a message. (The decoded value is an out-parameter because a Result<Status> cannot tell a
// decoded error apart from a failure to decode.)
Status DecodeStatus(std::string_view encoded, Status* decoded);

}  // namespace sp

#endif  // SHARDPOINT_COMM_COLLECTIVE_H_
