// Loads with shared reads (engine/load_internal.h): a stored chunk that several ranks need is read
// by one of them, and its regions reach the others by a copy into their destinations (threads of
// one process), through the communicator (anywhere), or through one shared-memory object
// (processes of one machine).
#include <algorithm>
#include <array>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/engine/load_internal.h"
#include "shardpoint/engine/opened_checkpoint.h"
#include "shardpoint/engine/read_exchange.h"
#include "shardpoint/exec/round_board.h"
#include "shardpoint/exec/shared_memory.h"
#include "shardpoint/exec/task_group.h"

namespace sp {
namespace {

// Bytes the regions of `needs` take packed (engine/read_exchange.h, PackedBytes).
uint64_t PackedBytesOf(const CheckpointMetadata& metadata, const std::vector<ChunkNeed>& needs) {
  uint64_t total = 0;
  for (const ChunkNeed& n : needs) total += PackedBytes(n.region, metadata.tensors[n.tensor].dtype);
  return total;
}

// Appends a request per need that reads its region, packed in the stored dtype, to its place
// from `at` on (PackedBytesOf(needs) bytes).
void PackRegionReads(const CheckpointMetadata& metadata, const std::vector<ChunkNeed>& needs,
                     std::byte* at, std::vector<ReadRequest>& requests) {
  for (const ChunkNeed& n : needs) {
    const TensorMetadata& stored = metadata.tensors[n.tensor];
    requests.push_back(
        MakeReadRequest(stored, n.chunk, ReadDestination{at, n.region, stored.dtype}, n.region));
    at += PackedBytes(n.region, stored.dtype);
  }
}

// Requests that read other ranks' regions into the payloads sent to them.
class Outgoing {
 public:
  explicit Outgoing(const CheckpointMetadata& metadata) : metadata_(metadata) {}

  // Sizes rank q's payload for `needs` and appends a request per need, reading into it.
  void Add(int q, const std::vector<ChunkNeed>& needs, std::vector<ReadRequest>& requests) {
    std::string& payload = payloads_.emplace_back(q, std::string()).second;
    payload.resize(PackedBytesOf(metadata_, needs));
    PackRegionReads(metadata_, needs, reinterpret_cast<std::byte*>(payload.data()), requests);
  }

  // (rank, payload), in the order added.
  std::vector<std::pair<int, std::string>> Take() { return std::move(payloads_); }

 private:
  const CheckpointMetadata& metadata_;
  std::vector<std::pair<int, std::string>> payloads_;
};

// Copies the regions other ranks read for this rank out of their payloads, in tasks on the pool
// that run while the next round reads; Wait() returns the first error.
class Unpacker {
 public:
  explicit Unpacker(ThreadPool& pool) : group_(&pool) {}

  // Copies out of payloads received as bytes, which it keeps until Wait(): payloads[i] is from
  // the i-th sender of round.receive.
  void Start(std::vector<std::string> payloads, const ExchangeRound& round,
             const std::vector<ReadRequest>& requests) {
    payloads_ = std::move(payloads);
    for (size_t i = 0; i < round.receive.size(); ++i) {
      const auto& [s, receive] = round.receive[i];
      StartView(s,
                std::span<const std::byte>(reinterpret_cast<const std::byte*>(payloads_[i].data()),
                                           payloads_[i].size()),
                receive, requests);
    }
  }

  // Copies the regions `receive` (indices into `requests`) out of sender s's payload for this
  // rank, which stays where it is until Wait() (its slot of a shared-memory object).
  void StartView(int s, std::span<const std::byte> payload, const std::vector<size_t>& receive,
                 const std::vector<ReadRequest>& requests) {
    uint64_t at = 0;
    for (size_t i : receive) {
      const ReadRequest* r = &requests[i];
      const uint64_t bytes = PackedBytes(r->region, r->stored->dtype);
      if (at + bytes > payload.size()) {
        group_.Run([=, size = payload.size()] {
          return DataLossError("shared read from rank " + std::to_string(s) + " holds " +
                               std::to_string(size) + " bytes, expected at least " +
                               std::to_string(at + bytes) + " for tensor '" + r->stored->name +
                               "'");
        });
        break;
      }
      const std::byte* src = payload.data() + at;
      group_.Run([r, src] {
        return CopyToDestination(ConstChunkView{src, r->region, DTypeSize(r->stored->dtype)},
                                 r->region, *r);
      });
      at += bytes;
    }
  }

  // Copies the region of request `r` out of whole rows (`rows`, packed in the stored dtype at
  // `src`) that stay where they are until Wait().
  void StartFromRows(const std::byte* src, const Box& rows, const ReadRequest* r) {
    group_.Run([src, rows, r] {
      return CopyToDestination(ConstChunkView{src, rows, DTypeSize(r->stored->dtype)}, r->region,
                               *r);
    });
  }

  Status Wait() {
    Status status = group_.Wait();
    payloads_.clear();
    return status;
  }

