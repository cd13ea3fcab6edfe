// Shared reads: when several ranks of one load need bytes of the same stored chunk, one of them
// (the reader) reads the chunk and sends each other rank its region, so that each stored byte is
// read from storage once.
//
// Every rank sends its needs (the stored-chunk regions of its read requests, in request order) to
// one rank, which plans the exchange for all of them (PlanExchange) and sends each rank its own
// part alone (PlanExchangeOnRoot): what a rank receives grows with what it reads and exchanges,
// not with the number of ranks. A chunk is shared when at least two ranks need it and reading it
// separately would read much more than exchanging it: every rank reads whole rows and whole
// checksum blocks, so ranks that split a chunk's columns, or split rows inside a checksum block,
// would each read most of it. A chunk is shared when
//   4 x (bytes the ranks would read beyond the union of their reads) >= the bytes exchanged,
// and when its exchange fits in one round (else it is cut into row bands: below). Chunks are
// taken in order of their relative position in their file (so every round covers about the same
// share of every file, and so of every rank's work). Each shared chunk's reader is one of the
// ranks that need it: the one that read the previous shared chunk of the same file (so that
// readers read long runs) unless that rank already reads over 32 MiB more than the least loaded
// candidate, which is then chosen. A round closes when its exchange would exceed `round_bytes`
// sent plus received for some rank; every chunk, shared or not, is read in the round it falls
// in.
//
// Row bands: a chunk worth sharing whose exchange exceeds a round (a large chunk that several
// ranks need columns of) is cut into bands of whole rows, each about half a round of exchange
// and, where the rows allow, beginning on a checksum block, so that no block is read by two
// readers. Each band is planned as a chunk of its own; a need that crosses bands is cut into
// parts, one per band (ExchangePlan::parts).
//
// Whole rows (for processes of one machine, which exchange through shared memory): packing a
// region that is not one run of its chunk costs the reader a copy out of staging, and the
// receiver a second one. Where every rank can read the reader's memory, the reader can instead
// read the rows its users cover straight into the shared memory, and every user (itself
// included) copies its region out of them: one copy per byte instead of two, and none by the
// reader for the others. A shared chunk is read as whole rows when some region on it is cut into
// runs shorter than `whole_rows_below` (it would be staged, not read in place), and the rows take
// at most twice the bytes its users need.
#ifndef SHARDPOINT_ENGINE_READ_EXCHANGE_H_
#define SHARDPOINT_ENGINE_READ_EXCHANGE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"

namespace sp {

// A region of one stored chunk that one rank needs.
//
// Ranks may hold different parts of the metadata (a load rank keeps the chunks its boxes reach:
// TensorMetadata::kept), so a chunk crosses ranks as its stored number: `chunk` is that number in
// what is encoded (EncodeNeeds, EncodeExchangePlan), and the decoders turn it into the chunk's
// index in the decoding rank's copy, refusing a number that copy does not hold. A copy that holds
// every chunk (rank 0's, which plans) numbers them by index.
struct ChunkNeed {
  uint32_t tensor = 0;  // index into CheckpointMetadata::tensors
  uint32_t chunk = 0;   // decoded: index into that tensor's chunks; encoded: the chunk's number
  Box region;           // global coordinates, inside the chunk's box

  friend bool operator==(const ChunkNeed&, const ChunkNeed&) = default;
};

struct RankNeeds {
  bool verify = true;  // whether this rank verifies checksums (it widens its reads to blocks)
  std::vector<ChunkNeed> needs;

  friend bool operator==(const RankNeeds&, const RankNeeds&) = default;
};

std::string EncodeNeeds(const RankNeeds& needs);
// Checks every index and region against `metadata`; an error names `from_rank`.
Result<RankNeeds> DecodeNeeds(std::string_view bytes, const CheckpointMetadata& metadata,
                              int from_rank);

// Rows of a stored chunk that its reader reads whole for every rank that needs them.
struct WholeRows {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  Box rows;  // global coordinates: the rows of the chunk its users' regions cover, every column

