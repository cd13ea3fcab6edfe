// Load: the coordinator reads the metadata and sends each rank its part of it (or all of it);
// every rank plans its reads from box intersections; with several ranks they share the reads of
// stored chunks that several of them need (engine/read_exchange.h); the read executor does the
// reads; every rank returns the same outcome.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>

#include "shardpoint/engine/load.h"
#include "shardpoint/engine/load_internal.h"
#include "shardpoint/base/coding.h"
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

// What a rank asks a load's coordinator for (MetadataRequest): the whole metadata, or a part (its
// ChunkFilter follows).
constexpr char kWholeAsked = 'A';
constexpr char kPartAsked = 'F';

Result<std::vector<LocalTensor>> BuildTargets(const LoadState& state) {
  std::vector<LocalTensor> targets;
  std::set<std::string_view> names;
  for (const LoadTensor& t : state.tensors) {
    SP_ASSIGN_OR_RETURN(LocalTensor local, ToLocalTensor(t, names));
    targets.push_back(std::move(local));
  }
  return targets;
}

}  // namespace

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
  read_options.scatter_min_run_bytes = options.scatter_min_run_bytes.value_or(
      ctx.store().reads_cross_the_network() ? kMinScatterRunBytes : kMinScatterRunBytesLocal);
  read_options.io_depth = options.io_depth;
  read_options.reads_begin_ns = &ctx.reads_begin_ns();
  // Staging per task; a cast needs up to twice more for the packed and converted copies.
  const uint64_t tasks = static_cast<uint64_t>(std::max(1, ctx.pool().size()));
  read_options.window = std::max<uint64_t>(std::max<uint64_t>(1, metadata.checksum_block_bytes),
                                           options.memory_budget_bytes / (3 * tasks));
  return read_options;
}

Result<LoadResult> ReadOwn(Prepared p, const CheckpointMetadata& metadata, std::string_view path,
                           const LoadOptions& options, EngineContext& ctx, IoGate* gate) {
  SP_ASSIGN_OR_RETURN(DataFiles files, OpenDataFiles(ctx.store(), path, metadata,
                                                     DataFilesRead(p.requests, metadata)));
  SP_ASSIGN_OR_RETURN(p.result.bytes_read,
                      ExecuteReads(p.requests, metadata, files, ctx.pool(),
                                   ReadOptionsFor(metadata, options, ctx, gate)));
  return std::move(p.result);
}

namespace {

// Each rank reads its own requests.
Result<LoadResult> LoadLocal(const LoadState& state, const CheckpointMetadata& metadata,
                             std::string_view path, const LoadOptions& options,
                             EngineContext& ctx, IoGate* gate) {
  SP_ASSIGN_OR_RETURN(Prepared p, Prepare(state, metadata, path, options, ctx.store()));
  return ReadOwn(std::move(p), metadata, path, options, ctx, gate);
}

// The digits of the nonce the coordinator sends ahead of the metadata: it names this load's
// shared read gates.
constexpr size_t kNonceDigits = 16;
// After the nonce, one byte says what follows: a native checkpoint's metadata file as stored, or
// another format's metadata encoded for the wire (format/metadata_wire.h).
constexpr char kNativeFileFollows = 'N';
constexpr char kWireMetadataFollows = 'W';
// Between ranks that share an address space: the address of one decoded copy (SharedMetadata).
constexpr char kSharedMetadataFollows = 'P';

// One decoded copy of the metadata for every rank of an address space: the coordinator makes a
// reference per rank, each rank moves its own out, and the last to do so frees the box.
struct SharedMetadata {
  std::vector<std::shared_ptr<const CheckpointMetadata>> refs;  // indexed by rank
  std::atomic<int> untaken{0};

