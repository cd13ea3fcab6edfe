// Load: the coordinator reads the metadata and broadcasts it; every rank plans its reads from box
// intersections; with several ranks they share the reads of stored chunks that several of them
// need (engine/read_exchange.h); the read executor does the reads; every rank returns the same
// outcome.
#include <algorithm>
#include <cstring>
#include <future>
#include <set>

#include "shardpoint/engine/load.h"
#include "shardpoint/base/random_id.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/local_state.h"
#include "shardpoint/engine/opened_checkpoint.h"
#include "shardpoint/engine/read_exchange.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/exec/shared_io_tuner.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/plan/load_plan.h"
#include "shardpoint/store/open_store.h"

namespace sp {
namespace {

Result<std::vector<LocalTensor>> BuildTargets(const LoadState& state) {
  std::vector<LocalTensor> targets;
  std::set<std::string_view> names;
  for (const LoadTensor& t : state.tensors) {
    SP_ASSIGN_OR_RETURN(LocalTensor local, ToLocalTensor(t, names));
    targets.push_back(std::move(local));
  }
  return targets;
}

// One rank's load before any read: the result without bytes_read, and its read requests.
struct Prepared {
  LoadResult result;
  LoadPlan plan;
  std::vector<ReadRequest> requests;
};

Result<Prepared> Prepare(const LoadState& state, const CheckpointMetadata& metadata,
                         std::string_view path, const LoadOptions& options, Store& store) {
  SP_ASSIGN_OR_RETURN(std::vector<LocalTensor> targets, BuildTargets(state));
  Prepared p;
  SP_ASSIGN_OR_RETURN(p.plan, PlanLoad(targets, metadata,
                                       LoadPlanOptions{options.strict, options.allow_cast}));
  LoadResult& result = p.result;
  result.missing_keys = p.plan.missing_keys;
  result.unexpected_keys = p.plan.unexpected_keys;
  std::set<std::string_view> wanted(state.objects.begin(), state.objects.end());
  for (const std::string& name : state.objects) {
    const ObjectEntry* object = metadata.FindObject(name);
    if (object != nullptr) {
      result.objects.push_back(*object);
    } else if (options.strict) {
      return NotFoundError("key '" + name + "' is not in the checkpoint at " + std::string(path));
    } else {
      result.missing_keys.push_back(name);
    }
  }
  // Objects whose items the driver has not read yet (DCP) are read now, only those wanted.
  SP_RETURN_IF_ERROR(ReadObjectPayloads(store, path, metadata, result.objects));
  for (const ObjectEntry& object : metadata.objects) {
    if (!wanted.count(object.name)) result.unexpected_keys.push_back(object.name);
  }
  std::sort(result.unexpected_keys.begin(), result.unexpected_keys.end());

  p.requests.reserve(p.plan.items.size());
  for (const ReadItem& item : p.plan.items) {
    const TensorMetadata* stored = p.plan.stored[item.target];
    const LoadTensor& dest = state.tensors[item.target];
    p.requests.push_back(MakeReadRequest(*stored, item.stored_chunk,
                                         IntoPiece(dest.pieces[item.target_box], dest.dtype),
                                         item.region));
  }
  return p;
}

ReadExecutorOptions ReadOptionsFor(const CheckpointMetadata& metadata, const LoadOptions& options,
                                   EngineContext& ctx, IoGate* gate) {
  ReadExecutorOptions read_options;
  read_options.gate = gate;
  read_options.verify = options.verify_checksums;
  read_options.direct_io = options.direct_io;
  read_options.direct_io_min_bytes = options.direct_io_min_bytes;
  read_options.io_depth = options.io_depth;
  // Staging per task; a cast needs up to twice more for the packed and converted copies.
  const uint64_t tasks = static_cast<uint64_t>(std::max(1, ctx.pool().size()));
  read_options.window = std::max<uint64_t>(std::max<uint64_t>(1, metadata.checksum_block_bytes),
                                           options.memory_budget_bytes / (3 * tasks));
  return read_options;
}

// Each rank reads its own requests.
Result<LoadResult> LoadLocal(const LoadState& state, const CheckpointMetadata& metadata,
                             std::string_view path, const LoadOptions& options,
                             EngineContext& ctx, IoGate* gate) {
  SP_ASSIGN_OR_RETURN(Prepared p, Prepare(state, metadata, path, options, ctx.store()));
  SP_ASSIGN_OR_RETURN(DataFiles files, OpenDataFiles(ctx.store(), path, metadata,
                                                     DataFilesRead(p.requests, metadata)));
  SP_ASSIGN_OR_RETURN(p.result.bytes_read,
                      ExecuteReads(p.requests, metadata, files, ctx.pool(),
                                   ReadOptionsFor(metadata, options, ctx, gate)));
  return std::move(p.result);
}

// The outcome of a load with shared reads. `agreed`: the error came out of a collective and is
// already the same on every rank.
struct SharedOutcome {
  Result<LoadResult> result;
  bool agreed = false;
};

// Requests that read other ranks' regions into the payloads sent to them.
class Outgoing {
 public:
  Outgoing(const CheckpointMetadata& metadata, int ranks) : metadata_(metadata), payloads_(ranks) {}

