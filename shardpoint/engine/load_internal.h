// The parts of a load (engine/load.h) that its ways of reading share: the plan of one rank's
// reads, the executor options, and the loads with shared reads (engine/shared_load.cc), which
// differ in how the regions one rank reads for another reach it.
#ifndef SHARDPOINT_ENGINE_LOAD_INTERNAL_H_
#define SHARDPOINT_ENGINE_LOAD_INTERNAL_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/load.h"
#include "shardpoint/engine/local_state.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/exec/io_tuner.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/plan/load_plan.h"

namespace sp {

// What a load rank asks the coordinator for when each rank is sent its part of the metadata
// (LoadOptions::own_chunks_only): with `filter`, the chunks it reaches; without, the whole.
std::string MetadataRequest(const ChunkFilter* filter);

// The coordinator's answers to one round of those requests, ranks first_rank + i for each i of
// `requests`, into `out` (as many): `prefix` and the wire encoding of the rank's part (`encoder`)
// or of the whole metadata (into `whole` once, when some rank asks for it). Rank `skip` (the
// coordinator) is left out. Ranks that ask alike (replicas that load the same boxes) are answered
// from one encoding. kDataLoss naming the rank for a request that is not one.
Status AnswerMetadataRequests(const MetadataPartEncoder& encoder,
                              std::span<const std::string> requests, int first_rank,
                              std::string_view prefix, int skip, std::string* whole,
                              std::span<std::string> out, ThreadPool* pool);

// One rank's load before any read: the result without bytes_read, and its read requests.
struct Prepared {
  LoadResult result;
  LoadPlan plan;
  std::vector<ReadRequest> requests;
};

// Plans this rank's reads and gathers its objects (reading the payloads of the wanted ones a
// driver left unread).
Result<Prepared> Prepare(const LoadState& state, const CheckpointMetadata& metadata,
                         std::string_view path, const LoadOptions& options, Store& store);

ReadExecutorOptions ReadOptionsFor(const CheckpointMetadata& metadata, const LoadOptions& options,
                                   EngineContext& ctx, IoGate* gate);

// This rank reads its own requests; the result with bytes_read set.
Result<LoadResult> ReadOwn(Prepared p, const CheckpointMetadata& metadata, std::string_view path,
                           const LoadOptions& options, EngineContext& ctx, IoGate* gate);

// The outcome of a load with shared reads. `agreed`: the outcome came out of a collective and
// is already the same on every rank.
struct SharedOutcome {
  Result<LoadResult> result;
  bool agreed = false;
  bool own_gates = false;  // each rank read through its pool's gate, not the one it was given
};

// Ranks that share an address space (Communicator::shares_memory): each reads one stretch of the
// needed chunks and copies every region straight into the destination of the rank that needs it.
SharedOutcome LoadSharedInMemory(const LoadState& state, const CheckpointMetadata& metadata,
                                 std::string_view path, const LoadOptions& options,
                                 EngineContext& ctx, IoGate* gate);

// Ranks anywhere: each stored chunk that several ranks need is read by one of them, which sends
// the others their regions through the communicator, in rounds (engine/read_exchange.h).
SharedOutcome LoadShared(const LoadState& state, const CheckpointMetadata& metadata,
                         std::string_view path, const LoadOptions& options, EngineContext& ctx,
                         IoGate* gate);

// Processes of one machine (every rank of the communicator on it, none sharing this one's
// address space): the plan of LoadShared, but each reader puts what it reads for the others into
// its own part of one shared-memory object (three slots: two rounds are read at once while the
// one before them is copied out): the packed regions, or the whole rows of chunks whose regions
// would otherwise be staged, which every rank that needs them (the reader too) copies from
// (engine/read_exchange.h). Each slot begins with the table of what lies where in it. Rounds go
// through a RoundBoard in the same object (exec/round_board.h), not through the communicator: a
// reader posts each round as soon as it has read it, and reads round k+2 into the slot of round
// k-1 once every rank has copied that one out. The communicator carries the needs, the slot
// sizes, and at the end every rank's status (the outcome is agreed: a rank that stopped because
// another did gives way to that one's error). The rounds read through each rank's pool's gate,
// not `gate` (the machine's, which the fallbacks use): each stored byte has one reader already,
// and ranks do not move in step (a rank reads its next rounds while another copies out), so a
// first-come gate for the machine would make a rank's next round wait behind another's reads of
// later rounds (docs/PERFORMANCE.md). The lowest rank creates the object, named after
// `nonce`, and removes the name once every rank has it mapped. When the object cannot be made
// or mapped on some rank (no /dev/shm, too small a /dev/shm, a container of its own), every rank
// falls back: to LoadShared when the caller asked for shared reads, else to reading its own.
SharedOutcome LoadSharedOnMachine(const LoadState& state, const CheckpointMetadata& metadata,
                                  std::string_view path, const LoadOptions& options,
                                  EngineContext& ctx, IoGate* gate, std::string_view nonce);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_LOAD_INTERNAL_H_