 private:
  // Declared first, so destroyed last: the group's destructor waits for the copies still running
  // when an error path skips Wait().
  std::vector<std::string> payloads_;
  TaskGroup group_;
};

// What a rank publishes of its reads for shared reads: the stored-chunk region of each request,
// in request order, each chunk by its stored number (ChunkNeed).
RankNeeds NeedsOf(const Prepared& p, const CheckpointMetadata& metadata,
                  const LoadOptions& options) {
  RankNeeds needs;
  needs.verify = options.verify_checksums;
  for (const ReadRequest& r : p.requests) {
    needs.needs.push_back(ChunkNeed{static_cast<uint32_t>(r.stored - metadata.tensors.data()),
                                    ChunkNumber(*r.stored, r.chunk - r.stored->chunks.data()),
                                    r.region});
  }
  return needs;
}

// This rank's part of the exchange, planned on one rank from every rank's needs (the stored-chunk
// regions of its requests), or the same error on every rank.
Result<ExchangePlan> PlanOnRoot(Communicator& comm, const Result<Prepared>& prepared,
                                const CheckpointMetadata& metadata, const LoadOptions& options,
                                uint64_t round_bytes, uint64_t whole_rows_below) {
  Result<RankNeeds> mine = prepared.ok() ? Result<RankNeeds>(NeedsOf(*prepared, metadata, options))
                                         : Result<RankNeeds>(prepared.status());
  return PlanExchangeOnRoot(comm, std::move(mine), metadata, round_bytes, whole_rows_below);
}

// The requests the rounds of `plan` index: this rank's, then one per part of them cut at a row
// band (ExchangePlan::parts), into the same destination.
std::vector<ReadRequest> RequestsOfPlan(const Prepared& p, const ExchangePlan& plan) {
  std::vector<ReadRequest> requests = p.requests;
  requests.reserve(requests.size() + plan.parts.size());
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    const ReadRequest& whole = p.requests[plan.part_of[j]];
    requests.push_back(ReadRequest{whole.stored, whole.chunk, whole.dest, plan.parts[j].region});
  }
  return requests;
}

// Opens every data file this rank reads in any round of `plan` (whose requests are `planned`:
// RequestsOfPlan), for itself or for others.
Status OpenFilesOfPlan(const ExchangePlan& plan, const std::vector<ReadRequest>& planned,
                       const CheckpointMetadata& metadata, std::string_view path,
                       EngineContext& ctx, DataFiles* files) {
  std::vector<bool> needed(metadata.files.size(), false);
  for (const ExchangeRound& round : plan.rounds) {
    for (size_t i : round.own) needed[planned[i].chunk->file] = true;
    for (const auto& [q, send] : round.send) {
      for (const ChunkNeed& n : send) {
        needed[metadata.tensors[n.tensor].chunks[n.chunk].file] = true;
      }
    }
    for (const WholeRows& w : round.rows) {
      needed[metadata.tensors[w.tensor].chunks[w.chunk].file] = true;
    }
  }
  SP_ASSIGN_OR_RETURN(*files, OpenDataFiles(ctx.store(), path, metadata, needed));
  return OkStatus();
}

// The most a rank sends plus receives in one round of a load through shared memory. (1 GiB
// loaded by 4 processes as columns of row chunks, warm, on 2 cores, with a collective per round:
// 8 MiB rounds 1.3-1.4 s, 16 MiB 1.0-1.2 s, 32 MiB 0.9-1.2 s, 64 MiB 1.0-1.3 s. Through the round
// board, 8, 16 and 32 MiB were within the noise of a cold load: docs/PERFORMANCE.md.)
constexpr uint64_t kMachineRoundBytes = uint64_t{32} << 20;

// Whole rows lie in a slot at an offset that agrees with their file offset modulo this (a page,
// and the largest direct I/O alignment of common file systems), so that direct reads land in
// place.
constexpr uint64_t kSlotAlignment = 4096;

// Where a reader's payloads of one round lie in its slot: one entry per receiving rank.
struct SlotEntry {
  uint32_t rank = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Where whole rows of a stored chunk lie in a reader's slot.
struct RowsEntry {
  uint32_t tensor = 0;
  uint32_t chunk = 0;  // the stored chunk's number (ChunkNeed)
  uint64_t offset = 0;
  int64_t first_row = 0;
  int64_t row_count = 0;
};

// What a reader publishes of its slot for one round.
struct SlotTable {
  std::vector<SlotEntry> packed;
  std::vector<RowsEntry> rows;
};

constexpr size_t kSlotEntryBytes = 4 + 8 + 8;
constexpr size_t kRowsEntryBytes = 4 + 4 + 8 + 8 + 8;

std::string EncodeSlotTable(const SlotTable& table) {
  std::string out;
  ByteWriter writer(&out);
  writer.PutU32(static_cast<uint32_t>(table.packed.size()));
  for (const SlotEntry& e : table.packed) {
    writer.PutU32(e.rank);
    writer.PutU64(e.offset);
    writer.PutU64(e.bytes);
  }
  for (const RowsEntry& e : table.rows) {
    writer.PutU32(e.tensor);
    writer.PutU32(e.chunk);
    writer.PutU64(e.offset);
    writer.PutI64(e.first_row);
    writer.PutI64(e.row_count);
  }
  return out;
}

// What rank `me` copies out of sender `sender`'s slot of `slot_bytes` bytes at `slot`, from the
// table it published: its packed payload (an empty span when it sends none) and the whole rows by
// (tensor, chunk, first row) with the box they cover. kDataLoss for a table that is malformed or
// points outside the slot or the checkpoint's chunks.
struct SenderView {
  std::span<const std::byte> packed;
  // By (tensor, chunk, first row): a chunk cut into row bands may have several in one round.
  std::map<std::tuple<uint32_t, uint32_t, int64_t>, std::pair<const std::byte*, Box>> rows;
};

Result<SenderView> ViewOfSender(std::string_view table, int sender, int me,
                                const std::byte* slot, uint64_t slot_bytes,
                                const CheckpointMetadata& metadata) {
  const std::string who = "rank " + std::to_string(sender);
  if (table.size() < 4) {
    return DataLossError(who + " published a slot table of " + std::to_string(table.size()) +
                         " bytes");
  }
  const uint64_t packed_count = DecodeFixed32(table.data());
  const uint64_t rest = table.size() - 4;
  if (packed_count > rest / kSlotEntryBytes ||
      (rest - packed_count * kSlotEntryBytes) % kRowsEntryBytes != 0) {
    return DataLossError(who + " published a slot table of " + std::to_string(table.size()) +
                         " bytes for " + std::to_string(packed_count) + " payloads");
  }
  auto inside = [&](uint64_t offset, uint64_t bytes) -> Status {
    if (offset > slot_bytes || bytes > slot_bytes - offset) {
      return DataLossError(who + " placed " + std::to_string(bytes) + " bytes at " +
                           std::to_string(offset) + " of its slot of " +
                           std::to_string(slot_bytes) + " bytes");
    }
    return OkStatus();
  };
  SenderView view;
  const char* at = table.data() + 4;
  for (uint64_t k = 0; k < packed_count; ++k, at += kSlotEntryBytes) {
    if (DecodeFixed32(at) != static_cast<uint32_t>(me)) continue;
    const uint64_t offset = DecodeFixed64(at + 4);
    const uint64_t bytes = DecodeFixed64(at + 12);
    SP_RETURN_IF_ERROR(inside(offset, bytes));
    view.packed = std::span<const std::byte>(slot + offset, bytes);
  }
  for (; at < table.data() + table.size(); at += kRowsEntryBytes) {
    const uint32_t tensor = DecodeFixed32(at);
    uint32_t chunk = DecodeFixed32(at + 4);
    const uint64_t offset = DecodeFixed64(at + 8);
    const int64_t first = static_cast<int64_t>(DecodeFixed64(at + 16));
    const int64_t count = static_cast<int64_t>(DecodeFixed64(at + 24));
    const std::optional<uint32_t> index =
        tensor < metadata.tensors.size() ? ChunkIndexOfNumber(metadata.tensors[tensor], chunk)
                                         : std::nullopt;
    // Rows of a chunk this rank's part of the metadata does not hold are for other ranks.
    if (!index && tensor < metadata.tensors.size() && metadata.tensors[tensor].kept) continue;
    if (!index || metadata.tensors[tensor].chunks[*index].box.rank() < 1) {
      return DataLossError(who + " published rows of tensor " + std::to_string(tensor) +
                           " chunk " + std::to_string(chunk) +
                           ", which the checkpoint does not have");
    }
    const TensorMetadata& stored = metadata.tensors[tensor];
    chunk = *index;
    Box rows = stored.chunks[chunk].box;
    const int64_t begin = rows.offsets[0], end = rows.exclusive_max(0);
    if (count <= 0 || first < begin || first > end || count > end - first) {
      return DataLossError(who + " published rows " + std::to_string(first) + " + " +
                           std::to_string(count) + " of chunk " + rows.ToString() +
                           " of tensor '" + stored.name + "'");
    }
    rows.offsets[0] = first;
    rows.sizes[0] = count;
    SP_RETURN_IF_ERROR(
        inside(offset, static_cast<uint64_t>(rows.volume()) * DTypeSize(stored.dtype)));
    view.rows[{tensor, chunk, first}] = {slot + offset, std::move(rows)};
  }
  return view;
}

// Slots per rank in a load through shared memory: round k is read into slot k % kMachineSlots
// while the two rounds before it may still be read (k - 1) and copied out (k - 2).
constexpr size_t kMachineSlots = 3;

// The shared-memory object of a load on one machine: the ranks' RoundBoard, then every rank's
// slots, rank after rank.
struct MachineSlots {
  SharedMemory memory;
  std::vector<uint64_t> slot_bytes;  // per rank: one slot's size
  std::vector<uint64_t> base;        // per rank: where its slots begin