  // Sizes payload q for `needs` and appends a request per need, reading into it.
  void Add(int q, const std::vector<ChunkNeed>& needs, std::vector<ReadRequest>& requests) {
    uint64_t total = 0;
    for (const ChunkNeed& n : needs) {
      total += PackedBytes(n.region, metadata_.tensors[n.tensor].dtype);
    }
    std::string& payload = payloads_[q];
    payload.reserve(total + 1);  // + the envelope's tag, so the payload moves uncopied
    payload.resize(total);
    uint64_t at = 0;
    for (const ChunkNeed& n : needs) {
      const TensorMetadata& stored = metadata_.tensors[n.tensor];
      // The region lands packed, in the stored dtype, at its place in the payload.
      ReadDestination dest{reinterpret_cast<std::byte*>(payload.data() + at), n.region,
                           stored.dtype};
      requests.push_back(MakeReadRequest(stored, n.chunk, std::move(dest), n.region));
      at += PackedBytes(n.region, stored.dtype);
    }
  }

  std::vector<std::string> Take() { return std::move(payloads_); }

 private:
  const CheckpointMetadata& metadata_;
  std::vector<std::string> payloads_;
};

// Copies the regions other ranks read for this rank out of their payloads, in tasks on the pool
// that run while the next round reads; Wait() returns the first error.
class Unpacker {
 public:
  explicit Unpacker(ThreadPool& pool) : group_(&pool) {}