  static std::shared_ptr<const CheckpointMetadata> Take(SharedMetadata* box, int rank) {
    std::shared_ptr<const CheckpointMetadata> mine = std::move(box->refs[rank]);
    if (box->untaken.fetch_sub(1, std::memory_order_acq_rel) == 1) delete box;
    return mine;
  }
};

// The load's metadata and nonce. Ranks in separate address spaces each decode the coordinator's
// broadcast; ranks that share one (Communicator::shares_memory) share the coordinator's decoded
// copy, whatever their count: each would otherwise decode and hold a copy of its own.
struct LoadMetadata {
  std::string nonce;
  std::shared_ptr<const CheckpointMetadata> metadata;
};

// Every rank gets the whole metadata (LoadOptions::own_chunks_only off, or ranks that share an
// address space); MetadataPartsOfLoad below sends each rank its part instead.
Result<LoadMetadata> MetadataOfLoad(Communicator& comm, EngineContext& ctx, std::string_view path,
                                    int root) {
  const bool share = comm.shares_memory() && comm.size() > 1;
  // The coordinator opens the checkpoint, whatever its format, and every rank gets its metadata
  // (or the same error), so a corrupt file fails identically everywhere. A native checkpoint's
  // metadata file goes as stored and every rank decodes it: the coordinator does not decode it
  // and encode it again before the others can start, and the file is smaller than that encoding.
  // Other formats' drivers assemble the metadata from several files, so it goes decoded and
  // encoded for the wire. Ahead of it goes a nonce that names this load's shared read gates.
  Result<std::string> encoded = [&]() -> Result<std::string> {
    if (comm.rank() != root) return std::string();
    const std::string nonce = RandomHexId(kNonceDigits);
    if (share) {
      SP_ASSIGN_OR_RETURN(CheckpointMetadata opened,
                          OpenCheckpointMetadata(ctx.store(), path, &ctx.pool()));
      auto* box = new SharedMetadata;
      box->refs.assign(static_cast<size_t>(comm.size()),
                       std::make_shared<const CheckpointMetadata>(std::move(opened)));
      box->untaken.store(comm.size(), std::memory_order_release);
      std::string out = nonce + kSharedMetadataFollows;
      ByteWriter(&out).PutU64(reinterpret_cast<uintptr_t>(box));
      return out;
    }
    SP_ASSIGN_OR_RETURN(CheckpointFormat format, DetectCheckpointFormat(ctx.store(), path));
    if (format == CheckpointFormat::kNative) {
      return ReadNativeMetadataFile(ctx.store(), path, nonce + kNativeFileFollows);
    }
    SP_ASSIGN_OR_RETURN(CheckpointMetadata metadata,
                        OpenCheckpointMetadata(ctx.store(), path, &ctx.pool()));
    return nonce + kWireMetadataFollows + EncodeMetadataForWire(metadata);
  }();
  SP_ASSIGN_OR_RETURN(std::string bytes, BroadcastOrFail(comm, std::move(encoded), root));
  const char kind = bytes.size() > kNonceDigits ? bytes[kNonceDigits] : '\0';
  if (kind == kSharedMetadataFollows && share && bytes.size() == kNonceDigits + 1 + 8) {
    auto* box = reinterpret_cast<SharedMetadata*>(
        static_cast<uintptr_t>(DecodeFixed64(bytes.data() + kNonceDigits + 1)));
    return LoadMetadata{bytes.substr(0, kNonceDigits), SharedMetadata::Take(box, comm.rank())};
  }
  if (kind != kNativeFileFollows && kind != kWireMetadataFollows) {
    return DataLossError("the load's metadata broadcast (" + std::to_string(bytes.size()) +
                         " bytes) does not start with a nonce of " +
                         std::to_string(kNonceDigits) + " bytes and a kind byte ('" +
                         kNativeFileFollows + "' or '" + kWireMetadataFollows + "')");
  }
  LoadMetadata out{bytes.substr(0, kNonceDigits), nullptr};
  // Every rank decodes the same bytes, so a decoding error is the same everywhere. A native file's
  // error is the coordinator's, which read the file, as when it decoded the file alone.
  const std::string_view body = std::string_view(bytes).substr(kNonceDigits + 1);
  const bool native = kind == kNativeFileFollows;
  Result<CheckpointMetadata> metadata =
      native ? DecodeNativeCheckpointMetadata(body, path, &ctx.pool())
             : DecodeMetadataFromWire(body, &ctx.pool());
  if (!metadata.ok() && native) {
    return Status(metadata.status().code(),
                  "rank " + std::to_string(root) + ": " + metadata.status().message());
  }
  if (!metadata.ok()) return metadata.status();
  out.metadata = std::make_shared<const CheckpointMetadata>(std::move(metadata).value());
  return out;
}

// The ranks whose requests and parts one round of MetadataPartsOfLoad gathers and scatters: the
// coordinator holds at most this many ranks' filters and parts at once.
constexpr int kPartRanksPerRound = 512;

// Each rank is sent its own part of the metadata (LoadOptions::own_chunks_only, ranks in separate
// address spaces): the coordinator opens the checkpoint once, whatever its format, gathers each
// rank's ChunkFilter, and scatters to each the wire encoding of the chunks its boxes reach
// (EncodeMetadataPartForWire): every tensor's header and only those chunks, not the whole
// metadata. Rank 0, which plans shared reads for every rank, and a rank without `filter` get it
// whole. In rounds of kPartRanksPerRound ranks, each a gather and a scatter. The coordinator's
// failure to open reaches every rank through the first scatter; a rank's failure to decode its
// part, through one agreement.
Result<LoadMetadata> MetadataPartsOfLoad(Communicator& comm, EngineContext& ctx,
                                         std::string_view path, int root,
                                         const ChunkFilter* filter) {
  const int rank = comm.rank(), size = comm.size();
  const std::string request = MetadataRequest(rank == 0 ? nullptr : filter);
  std::string nonce;
  std::optional<Result<CheckpointMetadata>> opened;
  if (rank == root) {
    nonce = RandomHexId(kNonceDigits);
    opened.emplace(OpenCheckpointMetadata(ctx.store(), path, &ctx.pool()));
  }
  std::optional<MetadataPartEncoder> encoder;  // the coordinator's, once it opened the checkpoint
  if (opened && opened->ok()) encoder.emplace(**opened, &ctx.pool());
  std::string whole;  // the coordinator's whole wire encoding, made once when a rank asks for it
  std::string mine;
  for (int first = 0; first < size; first += kPartRanksPerRound) {
    const int end = std::min(size, first + kPartRanksPerRound);
    const bool in_round = rank >= first && rank < end;
    SP_ASSIGN_OR_RETURN(std::vector<std::string> requests,
                        GatherOrFail(comm, in_round ? request : std::string(), root));
    Result<std::vector<std::string>> parts = [&]() -> Result<std::vector<std::string>> {
      if (rank != root) return std::vector<std::string>();
      if (!opened->ok()) return opened->status();
      std::vector<std::string> out(static_cast<size_t>(size));
      SP_RETURN_IF_ERROR(AnswerMetadataRequests(
          *encoder, std::span<const std::string>(requests).subspan(first, end - first), first,
          nonce + kWireMetadataFollows, root, &whole,
          std::span<std::string>(out).subspan(first, end - first), &ctx.pool()));
      return out;
    }();
    SP_ASSIGN_OR_RETURN(std::string received, ScatterOrFail(comm, std::move(parts), root));
    if (in_round) mine = std::move(received);
  }
  // Each rank decodes its own bytes: a rank that fails makes every rank fail, by one agreement.
  Result<CheckpointMetadata> metadata = [&]() -> Result<CheckpointMetadata> {
    if (rank == root) return std::move(**opened);
    if (mine.size() <= kNonceDigits || mine[kNonceDigits] != kWireMetadataFollows) {
      return DataLossError("the load's metadata part (" + std::to_string(mine.size()) +
                           " bytes) does not start with a nonce of " +
                           std::to_string(kNonceDigits) + " bytes and '" + kWireMetadataFollows +
                           "'");
    }
    return DecodeMetadataFromWire(std::string_view(mine).substr(kNonceDigits + 1), &ctx.pool());
  }();
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, metadata.status()));
  return LoadMetadata{rank == root ? std::move(nonce) : mine.substr(0, kNonceDigits),
                      std::make_shared<const CheckpointMetadata>(std::move(metadata).value())};
}