  uint64_t slot_offset(int rank, size_t round) const {
    return base[rank] + (round % kMachineSlots) * slot_bytes[rank];
  }
  std::byte* slot(int rank, size_t round) const {
    return memory.data() + slot_offset(rank, round);
  }
};

// Makes (on rank 0) and maps (everywhere) the object for slots of `my_slot_bytes` on this rank.
// nullopt on every rank when some rank could not map it (or no rank sends anything, which a plan
// that shares a chunk does not leave); an error (the same on every rank) when the communicator
// fails.
Result<std::optional<MachineSlots>> MapMachineSlots(Communicator& comm, std::string_view nonce,
                                                    uint64_t my_slot_bytes) {
  std::string mine;
  ByteWriter(&mine).PutU64(my_slot_bytes);
  SP_ASSIGN_OR_RETURN(std::vector<std::string> sizes, AllGatherOrFail(comm, std::move(mine)));
  std::vector<uint64_t> slot_bytes, base;
  // The board first, on pages of its own.
  const uint64_t board = (RoundBoard::BytesFor(comm.size()) + 4095) / 4096 * 4096;
  uint64_t total = board;
  for (int r = 0; r < comm.size(); ++r) {
    if (sizes[r].size() != 8) {
      return DataLossError("rank " + std::to_string(r) + " published a slot size of " +
                           std::to_string(sizes[r].size()) + " bytes, expected 8");
    }
    slot_bytes.push_back(DecodeFixed64(sizes[r].data()));
    base.push_back(total);
    if (slot_bytes.back() > (uint64_t{1} << 50) - total / 2) {
      return DataLossError("rank " + std::to_string(r) + " asked for a slot of " +
                           std::to_string(slot_bytes.back()) + " bytes");
    }
    total += kMachineSlots * slot_bytes.back();
  }
  if (total == board) return std::optional<MachineSlots>();
  const std::string name = "/shardpoint-xchg-" + std::string(nonce) + "-0";
  // Only the board's pages are reserved here; each rank reserves its own slots as it first reads
  // into them (SharedMemory::Reserve), so that the kernel zeroes them in every process at once
  // and while the first rounds read. Made only when /dev/shm has room for all of them.
  std::optional<SharedMemory> memory;
  if (comm.rank() == 0) {
    Result<SharedMemory> created = SharedMemory::Create(name, total, board);
    if (created.ok()) {
      Result<uint64_t> available = created->AvailableBytes();
      if (available.ok() && *available >= total - board) {
        memory = std::move(created).value();
      } else {
        SharedMemory::Unlink(name);
      }
    }
  }
  // Two flags: whether rank 0 made it (only rank 0 can say it did not), and whether every rank
  // mapped it.
  Result<bool> not_made = comm.AnyRank(comm.rank() == 0 && !memory);
  if (not_made.ok() && !*not_made && comm.rank() != 0) {
    Result<SharedMemory> opened = SharedMemory::Open(name, total, 0, board);
    if (opened.ok()) memory = std::move(opened).value();
  }
  Result<bool> not_mapped = not_made.ok() ? comm.AnyRank(!memory) : not_made;
  // Every rank has it mapped, or never will: the name goes.
  if (comm.rank() == 0 && memory) SharedMemory::Unlink(name);
  SP_RETURN_IF_ERROR(not_mapped.status());
  if (*not_mapped) return std::optional<MachineSlots>();
  return std::optional<MachineSlots>(
      MachineSlots{std::move(memory).value(), std::move(slot_bytes), std::move(base)});
}

// The reads of in-process ranks (AssignInMemoryReads), planned on rank 0 from what every rank
// published (`gathered`: the address of its requests, then its needs) and encoded per rank: the
// count, per read the address of the requests of the rank that needs it and the request's index,
// then the needs read (EncodeNeeds).
Result<std::vector<std::string>> AssignOnRoot(std::vector<std::string>& gathered,
                                              const CheckpointMetadata& metadata) {
  std::vector<RankNeeds> all;
  std::vector<uint64_t> published;
  for (size_t r = 0; r < gathered.size(); ++r) {
    const std::string& bytes = gathered[r];
    if (bytes.size() < 8) {
      return DataLossError("rank " + std::to_string(r) + " published " +
                           std::to_string(bytes.size()) + " bytes of reads");
    }
    SP_ASSIGN_OR_RETURN(RankNeeds needs, DecodeNeeds(std::string_view(bytes).substr(8), metadata,
                                                     static_cast<int>(r)));
    all.push_back(std::move(needs));
    published.push_back(DecodeFixed64(bytes.data()));
    std::string().swap(gathered[r]);
  }
  const std::vector<std::vector<NeedRef>> reads = AssignInMemoryReads(all, metadata);
  std::vector<std::string> shares(reads.size());
  for (size_t r = 0; r < reads.size(); ++r) {
    std::string& out = shares[r];
    ByteWriter writer(&out);
    writer.PutU32(static_cast<uint32_t>(reads[r].size()));
    RankNeeds needs;
    for (const auto& [q, i] : reads[r]) {
      writer.PutU64(published[q]);
      writer.PutU32(static_cast<uint32_t>(i));
      needs.needs.push_back(all[q].needs[i]);
    }
    out += EncodeNeeds(needs);
  }
  return shares;
}

// This rank's reads from its share (AssignOnRoot): requests into the destinations of the ranks
// that need them, with the stored chunks of the load's metadata (so that the requests of one
// chunk are recognised as one and it is read once).
Result<std::vector<ReadRequest>> RequestsOfShare(std::string_view share,
                                                 const CheckpointMetadata& metadata) {
  ByteReader reader(share, "in-process reads from rank 0");
  SP_ASSIGN_OR_RETURN(uint32_t count, reader.ReadCount(12));
  std::vector<std::pair<uint64_t, uint32_t>> targets(count);
  for (auto& [address, index] : targets) {
    SP_ASSIGN_OR_RETURN(address, reader.ReadU64());
    SP_ASSIGN_OR_RETURN(index, reader.ReadU32());
  }
  SP_ASSIGN_OR_RETURN(std::string_view rest, reader.ReadRaw(reader.remaining()));
  SP_ASSIGN_OR_RETURN(RankNeeds needs, DecodeNeeds(rest, metadata, 0));
  if (needs.needs.size() != count) {
    return DataLossError(reader.what() + ": " + std::to_string(count) + " destinations for " +
                         std::to_string(needs.needs.size()) + " needs");
  }
  std::vector<ReadRequest> requests;
  requests.reserve(count);
  for (uint32_t k = 0; k < count; ++k) {
    const ChunkNeed& n = needs.needs[k];
    // The ranks share this address space: the request lies in the publishing rank's array.
    const ReadRequest& published =
        reinterpret_cast<const ReadRequest*>(static_cast<uintptr_t>(targets[k].first))
            [targets[k].second];
    requests.push_back(
        MakeReadRequest(metadata.tensors[n.tensor], n.chunk, published.dest, n.region));
  }
  return requests;
}

}  // namespace

// Ranks that share an address space (Communicator::shares_memory): every stored chunk that some
// rank needs is read once, by the rank whose stretch of the files it lies in
// (AssignInMemoryReads), which copies each rank's regions straight into that rank's destinations,
// so nothing is packed or exchanged and each byte is copied once. Each rank sends rank 0 its
// needs with the address of its read requests (whose destinations the readers use), rank 0
// assigns the reads of all and sends each rank its own, and each rank keeps its requests until
// every rank has finished reading: the status is agreed here.
SharedOutcome LoadSharedInMemory(const LoadState& state, const CheckpointMetadata& metadata,
                                 std::string_view path, const LoadOptions& options,
                                 EngineContext& ctx, IoGate* gate) {
  Communicator& comm = ctx.comm();
  Result<Prepared> prepared = Prepare(state, metadata, path, options, ctx.store());
  // What each rank publishes: the address of its requests, then its needs.
  Result<std::string> mine = [&]() -> Result<std::string> {
    if (!prepared.ok()) return prepared.status();
    std::string out;
    ByteWriter(&out).PutU64(reinterpret_cast<uintptr_t>(prepared->requests.data()));
    return out + EncodeNeeds(NeedsOf(*prepared, metadata, options));
  }();
  // Rank 0 assigns every rank its reads in one pass and sends each rank its own.
  constexpr int kRoot = 0;
  Result<std::vector<std::string>> gathered = GatherOrFail(comm, std::move(mine), kRoot);
  if (!gathered.ok()) return {gathered.status(), true};
  Result<std::vector<std::string>> shares = std::vector<std::string>();
  if (comm.rank() == kRoot) shares = AssignOnRoot(*gathered, metadata);
  Result<std::string> share = ScatterOrFail(comm, std::move(shares), kRoot);
  if (!share.ok()) return {share.status(), true};
  Result<uint64_t> read = [&]() -> Result<uint64_t> {
    SP_ASSIGN_OR_RETURN(std::vector<ReadRequest> requests, RequestsOfShare(*share, metadata));
    std::vector<bool> needed(metadata.files.size(), false);
    for (const ReadRequest& r : requests) needed[r.chunk->file] = true;
    SP_ASSIGN_OR_RETURN(DataFiles files, OpenDataFiles(ctx.store(), path, metadata, needed));
    return ExecuteReads(requests, metadata, files, ctx.pool(),
                        ReadOptionsFor(metadata, options, ctx, gate));
  }();
  // No rank leaves (taking its requests with it) before every rank has written its destinations.
  const Status agreed = AgreeOnStatus(comm, read.status());
  if (!agreed.ok()) return {agreed, true};
  prepared->result.bytes_read = *read;
  return {std::move(prepared->result), true};
}

// Every rank publishes its needs; each stored chunk that several ranks need is read by one of
// them, which sends the others their regions (engine/read_exchange.h).
SharedOutcome LoadShared(const LoadState& state, const CheckpointMetadata& metadata,
                         std::string_view path, const LoadOptions& options, EngineContext& ctx,
                         IoGate* gate) {
  Communicator& comm = ctx.comm();
  Result<Prepared> prepared = Prepare(state, metadata, path, options, ctx.store());
  // Up to three rounds hold memory at once (one unpacked, one exchanged, one read), each at most
  // round_bytes sent plus received: together within the budget.
  Result<ExchangePlan> made =
      PlanOnRoot(comm, prepared, metadata, options,
                 std::max<uint64_t>(1, options.memory_budget_bytes / 3), 0);
  if (!made.ok()) return {made.status(), true};
  const ExchangePlan plan = std::move(made).value();
  if (plan.shared_chunks == 0) {
    // Nothing to exchange: every rank was sent the same count (LoadSharedOnMachine), and reads its
    // own without the rounds' exchanges.
    return {ReadOwn(std::move(prepared).value(), metadata, path, options, ctx, gate), false};
  }
  Prepared& p = *prepared;
  const std::vector<ReadRequest> planned = RequestsOfPlan(p, plan);
  ReadExecutorOptions read_options = ReadOptionsFor(metadata, options, ctx, gate);
  read_options.max_gap_bytes = 0;
  HeaderChecksums headers(metadata.files.size());  // read once for every round
  read_options.header_checksums = &headers;

  // Every data file this rank reads in any round, opened once.
  DataFiles files;
  Status local = OpenFilesOfPlan(plan, planned, metadata, path, ctx, &files);

  // One round's reads: this rank's own regions, and the payloads it sends.
  struct RoundReads {
    Status status;
    uint64_t bytes = 0;
    std::vector<std::pair<int, std::string>> payloads;  // (rank, its regions), as in round.send
  };
  auto read_round = [&](const ExchangeRound& round) {
    RoundReads out;
    Outgoing outgoing(metadata);
    std::vector<ReadRequest> requests;
    for (size_t i : round.own) requests.push_back(planned[i]);
    for (const auto& [q, send] : round.send) outgoing.Add(q, send, requests);
    Result<uint64_t> read = ExecuteReads(requests, metadata, files, ctx.pool(), read_options);
    if (read.ok()) {
      out.bytes = *read;
    } else {
      out.status = read.status();
    }
    out.payloads = outgoing.Take();
    return out;
  };
  uint64_t bytes_read = 0;
  // Round k+1 reads on a helper thread while round k's payloads are exchanged on this one (the
  // only thread that calls the communicator), and round k's regions are copied out of what
  // arrived while round k+2 reads: the storage is kept busy across the exchanges.
  std::unique_ptr<Unpacker> unpacking;
  auto finish_unpacking = [&] {
    if (unpacking == nullptr) return;
    Status status = unpacking->Wait();
    if (local.ok()) local = status;
    unpacking.reset();
  };
  // Declared after everything the reads use: on any return its destructor waits for them.
  std::future<RoundReads> reading;
  auto start_reading = [&](size_t k) {
    if (local.ok() && k < plan.rounds.size()) {
      reading = std::async(std::launch::async, read_round, std::cref(plan.rounds[k]));
    }
  };
  start_reading(0);
  for (size_t k = 0; k < plan.rounds.size(); ++k) {
    const ExchangeRound& round = plan.rounds[k];
    RoundReads done;
    if (reading.valid()) done = reading.get();
    if (local.ok()) local = done.status;
    bytes_read += done.bytes;
    // One flag says whether any rank failed; if none did, each rank sends its regions to the ranks
    // it reads for and receives from those that read for it, and nothing moves between the
    // others. On a failure every rank stops here, in the same round, and the load agrees on the
    // lowest failing rank's error (SharedOutcome::agreed false).
    Result<bool> failed = comm.AnyRank(!local.ok());
    if (!failed.ok()) return {failed.status(), true};
    if (*failed) break;
    start_reading(k + 1);
    std::vector<int> from;
    from.reserve(round.receive.size());
    for (const auto& [s, receive] : round.receive) from.push_back(s);
    Result<std::vector<std::string>> received =
        comm.ExchangeWithPeers(std::move(done.payloads), from);
    if (!received.ok()) return {received.status(), true};
    finish_unpacking();
    if (local.ok()) {
      unpacking = std::make_unique<Unpacker>(ctx.pool());
      unpacking->Start(std::move(received).value(), round, planned);
    }
  }
  finish_unpacking();
  if (!local.ok()) return {local, false};
  p.result.bytes_read = bytes_read;
  return {std::move(p.result), false};
}

SharedOutcome LoadSharedOnMachine(const LoadState& state, const CheckpointMetadata& metadata,
                                  std::string_view path, const LoadOptions& options,
                                  EngineContext& ctx, IoGate* gate, std::string_view nonce) {
  Communicator& comm = ctx.comm();
  const int me = comm.rank();
  Result<Prepared> prepared = Prepare(state, metadata, path, options, ctx.store());
  // A rank's slots hold what it sends in kMachineSlots rounds, so a round sends at most that
  // share of the budget, and at most kMachineRoundBytes: the object's pages are allocated (and
  // zeroed) by the kernel for each load and faulted into every process, which costs more than the
  // copies when the slots are large; small ones are reused round after round.
  // Every rank can read every other's slots, so chunks whose regions would be staged (runs
  // shorter than a scattered read takes) are read as whole rows into the slots, and every rank
  // copies its regions out of them (engine/read_exchange.h).
  ReadExecutorOptions read_options = ReadOptionsFor(metadata, options, ctx, nullptr);
  read_options.max_gap_bytes = 0;
  HeaderChecksums headers(metadata.files.size());  // read once for every round
  read_options.header_checksums = &headers;
  Result<ExchangePlan> made = PlanOnRoot(
      comm, prepared, metadata, options,
      std::clamp<uint64_t>(options.memory_budget_bytes / kMachineSlots, 1, kMachineRoundBytes),
      read_options.scatter_min_run_bytes);
  if (!made.ok()) return {made.status(), true};
  const ExchangePlan plan = std::move(made).value();
  if (plan.shared_chunks == 0) {
    // No rank reads anything for another (a load into the layout of the save): each reads its own.
    // Every rank's plan carries the same count (as it must: the rounds below are collective), so
    // every rank takes this branch, without a collective to agree on it.
    return {ReadOwn(std::move(prepared).value(), metadata, path, options, ctx, gate), false};
  }
  // Round k's slot: the table of what lies where (its length, then EncodeSlotTable), whole rows
  // after it, each placed at an offset that agrees with its file offset modulo a page (so that
  // direct reads land in place), then the packed payloads.
  // A round in which this rank reads nothing for others has no slot (nor table): 0.
  auto sends = [](const ExchangeRound& round) {
    return !round.rows.empty() || !round.send.empty();
  };
  auto lay_out_rows = [&](const ExchangeRound& round, std::vector<RowsEntry>* entries) {
    if (!sends(round)) return uint64_t{0};
    uint64_t at = 8 + 4 + kSlotEntryBytes * static_cast<uint64_t>(comm.size()) +
                  kRowsEntryBytes * round.rows.size();
    for (const WholeRows& w : round.rows) {
      const TensorMetadata& stored = metadata.tensors[w.tensor];
      const StoredChunk& chunk = stored.chunks[w.chunk];
      const uint64_t row_bytes =
          static_cast<uint64_t>(chunk.box.volume() / std::max<int64_t>(1, chunk.box.sizes[0])) *
          DTypeSize(stored.dtype);
      const uint64_t file_offset =
          metadata.files[chunk.file].data_start + chunk.data_offset +
          static_cast<uint64_t>(w.rows.offsets[0] - chunk.box.offsets[0]) * row_bytes;
      at += (file_offset - at) % kSlotAlignment;
      if (entries != nullptr) {
        entries->push_back(RowsEntry{w.tensor, ChunkNumber(stored, w.chunk), at,
                                     w.rows.offsets[0], w.rows.sizes[0]});
      }
      at += WholeRowsBytes(w, metadata);
    }
    return (at + 15) / 16 * 16;
  };
  uint64_t my_slot_bytes = 0;
  for (const ExchangeRound& round : plan.rounds) {
    uint64_t sent = lay_out_rows(round, nullptr);
    for (const auto& [q, send] : round.send) sent += PackedBytesOf(metadata, send);
    my_slot_bytes = std::max(my_slot_bytes, sent);
  }
  my_slot_bytes = (my_slot_bytes + 4095) / 4096 * 4096;  // each slot on a page of its own
  Result<std::optional<MachineSlots>> mapped = MapMachineSlots(comm, nonce, my_slot_bytes);
  if (!mapped.ok()) return {mapped.status(), true};
  if (!mapped->has_value()) {
    // The same on every rank: no shared memory for the slots.
    if (options.share_reads.value_or(false)) {
      return LoadShared(state, metadata, path, options, ctx, gate);
    }
    return {ReadOwn(std::move(prepared).value(), metadata, path, options, ctx, gate), false};
  }
  const MachineSlots& slots = **mapped;
  // What is read into the slots lands in staging first (ReadExecutorOptions::staged_from), and
  // the staging buffers stay with the pool from round to round.
  read_options.staged_from = slots.memory.data();
  read_options.staged_to = slots.memory.data() + slots.memory.size();
  BufferPool::Stay staging_stays(ctx.pool().staging());
  RoundBoard board(slots.memory.data(), comm.size(), me);
  Prepared& p = *prepared;
  const std::vector<ReadRequest> planned = RequestsOfPlan(p, plan);
  DataFiles files;
  Status local = OpenFilesOfPlan(plan, planned, metadata, path, ctx, &files);

  // One round's reads: this rank's own regions, and what it reads into its slot for others,
  // with the slot's table written ahead of them once they are in.
  struct RoundReads {
    Status status;
    uint64_t bytes = 0;
  };
  // Which of this rank's slots it has reserved: each before it is first read into (by the thread
  // that reads round k, which is never running with the one that reads round k + kMachineSlots).
  std::array<bool, kMachineSlots> reserved{};
  auto read_round = [&](size_t k) {
    RoundReads out;
    const ExchangeRound& round = plan.rounds[k];
    if (sends(round) && !reserved[k % kMachineSlots]) {
      out.status = slots.memory.Reserve(slots.slot_offset(me, k), slots.slot_bytes[me]);
      if (!out.status.ok()) return out;
      reserved[k % kMachineSlots] = true;
    }
    std::vector<ReadRequest> requests;
    for (size_t i : round.own) requests.push_back(planned[i]);
    SlotTable table;
    uint64_t at = lay_out_rows(round, &table.rows);
    std::byte* slot = slots.slot(me, k);
    for (size_t j = 0; j < round.rows.size(); ++j) {
      const WholeRows& w = round.rows[j];
      const TensorMetadata& stored = metadata.tensors[w.tensor];
      requests.push_back(MakeReadRequest(
          stored, w.chunk, ReadDestination{slot + table.rows[j].offset, w.rows, stored.dtype},
          w.rows));
    }
    for (const auto& [q, send] : round.send) {
      const uint64_t bytes = PackedBytesOf(metadata, send);
      PackRegionReads(metadata, send, slot + at, requests);
      table.packed.push_back(SlotEntry{static_cast<uint32_t>(q), at, bytes});
      at += bytes;
    }
    Result<uint64_t> read = ExecuteReads(requests, metadata, files, ctx.pool(), read_options);
    if (!read.ok()) {
      out.status = read.status();
      return out;
    }
    out.bytes = *read;
    if (!sends(round)) return out;
    const std::string encoded = EncodeSlotTable(table);
    EncodeFixed64(reinterpret_cast<char*>(slot), encoded.size());
    std::memcpy(slot + 8, encoded.data(), encoded.size());
    return out;
  };
  // Declared after everything the reads use: their destructors wait for them on any path.
  // reading[k % 2] reads round k.
  std::future<RoundReads> reading[2];
  auto start_reading = [&](size_t k) {
    reading[k % 2] = std::async(std::launch::async, read_round, k);
  };
  // Copies this rank's regions of round k out of the slots of the ranks that read them, once
  // each of them has published the round, on the pool; Wait() returns the first error.
  auto start_copying = [&](size_t k, Unpacker& unpacking) -> Status {
    const ExchangeRound& round = plan.rounds[k];
    // The ranks this one copies regions from: those that pack regions for it and those whose
    // rows it copies out of, in ascending order.
    const std::vector<size_t> none;
    size_t next_packed = 0, next_rows = 0;
    while (next_packed < round.receive.size() || next_rows < round.from_rows.size()) {
      const int s = std::min(next_packed < round.receive.size()
                                 ? round.receive[next_packed].first
                                 : std::numeric_limits<int>::max(),
                             next_rows < round.from_rows.size() ? round.from_rows[next_rows].first
                                                                : std::numeric_limits<int>::max());
      const std::vector<size_t>& receive =
          next_packed < round.receive.size() && round.receive[next_packed].first == s
              ? round.receive[next_packed++].second
              : none;
      const std::vector<size_t>& from_rows =
          next_rows < round.from_rows.size() && round.from_rows[next_rows].first == s
              ? round.from_rows[next_rows++].second
              : none;
      SP_RETURN_IF_ERROR(board.WaitPublished(s, static_cast<uint32_t>(k + 1)));
      const std::byte* slot = slots.slot(s, k);
      const uint64_t table_bytes = DecodeFixed64(reinterpret_cast<const char*>(slot));
      if (slots.slot_bytes[s] < 8 || table_bytes > slots.slot_bytes[s] - 8) {
        return DataLossError("rank " + std::to_string(s) + " published a slot table of " +
                             std::to_string(table_bytes) + " bytes in a slot of " +
                             std::to_string(slots.slot_bytes[s]));
      }
      SP_ASSIGN_OR_RETURN(
          SenderView view,
          ViewOfSender(std::string_view(reinterpret_cast<const char*>(slot) + 8, table_bytes), s,
                       me, slot, slots.slot_bytes[s], metadata));
      unpacking.StartView(s, view.packed, receive, planned);
      for (size_t i : from_rows) {
        const ReadRequest& r = planned[i];
        const uint32_t tensor = static_cast<uint32_t>(r.stored - metadata.tensors.data());
        const uint32_t chunk = static_cast<uint32_t>(r.chunk - r.stored->chunks.data());
        // The rows that begin last at or before the region's first row.
        auto found = view.rows.upper_bound({tensor, chunk, r.region.offsets[0]});
        if (found != view.rows.begin()) --found;
        if (found == view.rows.end() || std::get<0>(found->first) != tensor ||
            std::get<1>(found->first) != chunk || !Contains(found->second.second, r.region)) {
          return DataLossError("rank " + std::to_string(s) + " published no rows of tensor '" +
                               r.stored->name + "' chunk " + r.chunk->box.ToString() +
                               " holding " + r.region.ToString());
        }
        unpacking.StartFromRows(found->second.first, found->second.second, &r);
      }
    }
    return OkStatus();
  };
  // Rounds go through the board (exec/round_board.h), not the communicator: round k is published
  // as soon as this rank has read it; round k+2 is read into the slot of round k-1 once every
  // rank has copied that one out; round k is copied out while round k+1 reads.
  uint64_t bytes_read = 0;
  bool peer_stopped = false;  // this rank stopped because another did
  std::unique_ptr<Unpacker> unpacking;
  auto finish_copying = [&](size_t k) {
    if (unpacking == nullptr) return;
    Status status = unpacking->Wait();
    unpacking.reset();
    if (local.ok()) local = status;
    if (local.ok()) board.Copied(static_cast<uint32_t>(k + 1));
  };
  const size_t rounds = plan.rounds.size();
  if (local.ok()) start_reading(0);
  if (local.ok() && rounds > 1) start_reading(1);
  for (size_t k = 0; k < rounds && local.ok(); ++k) {
    RoundReads done = reading[k % 2].get();
    local = done.status;
    bytes_read += done.bytes;
    if (!local.ok()) break;
    board.Published(static_cast<uint32_t>(k + 1));
    if (k > 0) finish_copying(k - 1);
    if (!local.ok()) break;
    if (k + 2 < rounds) {
      local = board.WaitAllCopied(static_cast<uint32_t>(k));
      if (!local.ok()) break;
      start_reading(k + 2);
    }
    unpacking = std::make_unique<Unpacker>(ctx.pool());
    local = start_copying(k, *unpacking);
  }
  if (local.ok()) finish_copying(rounds - 1);
  peer_stopped = !local.ok() && board.stopped() && local.code() == StatusCode::kAborted;
  // No rank waits for this one any more; then its reads and copies in flight end.
  if (!local.ok()) board.Stop();
  for (std::future<RoundReads>& f : reading) {
    if (f.valid()) f.wait();
  }
  if (unpacking != nullptr) (void)unpacking->Wait();

  // The outcome, the same on every rank: the first error of a rank that did not stop because
  // another did (that one's error says why), else the first error. A flag says whether there is
  // one; the errors travel only then.
  Result<bool> any_failed = comm.AnyRank(!local.ok());
  if (!any_failed.ok()) return {any_failed.status(), true};
  if (!*any_failed) {
    p.result.bytes_read = bytes_read;
    return {std::move(p.result), true, true};
  }
  std::string mine(1, peer_stopped ? '\1' : '\0');
  mine += EncodeStatus(local);
  Result<std::vector<std::string>> outcomes = comm.AllGather(std::move(mine));
  if (!outcomes.ok()) return {outcomes.status(), true};
  Status first, cause;
  for (int r = 0; r < comm.size(); ++r) {
    const std::string& bytes = (*outcomes)[r];
    Status status;
    Status decoded = bytes.empty() ? DataLossError("rank " + std::to_string(r) +
                                                   " published an empty outcome")
                                   : DecodeStatus(std::string_view(bytes).substr(1), &status);
    if (!decoded.ok()) status = decoded;
    if (status.ok()) continue;
    status = status.WithContext("rank " + std::to_string(r));
    if (first.ok()) first = status;
    if (cause.ok() && (bytes.empty() || bytes[0] == '\0')) cause = status;
  }
  if (!cause.ok()) return {cause, true, true};
  if (!first.ok()) return {first, true, true};
  p.result.bytes_read = bytes_read;
  return {std::move(p.result), true, true};
}

}  // namespace sp