  void Start(std::vector<std::string> payloads, const ExchangeRound& round,
             const std::vector<ReadRequest>& requests) {
    payloads_ = std::move(payloads);
    for (size_t s = 0; s < payloads_.size(); ++s) {
      const std::string& payload = payloads_[s];
      uint64_t at = 0;
      for (size_t i : round.receive[s]) {
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
        const std::byte* src = reinterpret_cast<const std::byte*>(payload.data() + at);
        group_.Run([r, src] {
          return CopyToDestination(ConstChunkView{src, r->region, DTypeSize(r->stored->dtype)},
                                   r->region, *r);
        });
        at += bytes;
      }
    }
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
// in request order.
RankNeeds NeedsOf(const Prepared& p, const CheckpointMetadata& metadata, const LoadOptions& options) {
  RankNeeds needs;
  needs.verify = options.verify_checksums;
  for (const ReadRequest& r : p.requests) {
    needs.needs.push_back(ChunkNeed{static_cast<uint32_t>(r.stored - metadata.tensors.data()),
                                    static_cast<uint32_t>(r.chunk - r.stored->chunks.data()),
                                    r.region});
  }
  return needs;
}

// Ranks that share an address space (Communicator::shares_memory): every stored chunk that some
// rank needs is read once, by the rank whose stretch of the files it lies in
// (AssignInMemoryReads), which copies each rank's regions straight into that rank's destinations,
// so nothing is packed or exchanged and each byte is copied once. Each rank publishes with its
// needs the address of its read requests (whose destinations the readers use) and keeps them
// until every rank has finished reading: the status is agreed here.
SharedOutcome LoadSharedInMemory(const LoadState& state, const CheckpointMetadata& metadata,
                                 std::string_view path, const LoadOptions& options,
                                 EngineContext& ctx, IoGate* gate) {
  Communicator& comm = ctx.comm();
  Result<Prepared> prepared = Prepare(state, metadata, path, options, ctx.store());
  Result<std::string> mine = [&]() -> Result<std::string> {
    if (!prepared.ok()) return prepared.status();
    const ReadRequest* requests = prepared->requests.data();
    std::string out(sizeof(requests), '\0');
    std::memcpy(out.data(), &requests, sizeof(requests));
    return out + EncodeNeeds(NeedsOf(*prepared, metadata, options));
  }();
  Result<std::vector<std::string>> gathered = AllGatherOrFail(comm, std::move(mine));
  if (!gathered.ok()) return {gathered.status(), true};
  std::vector<RankNeeds> all;
  std::vector<const ReadRequest*> published;
  for (int r = 0; r < comm.size(); ++r) {
    const std::string& bytes = (*gathered)[r];
    const ReadRequest* requests = nullptr;
    if (bytes.size() >= sizeof(requests)) std::memcpy(&requests, bytes.data(), sizeof(requests));
    Result<RankNeeds> needs =
        bytes.size() >= sizeof(requests)
            ? DecodeNeeds(std::string_view(bytes).substr(sizeof(requests)), metadata, r)
            : Result<RankNeeds>(DataLossError("rank " + std::to_string(r) + " published " +
                                              std::to_string(bytes.size()) + " bytes of reads"));
    if (!needs.ok()) return {needs.status(), true};  // the same bytes fail the same everywhere
    all.push_back(std::move(needs).value());
    published.push_back(requests);
  }
  gathered->clear();
  // This rank's share of the reads, into the destinations of the ranks that need them (with the
  // stored chunks of this rank's copy of the metadata, so that the requests of one chunk are
  // recognised as one and it is read once).
  std::vector<ReadRequest> requests;
  std::vector<bool> needed(metadata.files.size(), false);
  for (const auto& [q, i] : AssignInMemoryReads(all, comm.rank(), metadata)) {
    const ChunkNeed& n = all[q].needs[i];
    requests.push_back(
        MakeReadRequest(metadata.tensors[n.tensor], n.chunk, published[q][i].dest, n.region));
  }
  for (const ReadRequest& r : requests) needed[r.chunk->file] = true;
  Result<uint64_t> read = [&]() -> Result<uint64_t> {
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
  Result<std::string> mine = [&]() -> Result<std::string> {
    if (!prepared.ok()) return prepared.status();
    return EncodeNeeds(NeedsOf(*prepared, metadata, options));
  }();
  Result<std::vector<std::string>> gathered = AllGatherOrFail(comm, std::move(mine));
  if (!gathered.ok()) return {gathered.status(), true};
  std::vector<RankNeeds> all;
  for (int r = 0; r < comm.size(); ++r) {
    Result<RankNeeds> needs = DecodeNeeds((*gathered)[r], metadata, r);
    if (!needs.ok()) return {needs.status(), true};  // the same bytes fail the same everywhere
    all.push_back(std::move(needs).value());
  }
  gathered->clear();
  // Up to three rounds hold memory at once (one unpacked, one exchanged, one read), each at most
  // round_bytes sent plus received: together within the budget.
  const ExchangePlan plan = PlanExchange(all, comm.rank(), metadata,
                                         std::max<uint64_t>(1, options.memory_budget_bytes / 3));
  Prepared& p = *prepared;
  ReadExecutorOptions read_options = ReadOptionsFor(metadata, options, ctx, gate);
  read_options.max_gap_bytes = 0;

  // Every data file this rank reads in any round, opened once.
  DataFiles files;
  Status local = [&]() -> Status {
    std::vector<bool> needed(metadata.files.size(), false);
    for (const ExchangeRound& round : plan.rounds) {
      for (size_t i : round.own) needed[p.requests[i].chunk->file] = true;
      for (int q = 0; q < comm.size(); ++q) {
        for (const ChunkNeed& n : round.send[q]) {
          needed[metadata.tensors[n.tensor].chunks[n.chunk].file] = true;
        }
      }
    }
    SP_ASSIGN_OR_RETURN(files, OpenDataFiles(ctx.store(), path, metadata, needed));
    return OkStatus();
  }();

  // One round's reads: this rank's own regions, and the payloads it sends.
  struct RoundReads {
    Status status;
    uint64_t bytes = 0;
    std::vector<std::string> payloads;
  };
  auto read_round = [&](const ExchangeRound& round) {
    RoundReads out;
    Outgoing outgoing(metadata, comm.size());
    std::vector<ReadRequest> requests;
    for (size_t i : round.own) requests.push_back(p.requests[i]);
    for (int q = 0; q < comm.size(); ++q) {
      if (!round.send[q].empty()) outgoing.Add(q, round.send[q], requests);
    }
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
    start_reading(k + 1);
    Result<std::vector<std::string>> payloads =
        local.ok() ? Result<std::vector<std::string>>(std::move(done.payloads))
                   : Result<std::vector<std::string>>(local);
    Result<std::vector<std::string>> received = AllToAllOrFail(comm, std::move(payloads));
    if (!received.ok()) return {received.status(), true};
    finish_unpacking();
    if (local.ok()) {
      unpacking = std::make_unique<Unpacker>(ctx.pool());
      unpacking->Start(std::move(received).value(), round, p.requests);
    }
  }
  finish_unpacking();
  if (!local.ok()) return {local, false};
  p.result.bytes_read = bytes_read;
  return {std::move(p.result), false};
}

// The digits of the nonce the coordinator sends ahead of the metadata: it names this load's
// shared read gates.
constexpr size_t kNonceDigits = 16;

// The read gate this rank shares with the ranks of its machine that run in other processes
// (Communicator::machine_ranks), or null: sharing turned off, a fixed io_depth, alone on its
// machine, or a gate that could not be attached (no shared memory, a foreign object
// of that name); then the reads go through the pool's own tuner. Every rank calls it at the same
// point with the same options (machine_ranks may be a collective).
std::unique_ptr<SharedIoTuner> MachineGate(Communicator& comm, std::string_view nonce,
                                           const LoadOptions& options, ThreadPool& pool) {
  if (comm.size() < 2 || options.io_depth > 0 || !options.machine_read_gate) return nullptr;
  const std::vector<int> local = comm.machine_ranks();
  if (local.size() < 2) return nullptr;
  const auto me = std::find(local.begin(), local.end(), comm.rank());
  if (me == local.end()) return nullptr;
  IoTunerConfig config;
  // Each member runs at most its pool's threads reads at once; the members are alike. The climb
  // starts where the members' own gates stand (their depths summed, this member's times the
  // members): a fresh gate for each load would otherwise start shallow every time.
  config.max_depth = static_cast<int>(std::min<uint64_t>(
      kMaxIoDepth, local.size() * static_cast<uint64_t>(std::max(1, pool.size()))));
  config.start_depth = static_cast<int>(std::min<uint64_t>(
      config.max_depth, local.size() * static_cast<uint64_t>(pool.io_tuner().depth())));
  const std::string name =
      "/shardpoint-io-" + std::string(nonce) + "-" + std::to_string(local.front());
  Result<std::unique_ptr<SharedIoTuner>> gate = SharedIoTuner::Attach(
      name, static_cast<int>(local.size()), static_cast<int>(me - local.begin()), config);
  if (!gate.ok()) return nullptr;
  return std::move(gate).value();
}

}  // namespace

Result<CheckpointMetadata> ReadCheckpointMetadata(std::string_view path, Store* store) {
  std::unique_ptr<Store> owned;
  if (store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned, OpenStore(path));
    store = owned.get();
  }
  return OpenCheckpointMetadata(*store, path, nullptr);
}

Result<std::vector<ObjectEntry>> ReadCheckpointObjects(std::string_view path,
                                                       std::span<const std::string> names,
                                                       Store* store) {
  std::unique_ptr<Store> owned;
  if (store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned, OpenStore(path));
    store = owned.get();
  }
  SP_ASSIGN_OR_RETURN(CheckpointMetadata metadata, OpenCheckpointMetadata(*store, path, nullptr));
  std::vector<ObjectEntry> out;
  for (const std::string& name : names) {
    if (const ObjectEntry* object = metadata.FindObject(name)) out.push_back(*object);
  }
  SP_RETURN_IF_ERROR(ReadObjectPayloads(*store, path, metadata, out));
  return out;
}

Result<LoadResult> Load(const LoadState& state, std::string_view path,
                        const LoadOptions& options) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, options.comm, options.store, options.pool,
                                          options.threads, options.coordinator));
  Communicator& comm = ctx->comm();
  const int root = options.coordinator;
  // The coordinator opens the checkpoint, whatever its format, and every rank gets the decoded
  // metadata (or the same error), so a corrupt file fails identically everywhere.
  // Ahead of the metadata goes a nonce that names this load's shared read gates.
  Result<std::string> encoded = [&]() -> Result<std::string> {
    if (comm.rank() != root) return std::string();
    SP_ASSIGN_OR_RETURN(CheckpointMetadata metadata,
                        OpenCheckpointMetadata(ctx->store(), path, &ctx->pool()));
    return RandomHexId(kNonceDigits) + EncodeMetadataForWire(metadata);
  }();
  SP_ASSIGN_OR_RETURN(std::string bytes, BroadcastOrFail(comm, std::move(encoded), root));
  if (bytes.size() < kNonceDigits) {
    return DataLossError("the load's metadata broadcast holds " + std::to_string(bytes.size()) +
                         " bytes, expected at least " + std::to_string(kNonceDigits));
  }
  const std::string_view nonce = std::string_view(bytes).substr(0, kNonceDigits);
  // Every rank decodes the same bytes, so a decoding error is the same everywhere.
  Result<CheckpointMetadata> metadata =
      DecodeMetadataFromWire(std::string_view(bytes).substr(kNonceDigits));
  if (!metadata.ok()) return metadata.status();
  const std::unique_ptr<SharedIoTuner> gate = MachineGate(comm, nonce, options, ctx->pool());
  // The communicator is asked only when the caller left share_reads unset and the store is local
  // (asking may cost a collective, e.g. an exchange of host names). Every rank opens the same
  // kind of store for the path, so all take the same branch. Ranks that share an address space
  // share reads by default: it costs them nothing.
  const bool share = options.share_reads.has_value()         ? *options.share_reads
                     : ctx->store().reads_cross_the_network() ? true
                     : comm.shares_memory()                   ? true
                                                              : comm.spans_machines();
  if (share && comm.size() > 1) {
    SharedOutcome outcome =
        comm.shares_memory()
            ? LoadSharedInMemory(state, *metadata, path, options, *ctx, gate.get())
            : LoadShared(state, *metadata, path, options, *ctx, gate.get());
    if (outcome.agreed) return outcome.result;
    SP_RETURN_IF_ERROR(AgreeOnStatus(comm, outcome.result.status()));
    if (gate != nullptr) outcome.result->read_gate_ranks = gate->joined();
    return outcome.result;
  }
  Result<LoadResult> result = LoadLocal(state, *metadata, path, options, *ctx, gate.get());
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, result.status()));
  // Every member attached before this collective: joined() counts them all.
  if (gate != nullptr) result->read_gate_ranks = gate->joined();
  return result;
}

}  // namespace sp