// The read gate this rank shares with the ranks of its machine that run in other processes
// (Communicator::machine_ranks), or null: sharing turned off, a fixed io_depth, alone on its
// machine, or a gate that could not be attached (no shared memory, a foreign object
// of that name); then the reads go through the pool's own tuner. Every rank calls it at the same
// point with the same options (machine_ranks may be a collective).
std::unique_ptr<SharedIoTuner> MachineGate(
    Communicator& comm, std::string_view nonce, const LoadOptions& options, ThreadPool& pool,
    const std::function<const std::vector<int>&()>& machine_ranks) {
  if (comm.size() < 2 || options.io_depth > 0 || !options.machine_read_gate) return nullptr;
  const std::vector<int>& local = machine_ranks();
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

std::string MetadataRequest(const ChunkFilter* filter) {
  return filter == nullptr ? std::string(1, kWholeAsked) : kPartAsked + EncodeChunkFilter(*filter);
}

Status AnswerMetadataRequests(const MetadataPartEncoder& encoder,
                              std::span<const std::string> requests, int first_rank,
                              std::string_view prefix, int skip, std::string* whole,
                              std::span<std::string> out, ThreadPool* pool) {
  skip -= first_rank;
  // Ranks that ask alike are answered from one encoding: the first of them.
  std::vector<size_t> first_alike(requests.size());
  std::vector<size_t> distinct;
  {
    std::unordered_map<std::string_view, size_t> seen;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (static_cast<int>(i) == skip) continue;
      auto [it, fresh] = seen.emplace(requests[i], i);
      first_alike[i] = it->second;
      if (fresh) distinct.push_back(i);
    }
  }
  for (size_t i : distinct) {
    if (whole->empty() && requests[i] == std::string_view(&kWholeAsked, 1)) {
      *whole = EncodeMetadataForWire(encoder.metadata());
    }
  }
  SP_RETURN_IF_ERROR(ParallelForInOrder(
      pool, static_cast<int64_t>(distinct.size()), [&](int64_t k) -> Status {
        const size_t i = distinct[k];
        const std::string& asked = requests[i];
        std::string& answer = out[i];
        answer.assign(prefix);
        if (asked == std::string_view(&kWholeAsked, 1)) {
          answer += *whole;
          return OkStatus();
        }
        if (asked.empty() || asked[0] != kPartAsked) {
          return DataLossError("the load's metadata request of rank " +
                               std::to_string(first_rank + i) + " (" +
                               std::to_string(asked.size()) + " bytes) starts with neither '" +
                               kWholeAsked + "' nor '" + kPartAsked + "'");
        }
        SP_ASSIGN_OR_RETURN(const ChunkFilterList boxes,
                            DecodeChunkFilterList(std::string_view(asked).substr(1),
                                                  "the chunk filter of rank " +
                                                      std::to_string(first_rank + i)));
        encoder.EncodeTo(boxes, &answer);
        return OkStatus();
      }));
  for (size_t i = 0; i < requests.size(); ++i) {
    if (static_cast<int>(i) != skip && first_alike[i] != i) out[i] = out[first_alike[i]];
  }
  return OkStatus();
}

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
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, options.comm, options.store, options.pool,
                                          options.threads, options.coordinator));
  Communicator& comm = ctx->comm();
  // The stored chunks this rank's boxes reach, when it keeps only those.
  // A rank whose targets fail asks for no chunk: it fails in Prepare before it reads any.
  std::optional<ChunkFilter> filter;
  if (options.own_chunks_only && !comm.shares_memory()) {
    filter.emplace();
    if (Result<std::vector<LocalTensor>> targets = BuildTargets(state); targets.ok()) {
      for (LocalTensor& t : *targets) (*filter)[t.name] = std::move(t.boxes);
    }
  }
  // Ranks in address spaces of their own that keep only their part are each sent it; otherwise
  // every rank gets the whole metadata.
  SP_ASSIGN_OR_RETURN(
      const LoadMetadata opened,
      options.own_chunks_only && !comm.shares_memory() && comm.size() > 1
          ? MetadataPartsOfLoad(comm, *ctx, path, options.coordinator, filter ? &*filter : nullptr)
          : MetadataOfLoad(comm, *ctx, path, options.coordinator));
  const std::string& nonce = opened.nonce;
  const CheckpointMetadata* metadata = opened.metadata.get();
  uint64_t metadata_chunks = 0;
  for (const TensorMetadata& t : metadata->tensors) metadata_chunks += t.chunks.size();
  // The ranks on this rank's machine, asked for once (asking may be a collective), by every rank
  // at the same points, since the options and the communicator are the same everywhere.
  std::optional<std::vector<int>> machine;
  auto machine_ranks = [&]() -> const std::vector<int>& {
    if (!machine) machine = comm.machine_ranks();
    return *machine;
  };
  const std::unique_ptr<SharedIoTuner> gate =
      MachineGate(comm, nonce, options, ctx->pool(), machine_ranks);
  // The call's time, and its time before the first read, into a successful result.
  auto timed = [&](Result<LoadResult> result) {
    if (!result.ok()) return result;
    const std::chrono::steady_clock::time_point end = std::chrono::steady_clock::now();
    result->seconds = std::chrono::duration<double>(end - start).count();
    const int64_t began = ctx->reads_begin_ns().load();
    result->before_reads_seconds =
        began == 0 ? result->seconds
                   : std::chrono::duration<double>(
                         std::chrono::steady_clock::time_point(std::chrono::nanoseconds(began)) -
                         start)
                         .count();
    return result;
  };
  // The communicator is asked where its machines decide something: whether to share when the
  // caller left share_reads unset and the store is local, and how when reads are shared (asking
  // may cost a collective, e.g. an exchange of host names). Every rank opens the same kind of
  // store for the path, so all take the same branch. Ranks that share an address space share
  // reads by default: it costs them nothing; so do the processes of one machine, through shared
  // memory, where a region costs one more copy in memory instead of a read.
  auto one_machine = [&] {
    return !comm.shares_memory() && !comm.spans_machines() &&
           machine_ranks().size() == static_cast<size_t>(comm.size());
  };
  const bool share = options.share_reads.has_value() ? *options.share_reads
                     : ctx->store().reads_cross_the_network() || comm.shares_memory()
                         ? true
                         : comm.spans_machines() || one_machine();
  if (share && comm.size() > 1) {
    SharedOutcome outcome =
        comm.shares_memory()
            ? LoadSharedInMemory(state, *metadata, path, options, *ctx, gate.get())
        : one_machine()
            ? LoadSharedOnMachine(state, *metadata, path, options, *ctx, gate.get(), nonce)
            : LoadShared(state, *metadata, path, options, *ctx, gate.get());
    if (!outcome.agreed) SP_RETURN_IF_ERROR(AgreeOnStatus(comm, outcome.result.status()));
    if (gate != nullptr && outcome.result.ok() && !outcome.own_gates) {
      outcome.result->read_gate_ranks = gate->joined();
    }
    if (outcome.result.ok()) outcome.result->metadata_chunks = metadata_chunks;
    return timed(std::move(outcome.result));
  }
  Result<LoadResult> result = LoadLocal(state, *metadata, path, options, *ctx, gate.get());
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, result.status()));
  // Every member attached before this collective: joined() counts them all.
  if (gate != nullptr) result->read_gate_ranks = gate->joined();
  result->metadata_chunks = metadata_chunks;
  return timed(std::move(result));
}

}  // namespace sp