  friend bool operator==(const WholeRows&, const WholeRows&) = default;
};

// Lists kept per other rank, only for the ranks that have one: (rank, list), in ascending order
// of rank, no list empty. A rank's part of a round names only the ranks it exchanges with.
template <typename T>
using ByRank = std::vector<std::pair<int, std::vector<T>>>;

// One rank's part of one exchange round.
struct ExchangeRound {
  std::vector<size_t> own;  // indices of this rank's needs it reads itself
  ByRank<ChunkNeed> send;   // (q, rank q's needs this rank reads for it)
  ByRank<size_t> receive;   // (s, indices of this rank's needs rank s sends)
  // Whole rows (see above): the rows this rank reads for the ranks that need them, and
  // (s, indices of this rank's needs it copies out of rows that rank s reads; s may be this rank).
  std::vector<WholeRows> rows;
  ByRank<size_t> from_rows;

  friend bool operator==(const ExchangeRound&, const ExchangeRound&) = default;
};

struct ExchangePlan {
  std::vector<ExchangeRound> rounds;  // the same count on every rank; at least one
  uint64_t shared_chunks = 0;         // chunks (or row bands) read by one rank for others
  // This rank's needs cut at row bands: in the rounds, need index needs.size() + j is parts[j],
  // a part of need part_of[j] (the same chunk, a band of its rows).
  std::vector<ChunkNeed> parts;
  std::vector<size_t> part_of;

  friend bool operator==(const ExchangePlan&, const ExchangePlan&) = default;
};

// Bytes a region of `dtype` takes in an exchange payload: packed, padded to 16 bytes so that
// every region starts aligned for any dtype.
uint64_t PackedBytes(const Box& region, DType dtype);

// Bytes whole rows take in an exchange (WholeRows::rows, packed in the stored dtype).
uint64_t WholeRowsBytes(const WholeRows& rows, const CheckpointMetadata& metadata);

// Every rank's plan (indexed by rank), from every rank's needs (indexed by rank), in one pass.
// `whole_rows_below` 0: no chunk is read as whole rows.
std::vector<ExchangePlan> PlanExchange(const std::vector<RankNeeds>& all,
                                       const CheckpointMetadata& metadata, uint64_t round_bytes,
                                       uint64_t whole_rows_below = 0);

// A rank's plan as it travels from the rank that planned it. Decoding checks it against the
// metadata and against the rank it is for (`needs`: how many needs that rank sent; `ranks`: the
// size of the group): every index, rank and region in range, the lists in order; an error names
// `from_rank`.
std::string EncodeExchangePlan(const ExchangePlan& plan);
Result<ExchangePlan> DecodeExchangePlan(std::string_view bytes, const CheckpointMetadata& metadata,
                                        size_t needs, int ranks, int from_rank);

// This rank's plan, collectively: rank 0 gathers every rank's needs (`mine`, or this rank's error),
// plans (PlanExchange) and sends each rank its own plan alone. Rank 0 receives every rank's
// needs; every other rank sends its needs and receives its plan, nothing of the other ranks' but
// what it exchanges with them. Any rank's error, or an error in what rank 0 received, is every
// rank's error (comm/collective.h). Four collectives: a gather, the verdict on it, a scatter, and
// one flag (AnyRank) to agree that every rank decoded its plan.
Result<ExchangePlan> PlanExchangeOnRoot(Communicator& comm, Result<RankNeeds> mine,
                                        const CheckpointMetadata& metadata, uint64_t round_bytes,
                                        uint64_t whole_rows_below = 0);

// Bytes [begin, end) of a stored chunk.
using Interval = std::pair<uint64_t, uint64_t>;

// Bytes [begin, end) of the stored chunk a rank reads to get `region`: whole rows (along dim 0)
// and, when it verifies, whole checksum blocks; a driver-decoded chunk is read whole.
Interval ReadSpan(const TensorMetadata& tensor, const StoredChunk& chunk, const Box& region,
                  bool verify, uint64_t block_bytes);

// One need of one rank: (rank, index into its needs).
using NeedRef = std::pair<int, size_t>;

// Ranks that share an address space (threads of one process) need no exchange: any rank can copy
// a region straight into another rank's destination. So every stored byte that some rank needs
// is read by one rank, for all of them, and the readers are chosen for long reads, not by who
// needs what. The unit is a run of a stored chunk that overlapping reads cover (the reads of
// replicas of one region are one unit, the rows of two ranks that are apart are two); the units,
// in file order, are cut into one run per rank of about equal bytes, so that each rank reads one
// stretch of consecutive bytes of the files. Returns, per rank, the needs (of every rank) that
// rank reads, in file order: one pass plans every rank's share.
std::vector<std::vector<NeedRef>> AssignInMemoryReads(const std::vector<RankNeeds>& all,
                                                      const CheckpointMetadata& metadata);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_READ_EXCHANGE_H_
