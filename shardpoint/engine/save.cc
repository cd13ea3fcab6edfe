// Save: local plan -> gather -> global plan (coordinator) -> scatter -> parallel checksummed
// writes -> gather reports -> atomic commit by the coordinator -> every rank learns the outcome.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#if defined(__GLIBC__)  // defined by the C++ headers above
#include <malloc.h>     // malloc_trim
#endif

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/base/random_id.h"
#include "shardpoint/engine/save.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/engine/cleanup.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/direct_write.h"
#include "shardpoint/engine/filled_chunks.h"
#include "shardpoint/engine/local_state.h"
#include "shardpoint/engine/save_internal.h"
#include "shardpoint/engine/save_messages.h"
#include "shardpoint/engine/write_reports.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/writer.h"
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/plan_codec.h"
#include "shardpoint/plan/ruled_plan.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the time since *since to *into and restarts the clock.
void Lap(Clock::time_point* since, double* into) {
  const Clock::time_point now = Clock::now();
  *into += std::chrono::duration<double>(now - *since).count();
  *since = now;
}

Result<LocalSavePlan> BuildLocalPlan(const SaveState& state, bool data_optional, int rank) {
  LocalSavePlan plan;
  std::set<std::string_view> names;
  for (const SaveTensor& t : state.tensors) {
    SP_ASSIGN_OR_RETURN(LocalTensor local, ToLocalTensor(t, names, data_optional));
    local.layout = t.layout;
    SP_RETURN_IF_ERROR(CheckRuledBoxes(rank, &local));
    plan.tensors.push_back(std::move(local));
  }
  for (const ObjectEntry& o : state.objects) {
    if (!names.insert(o.name).second) {
      return InvalidArgumentError("key '" + o.name + "' is used twice in the state of one rank");
    }
    if (o.stored) {  // a checkpoint's entry whose payload was never read (ReadObjectPayloads)
      return InvalidArgumentError("object '" + o.name + "' has no payload: its item was not read");
    }
    plan.objects.push_back(o);
  }
  return plan;
}

// Creates `path` and its missing ancestors, and syncs the parent of each directory it created so
// that the new entries survive a crash.
Status CreateDurableDirs(Store& store, std::string_view path) {
  std::vector<std::string> created;
  for (std::string dir(path); !dir.empty() && dir != "/"; dir = ParentPath(dir)) {
    SP_ASSIGN_OR_RETURN(bool exists, store.Exists(dir));
    if (exists) break;
    created.push_back(dir);
  }
  SP_RETURN_IF_ERROR(store.CreateDirs(path));
  for (const std::string& dir : created) {
    const std::string parent = ParentPath(dir);
    SP_RETURN_IF_ERROR(store.SyncDir(parent.empty() ? "." : parent));
  }
  return OkStatus();
}

}  // namespace

// What a SavePlanCache holds (engine/save_plan_cache.h).
struct SavePlanCacheState {
  // Each rank's part (several in-process ranks may share one cache): the layout it last sent in
  // full (LayoutKey), the id of the plan made from it, and its writes under that plan.
  // Also the files it last received in full for that plan, the id of their save, their format.
  struct RankPart {
    std::string key;
    uint64_t plan_id = 0;
    RankSavePlan writes;
    std::vector<FileOrder> files;
    std::string save_id;
    CheckpointFormat format = CheckpointFormat::kNative;
  };
  std::map<int, RankPart> ranks;
  // The coordinator's part: the plan as PlanSave made it, without objects (with its files named,
  // where the ranks build the headers: naming moves no chunk; otherwise not laid out), and what
  // its last layout changed. That is one copy of the plan: at 8,192 ranks x 1,000 tensors the
  // plan is most of a gigabyte, and the layout of a format whose files are renamed for the next
  // save (the native one) leaves every chunk where the plan put it. Shared with the saves that
  // commit its tensors (PendingMetadata): a new plan replaces it, nothing changes it.
  // A plan whose files the ranks rename keeps no rank's writes (`plan_has_writes` false): each
  // rank holds its own, and the coordinator's copy of all of them (40 bytes a chunk, 188 MiB at
  // 8,192 x 1,000) would serve only a save that lays the plan out again (another format, or
  // ranks holding the files of another save), which then plans afresh instead.
  uint64_t plan_id = 0;
  std::shared_ptr<const GlobalSavePlan> plan;
  bool plan_has_writes = true;
  // Between saves, a native plan without writes whose chunk lists take more than the cache's
  // keep_file_above_bytes is kept without its chunks either (the chunks are most of the plan: as
  // cells, 83 MiB at 8,192 x 1,000): its tensors keep their names, dtypes and shapes, and
  // `committed_file` holds the bytes of the metadata file the last save from the plan committed,
  // whose tensors are the plan's chunks with that save's checksums (39 MiB there). A save that
  // takes the plan decodes them back, as cells, while the ranks write (RestoreChunks) and commits
  // from them; null while the plan holds its chunks.
  std::shared_ptr<const std::string> committed_file;
  // Every rank's writes as last sent, where that layout moved chunks (torch-dcp); nullopt when
  // they were plan.ranks.
  std::optional<std::vector<RankSavePlan>> moved_writes;
  // The last layout's files, where it moved no chunk and kept the checksum block size: with
  // plan.metadata they are its laid-out metadata (no objects), which a later save renames.
  struct LaidOutFiles {
    std::string save_id;
    CheckpointFormat format = CheckpointFormat::kNative;
    std::vector<DataFile> files;  // data_start and size as the ranks reported them, or 0
  };
  std::optional<LaidOutFiles> laid_out;
};

// The metadata of a save whose plan the cache holds (taken from it, its files renamed, or just
// made and handed to it). Its tensors are the plan's, shared with the cache and never copied:
// the commit encodes them with the checksums the ranks report kept apart (ChunkChecksums), where
// a copy to fill them in would double the coordinator's memory (the plan is most of a gigabyte
// at 8,192 ranks x 1,000 tensors).
struct PendingMetadata {
  std::shared_ptr<const GlobalSavePlan> plan;  // the cached plan
  // When the cache keeps `plan` without its chunks: the committed metadata file they are restored
  // from (SavePlanCacheState::committed_file).
  std::shared_ptr<const std::string> committed_file;
  int32_t world_size = 0;
  CheckpointFormat format = CheckpointFormat::kNative;
  std::vector<DataFile> files;  // renamed
  std::string save_id;
  std::vector<ObjectEntry> objects;
  std::map<std::string, std::string> attributes;

  // Everything but the tensors: the plan gives the version and the checksum block, and every
  // other field is this save's. A native save's files hold their checksums in their headers
  // (whatever format the cached plan was laid out for before).
  CheckpointMetadata WithoutTensors() && {
    const CheckpointMetadata& planned = plan->metadata;
    CheckpointMetadata md;
    md.version_major = planned.version_major;
    md.version_minor = planned.version_minor;
    md.checksum_block_bytes = planned.checksum_block_bytes;
    md.data_file_checksums = format == CheckpointFormat::kNative;
    md.world_size = world_size;
    md.format = format;
    md.files = std::move(files);
    md.save_id = std::move(save_id);
    md.objects = std::move(objects);
    md.attributes = std::move(attributes);
    return md;
  }
};

class SavePlanCacheAccess {
 public:
  static std::unique_lock<std::mutex> Lock(SavePlanCache& cache) {
    return std::unique_lock<std::mutex>(cache.mu_);
  }
  // Under the lock.
  static SavePlanCacheState& State(SavePlanCache& cache) { return *cache.state_; }
  static void Count(SavePlanCache& cache, bool hit) { ++(hit ? cache.hits_ : cache.misses_); }
  static uint64_t KeepFileAboveBytes(const SavePlanCache& cache) {
    return cache.keep_file_above_bytes_;
  }
};

SavePlanCache::SavePlanCache(uint64_t keep_file_above_bytes)
    : keep_file_above_bytes_(keep_file_above_bytes),
      state_(std::make_unique<SavePlanCacheState>()) {}
SavePlanCache::~SavePlanCache() = default;

uint64_t SavePlanCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

uint64_t SavePlanCache::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

void SavePlanCache::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  *state_ = SavePlanCacheState();
}

uint64_t SavePlanCache::plan_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  const SavePlanCacheState& state = *state_;
  uint64_t bytes = state.committed_file != nullptr ? state.committed_file->size() : 0;
  const auto writes = [&](const std::vector<RankSavePlan>& ranks) {
    for (const RankSavePlan& r : ranks) bytes += r.writes.capacity() * sizeof(ChunkWrite);
  };
  if (state.plan != nullptr) {
    bytes += ChunkListBytes(state.plan->metadata.tensors);
    writes(state.plan->ranks);
  }
  if (state.moved_writes) writes(*state.moved_writes);
  return bytes;
}

namespace {

using CacheAccess = SavePlanCacheAccess;

// Everything a rank's part of the plan depends on: its tensors in order (names, dtypes, shapes,
// boxes), its place in the group and the planning options. Equal keys, equal plans.
std::string LayoutKey(LocalSavePlan& plan, const SaveOptions& options, const Communicator& comm) {
  std::vector<ObjectEntry> objects = std::exchange(plan.objects, {});
  std::string key = EncodeLocalSavePlan(plan);
  plan.objects = std::move(objects);
  ByteWriter w(&key);
  w.PutU32(static_cast<uint32_t>(comm.size()));
  w.PutU32(static_cast<uint32_t>(comm.rank()));
  w.PutU32(static_cast<uint32_t>(options.coordinator));
  w.PutU32(static_cast<uint32_t>(std::max(1, options.files_per_rank)));
  w.PutU8(options.dedup_to_lowest_rank ? 1 : 0);
  w.PutU64(options.checksum_block_bytes);
  w.PutU32(static_cast<uint32_t>(options.separate_key_prefixes.size()));
  for (const std::string& prefix : options.separate_key_prefixes) w.PutString(prefix);
  return key;
}

// A nonzero id for a new plan.
uint64_t NewPlanId() {
  const std::string hex = RandomHexId(16);
  const uint64_t id = std::stoull(hex, nullptr, 16);
  return id == 0 ? 1 : id;
}

// The objects of a cached plan's save from each rank's (lowest rank first wins), sorted by name;
// false when a name is also a tensor (the full plan then reports it).
bool MergeCachedObjects(const std::vector<PlanRequest>& requests,
                        const std::vector<TensorMetadata>& tensors,
                        std::vector<ObjectEntry>* objects) {
  std::map<std::string, ObjectEntry> merged;
  for (const PlanRequest& request : requests) {
    Result<LocalSavePlan> local = DecodeLocalSavePlan(request.plan);
    if (!local.ok()) return false;
    for (ObjectEntry& o : local->objects) {
      auto it = std::lower_bound(
          tensors.begin(), tensors.end(), o.name,
          [](const TensorMetadata& t, const std::string& name) { return t.name < name; });
      if (it != tensors.end() && it->name == o.name) return false;
      const std::string name = o.name;
      merged.try_emplace(name, std::move(o));
    }
  }
  objects->clear();
  for (auto& [name, o] : merged) objects->push_back(std::move(o));
  return true;
}

// Coordinator, when no cached plan serves: opens the ranks' ruled requests and registers their
// shared parts. Where a plan cannot be made yet, returns the replies that ask for what is
// missing: the local plans of the ranks that sent only the id of a cached one (kResend), and the
// shared part of each digest that no rank sent, from the lowest rank with that digest
// (kResendShared); every other rank is told its request stands (kResend, to which a rank that
// sent a plan answers kNothing). Returns nullopt when every rank's plan is at hand.
Result<std::optional<std::vector<std::string>>> AskForMissing(
    const std::vector<PlanRequest>& requests, SharedPlans* shared,
    std::vector<SharedPlans::Message>* opened) {
  std::vector<PlanReply::Kind> kinds(requests.size(), PlanReply::Kind::kResend);
  bool missing = false;
  for (size_t r = 0; r < requests.size(); ++r) {
    if (requests[r].kind == PlanRequest::Kind::kCached) missing = true;
    if (requests[r].kind != PlanRequest::Kind::kRuled) continue;
    Result<SharedPlans::Message> message = SharedPlans::Open(requests[r].plan);
    Status added = message.ok() ? shared->Add(*message) : message.status();
    if (!added.ok()) return added.WithContext("the save plan of rank " + std::to_string(r));
    (*opened)[r] = *message;
  }
  std::set<Fingerprint128> asked;
  for (size_t r = 0; r < requests.size(); ++r) {
    if (requests[r].kind != PlanRequest::Kind::kRuled) continue;
    const Fingerprint128& digest = (*opened)[r].digest;
    if (shared->Has(digest) || !asked.insert(digest).second) continue;
    kinds[r] = PlanReply::Kind::kResendShared;
    missing = true;
  }
  if (!missing) return std::optional<std::vector<std::string>>();
  std::vector<std::string> replies;
  replies.reserve(kinds.size());
  for (PlanReply::Kind kind : kinds) replies.push_back(EncodePlanReply(PlanReply{kind, 0, "", {}}));
  return std::optional<std::vector<std::string>>(std::move(replies));
}

// Coordinator: picks the format's writer, refuses to replace a committed checkpoint (of any
// format) unless asked, sets `commit_condition` to what the commit must still find (no metadata,
// or the version of the one it replaces) where the store can tell, plans on `pool` (or, when
// every rank sent the id of the plan `cache` holds, takes that plan), has the writer lay out the
// data files, creates the directory, and returns one reply per rank; or, when a plan is needed
// but some ranks sent only an id or no rank sent a shared part, the replies that ask for them
// (AskForMissing). `requests` are the ranks' PlanRequests, decoded; once they are in the table it
// plans from, their plans are released. The save's metadata is
// `metadata`, or, for a save whose tensors are those of the plan the cache holds, what `pending`
// holds.
Result<std::vector<std::string>> PlanOnCoordinator(std::vector<PlanRequest>& requests,
                                                   std::string_view path,
                                                   const SaveOptions& options, Store& store,
                                                   ThreadPool& pool, SavePlanCache* cache,
                                                   CheckpointMetadata* metadata,
                                                   std::optional<PendingMetadata>* pending,
                                                   std::optional<FileCondition>* commit_condition) {
  pending->reset();
  SP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      MakeCheckpointWriter(options.format, options.megatron));
  std::set<std::string_view> committed_names;
  for (const std::unique_ptr<CheckpointWriter>& w : AllCheckpointWriters()) {
    if (!committed_names.insert(w->metadata_file_name()).second) continue;
    const std::string metadata_path = JoinPath(path, w->metadata_file_name());
    SP_ASSIGN_OR_RETURN(bool exists, store.Exists(metadata_path));
    if (exists && !options.overwrite) {
      return AlreadyExistsError("a committed checkpoint already exists at " + std::string(path) +
                                " (pass overwrite to replace it)");
    }
    if (w->metadata_file_name() != writer->metadata_file_name()) continue;
    if (!exists) {
      *commit_condition = FileCondition{FileCondition::Kind::kAbsent, ""};
      continue;
    }
    Result<std::string> version = store.FileVersion(metadata_path);
    if (version.ok()) {
      *commit_condition = FileCondition{FileCondition::Kind::kVersion, *version};
    } else if (version.status().code() != StatusCode::kUnimplemented) {
      return version.status();
    }
  }
  const size_t world = requests.size();
  std::unique_lock<std::mutex> lock;
  SavePlanCacheState* cached = nullptr;
  if (cache != nullptr) {
    lock = CacheAccess::Lock(*cache);
    cached = &CacheAccess::State(*cache);
  }
  bool use_cache = cached != nullptr && cached->plan_id != 0 && cached->plan != nullptr &&
                   cached->plan->ranks.size() == world &&
                   std::all_of(requests.begin(), requests.end(), [&](const PlanRequest& r) {
                     return r.kind == PlanRequest::Kind::kCached && r.plan_id == cached->plan_id;
                   });
  std::vector<ObjectEntry> objects;  // of a save that takes the cached plan
  if (use_cache) use_cache = MergeCachedObjects(requests, cached->plan->metadata.tensors, &objects);
  SharedPlans shared(world);
  std::vector<SharedPlans::Message> opened(world);  // the ruled requests, opened
  if (!use_cache) {
    SP_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> ask,
                        AskForMissing(requests, &shared, &opened));
    if (ask) return std::move(*ask);
  }
  GlobalSavePlan plan;
  uint64_t plan_id = 0;
  if (use_cache) {
    plan_id = cached->plan_id;
    const std::string save_id = RandomHexId(12);
    // The files of the cached layout, renamed for this save: no layout, and each rank renames
    // its own files (names and headers) from its cache. Only when every rank holds the files of
    // the very save whose layout the coordinator holds (a save that failed between the two may
    // have left them apart).
    const std::optional<SavePlanCacheState::LaidOutFiles>& laid_out = cached->laid_out;
    const bool same_files =
        laid_out && std::all_of(requests.begin(), requests.end(), [&](const PlanRequest& r) {
          return r.files_save_id == laid_out->save_id;
        });
    if (same_files && laid_out->format == writer->format()) {
      std::vector<DataFile> files = laid_out->files;
      bool ok = true;
      for (DataFile& f : files) {
        ok = ok && writer->RenameForSave(laid_out->save_id, save_id, &f.name, nullptr);
      }
      if (ok) {
        SP_RETURN_IF_ERROR(CreateDurableDirs(store, path));
        *pending = PendingMetadata{cached->plan, cached->committed_file,
                                   static_cast<int32_t>(world), laid_out->format,
                                   std::move(files), save_id, std::move(objects),
                                   options.attributes};
        return std::vector<std::string>(
            world, EncodePlanReply(PlanReply{PlanReply::Kind::kRenamed, plan_id, save_id, {}}));
      }
    }
    // Laid out again (another format, or a writer that does not rename), from the cached plan's
    // writes; a plan kept without them is made afresh, from the ranks' local plans.
    if (cached->plan_has_writes) {
      plan = *cached->plan;
      plan.metadata.save_id = save_id;
      plan.metadata.objects = std::move(objects);
    } else {
      use_cache = false;
      SP_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> ask,
                          AskForMissing(requests, &shared, &opened));
      if (ask) return std::move(*ask);
    }
  }
  if (!use_cache) {
    // Decoded into one compact table (plan/gathered_plans.h), not one LocalSavePlan per rank.
    GatheredPlans gathered(requests.size());
    for (size_t r = 0; r < requests.size(); ++r) {
      if (requests[r].kind == PlanRequest::Kind::kRuled) {
        SP_RETURN_IF_ERROR(shared.Expand(opened[r], static_cast<uint32_t>(r), &gathered));
      } else {
        SP_RETURN_IF_ERROR(DecodeLocalSavePlanInto(requests[r].plan, &gathered));
      }
    }
    // The table holds the ranks' plans now, and no later exchange asks for them (a request is
    // asked for again only before a plan is made): 35 MiB at 8,192 ranks x 1,000 tensors that
    // would otherwise stay under the planning, the replies and the commit.
    opened.clear();
    for (PlanRequest& request : requests) std::string().swap(request.plan);
    SavePlanOptions plan_options;
    plan_options.files_per_rank = std::max(1, options.files_per_rank);
    plan_options.dedup_to_lowest_rank = options.dedup_to_lowest_rank;
    plan_options.save_id = RandomHexId(12);
    plan_options.checksum_block_bytes = options.checksum_block_bytes;
    plan_options.separate_key_prefixes = options.separate_key_prefixes;
    plan_options.pool = &pool;
    // A format whose ranks build their headers only names the files here: its plan may hold its
    // tensors as cells (12 bytes a chunk of a grid instead of 128), which the commit encodes as
    // they are.
    plan_options.chunk_cells = writer->ranks_build_headers();
    // Nor does such a layout move any chunk: the ranks' writes are built a round of ranks at a
    // time, as their replies are (below), from 8 bytes a chunk instead of 40.
    plan_options.defer_writes = writer->ranks_build_headers();
    SP_ASSIGN_OR_RETURN(plan, PlanSave(gathered, plan_options));
  }
  // A new plan for the cache. Where the ranks build their files' headers, the coordinator only
  // names the files, which moves no chunk: the cache then takes the plan itself once the replies
  // are built, and this save commits with the plan's tensors as the cache holds them
  // (PendingMetadata). Otherwise the layout may move chunks, and the cache keeps a copy of the
  // plan as planned, made once the ranks' table is gone (the end of the block above).
  const bool share_plan = !use_cache && cached != nullptr && writer->ranks_build_headers();
  if (!use_cache && cached != nullptr) {
    plan_id = NewPlanId();
    cached->plan_id = plan_id;
    cached->plan.reset();
    cached->plan_has_writes = true;
    cached->committed_file.reset();
    if (!share_plan) {
      auto copy = std::make_shared<GlobalSavePlan>(plan);
      copy->metadata.objects.clear();
      cached->plan = std::move(copy);
    }
    cached->moved_writes.reset();
    cached->laid_out.reset();
  }
  plan.metadata.world_size = static_cast<int32_t>(world);
  plan.metadata.attributes = options.attributes;

  plan.metadata.format = writer->format();
  const uint64_t planned_block_bytes = plan.metadata.checksum_block_bytes;
  // Where the ranks build their files' headers, the coordinator only names the files.
  std::vector<std::string> headers;
  if (writer->ranks_build_headers()) {
    SP_RETURN_IF_ERROR(writer->NameFiles(store, path, &plan.metadata));
  } else {
    SP_ASSIGN_OR_RETURN(headers, writer->LayOutFiles(store, path, &plan.metadata));
  }
  // The writer may move chunks within their files (framing between them): writes follow.
  std::vector<char> rank_moved(plan.ranks.size(), 0);
  SP_RETURN_IF_ERROR(ParallelFor(&pool, static_cast<int64_t>(plan.ranks.size()), [&](int64_t r) {
    for (ChunkWrite& w : plan.ranks[r].writes) {
      const uint64_t placed = ChunkDataOffset(plan.metadata.tensors.at(w.tensor), w.chunk);
      rank_moved[r] |= placed != w.data_offset;
      w.data_offset = placed;
    }
    return OkStatus();
  }));
  const bool moved = std::find(rank_moved.begin(), rank_moved.end(), 1) != rank_moved.end();
  // Ranks write with their cached writes only where those are still exactly the plan's: the
  // writes they were last sent are the cached plan's own unless that layout moved chunks.
  const bool files_only =
      use_cache && (cached->moved_writes ? *cached->moved_writes == plan.ranks : !moved);
  if (cached != nullptr) {
    if (!files_only) {
      if (moved) {
        cached->moved_writes = plan.ranks;
      } else {
        cached->moved_writes.reset();
      }
    }
    if (moved || plan.metadata.checksum_block_bytes != planned_block_bytes) {
      cached->laid_out.reset();
    } else {
      cached->laid_out = SavePlanCacheState::LaidOutFiles{plan.metadata.save_id,
                                                          plan.metadata.format,
                                                          plan.metadata.files};
    }
  }
  SP_RETURN_IF_ERROR(CreateDurableDirs(store, path));

  std::vector<std::string> payloads(plan.ranks.size());
  const auto encode_reply = [&](int64_t r) {
    PlanReply reply;
    reply.kind = files_only ? PlanReply::Kind::kFilesOnly : PlanReply::Kind::kOrder;
    reply.plan_id = plan_id;
    reply.save_id = plan.metadata.save_id;
    reply.order.format = writer->format();
    // The rank's writes go into its reply and are freed with it: the plan (and a cache that takes
    // it) needs them no more, and the coordinator does not hold them beside the replies.
    RankSavePlan& rank_plan = plan.ranks[r];
    if (!files_only) {
      reply.order.plan.files = rank_plan.files;
      reply.order.plan.writes = std::move(rank_plan.writes);
    }
    std::vector<ChunkWrite>().swap(rank_plan.writes);
    for (uint32_t f : rank_plan.files) {
      const DataFile& file = plan.metadata.files[f];
      reply.order.files.push_back({f, file.name, headers.empty() ? "" : headers[f], file.size});
    }
    payloads[r] = EncodePlanReply(reply);
    return OkStatus();
  };
  // Writes the plan defers are built for a round of ranks at a time, about kRoundWrites of them,
  // and freed with the round's replies: all of them at once would be 40 bytes a chunk (188 MiB
  // at 8,192 ranks x 1,000 tensors), and each round costs a pass over the plan's chunks.
  constexpr uint64_t kRoundWrites = uint64_t{1} << 20;
  for (uint32_t first = 0; first < plan.ranks.size();) {
    const uint32_t end = DeferredRoundEnd(plan, first, kRoundWrites);
    SP_RETURN_IF_ERROR(TakeDeferredWrites(&plan, first, end, &pool));
    SP_RETURN_IF_ERROR(ParallelFor(&pool, end - first, [&](int64_t i) {
      return encode_reply(first + i);
    }));
    first = end;
  }
  DropDeferredWrites(&plan);
  if (share_plan && !moved) {
    std::vector<ObjectEntry> objects = std::move(plan.metadata.objects);
    plan.metadata.objects.clear();
    std::vector<DataFile> files = plan.metadata.files;
    const std::string save_id = plan.metadata.save_id;
    cached->plan = std::make_shared<const GlobalSavePlan>(std::move(plan));
    cached->plan_has_writes = false;
    *pending = PendingMetadata{cached->plan, nullptr, static_cast<int32_t>(world),
                               writer->format(), std::move(files), save_id, std::move(objects),
                               options.attributes};
    return payloads;
  }
  if (share_plan) cached->plan_id = 0;  // a layout that moved chunks: the plan is not kept
  *metadata = std::move(plan.metadata);
  return payloads;
}

// One data file being written by this rank.
struct OpenFile {
  std::string final_path;
  std::string temp_path;
  uint64_t data_start = 0;  // the length of its header
  std::unique_ptr<WritableFile> file;
};

// Removes this rank's files of a failed save (best effort: the save already failed).
void RemoveFiles(Store& store, const std::vector<OpenFile>& files) {
  for (const OpenFile& f : files) {
    if (f.temp_path != f.final_path) store.RemoveFile(f.temp_path).IgnoreError();
    store.RemoveFile(f.final_path).IgnoreError();
  }
}

// Every rank, where the order's format has the ranks build their files' headers
// (CheckpointWriter::ranks_build_headers): builds the header and size of each file of `order`
// from the chunks it writes there.
Status BuildOwnHeaders(const SaveState& state, std::string_view save_id,
                       uint64_t checksum_block_bytes, RankWriteOrder* order) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      MakeCheckpointWriter(order->format, /*megatron=*/false));
  if (!writer->ranks_build_headers()) return OkStatus();
  std::map<uint32_t, size_t> file_slot;  // checkpoint file index -> position in order->files
  for (size_t i = 0; i < order->files.size(); ++i) file_slot[order->files[i].index] = i;
  // Per file: its chunks keyed by their place in the metadata (tensor, chunk), and its data bytes.
  std::vector<std::vector<std::pair<uint64_t, DataFileChunk>>> chunks(order->files.size());
  std::vector<uint64_t> data_bytes(order->files.size(), 0);
  for (const ChunkWrite& w : order->plan.writes) {
    const auto slot = file_slot.find(w.file);
    if (w.local_tensor >= state.tensors.size() ||
        w.local_box >= state.tensors[w.local_tensor].pieces.size() || slot == file_slot.end()) {
      return InternalError("save plan refers to a piece or file this rank does not have");
    }
    const SaveTensor& tensor = state.tensors[w.local_tensor];
    chunks[slot->second].emplace_back(
        (uint64_t{w.tensor} << 32) | w.chunk,
        DataFileChunk{tensor.name, tensor.dtype, &tensor.pieces[w.local_box].box, w.data_offset,
                      w.byte_length});
    data_bytes[slot->second] += w.byte_length;
  }
  for (size_t i = 0; i < order->files.size(); ++i) {
    std::sort(chunks[i].begin(), chunks[i].end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<DataFileChunk> entries;
    entries.reserve(chunks[i].size());
    for (auto& [key, chunk] : chunks[i]) entries.push_back(chunk);
    FileOrder& file = order->files[i];
    file.header = writer->BuildFileHeader(save_id, std::move(entries), checksum_block_bytes);
    file.size = file.header.size() + data_bytes[i];
  }
  return OkStatus();
}

// Every rank, once the chunks of its files are written: writes each file's header at offset 0
// with the block checksums of its chunks (`report`'s, in data offset order) where the format
// keeps them there, and reports each file's extents and header CRC.
Status WriteHeaders(const RankWriteOrder& order, const CheckpointWriter& format_writer,
                    const std::vector<OpenFile>& files,
                    const std::map<uint32_t, size_t>& file_slot, WriteReport* report) {
  // Per file: its writes' (data offset, end, position in the order), sorted as its header's
  // entries are (by data offset, then end; only empty chunks tie, and they have no checksums).
  std::map<uint32_t, size_t> in_order;  // checkpoint file index -> position in order.files
  for (size_t i = 0; i < order.files.size(); ++i) in_order[order.files[i].index] = i;
  std::vector<std::vector<std::tuple<uint64_t, uint64_t, size_t>>> writes(order.files.size());
  for (size_t w = 0; w < order.plan.writes.size(); ++w) {
    const ChunkWrite& write = order.plan.writes[w];
    writes[in_order.at(write.file)].emplace_back(write.data_offset,
                                                 write.data_offset + write.byte_length, w);
  }
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < order.files.size(); ++i) {
    const FileOrder& f = order.files[i];
    std::sort(writes[i].begin(), writes[i].end());
    crcs.clear();
    for (const auto& [begin, end, w] : writes[i]) {
      const std::vector<uint32_t>& own = report->chunks[w].block_crc32c;
      crcs.insert(crcs.end(), own.begin(), own.end());
    }
    std::string header = f.header;
    if (!header.empty()) {
      SP_RETURN_IF_ERROR(format_writer.FillFileChecksums(&header, crcs)
                             .WithContext("data file " + f.name));
    }
    SP_RETURN_IF_ERROR(files[file_slot.at(f.index)].file->WriteAt(0, AsBytes(header)));
    report->files.push_back(FileReport{f.index, header.size(), f.size, Crc32c(header)});
  }
  return OkStatus();
}

// Every rank: writes the files of its order through the format's chunk writer and returns the
// report of checksums and file extents.
Result<std::string> WriteRankFiles(const RankWriteOrder& order, const SaveState& state,
                                   std::string_view path, const SaveOptions& options, Store& store,
                                   ThreadPool& pool, std::vector<OpenFile>* files,
                                   Clock::time_point* clock, SaveStats* stats) {
  // The chunks' framing depends on the format only (Megatron differs at commit).
  SP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> format_writer,
                      MakeCheckpointWriter(order.format, /*megatron=*/false));
  std::map<uint32_t, size_t> file_slot;  // checkpoint file index -> position in *files
  for (const FileOrder& f : order.files) {
    OpenFile open;
    open.final_path = JoinPath(path, f.name);
    // A store whose files appear whole when closed (object storage) writes the final name: a
    // rename there would copy the file. Elsewhere the file is renamed into place once synced.
    open.temp_path =
        store.files_appear_when_closed() ? open.final_path : open.final_path + ".tmp";
    open.data_start = f.header.size();
    SP_ASSIGN_OR_RETURN(open.file, store.NewWritableFile(open.temp_path));
    if (options.direct_io) {
      open.file = std::make_unique<DirectWriteFile>(std::move(open.file), pool.staging(),
                                                    options.direct_io_min_bytes);
    }
    // Registered before anything else can fail, so that a failed save removes it.
    file_slot[f.index] = files->size();
    files->push_back(std::move(open));
    WritableFile& file = *files->back().file;
    SP_RETURN_IF_ERROR(file.Preallocate(f.size));
  }
  WriteReport report;
  // Direct writes stage through the pool's buffers, kept for reuse until the save is done.
  BufferPool::Stay stay(pool.staging());
  report.chunks.resize(order.plan.writes.size());
  const std::unique_ptr<ChunkWriter> writer =
      format_writer->NewChunkWriter(order.plan.writes.size(), options.checksum_block_bytes);
  ByteBudget budget(options.fill_budget_bytes);
  RangeBuffers range_buffers(options.fill_budget_bytes);
  std::vector<std::unique_ptr<FilledChunkSource>> sources;  // outlive the group's tasks
  TaskGroup group(&pool);
  for (size_t w = 0; w < order.plan.writes.size(); ++w) {
    const ChunkWrite& write = order.plan.writes[w];
    if (write.local_tensor >= state.tensors.size() ||
        write.local_box >= state.tensors[write.local_tensor].pieces.size() ||
        !file_slot.count(write.file)) {
      return InternalError("save plan refers to a piece or file this rank does not have");
    }
    const SaveTensor& tensor = state.tensors[write.local_tensor];
    const ConstPieceView& piece = tensor.pieces[write.local_box];
    OpenFile& file = (*files)[file_slot.at(write.file)];
    report.chunks[w].tensor = write.tensor;
    report.chunks[w].chunk = write.chunk;
    ChunkBytes chunk{tensor.dtype, piece.box, piece.data, write.byte_length,
                     file.data_start + write.data_offset};
    std::vector<uint32_t>* crcs = &report.chunks[w].block_crc32c;
    if (piece.data == nullptr && write.byte_length > 0 && options.fill_range) {
      sources.push_back(std::make_unique<FilledChunkSource>(options, tensor, write.local_tensor,
                                                            write.local_box, range_buffers));
      chunk.source = sources.back().get();
      SP_RETURN_IF_ERROR(writer->QueueChunk(w, chunk, *file.file, group,
                                            &options.on_chunk_written, crcs));
    } else if (piece.data == nullptr && write.byte_length > 0) {
      if (!options.fill_piece) return InternalError("a piece without memory and no fill");
      group.Run([&, chunk, crcs, w] {
        return WriteFilledChunk(order.plan.writes[w], tensor, options, *writer, w, chunk,
                                *file.file, budget, crcs);
      });
    } else {
      SP_RETURN_IF_ERROR(writer->QueueChunk(w, chunk, *file.file, group,
                                            &options.on_chunk_written, crcs));
    }
  }
  SP_RETURN_IF_ERROR(group.Wait());
  SP_RETURN_IF_ERROR(writer->Finish());
  // The headers last: a native one holds the checksums of its file's chunks, known now.
  SP_RETURN_IF_ERROR(WriteHeaders(order, *format_writer, *files, file_slot, &report));
  Lap(clock, &stats->write_seconds);
  SP_RETURN_IF_ERROR(ParallelFor(&pool, static_cast<int64_t>(files->size()), [&](int64_t i) {
    OpenFile& f = (*files)[i];
    SP_RETURN_IF_ERROR(f.file->Sync());
    SP_RETURN_IF_ERROR(f.file->Close());
    if (f.temp_path == f.final_path) return OkStatus();
    return store.Rename(f.temp_path, f.final_path);
  }));
  Lap(clock, &stats->sync_seconds);
  return EncodeWriteReport(report);
}

// Hands the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). The
// coordinator calls it once the replies are scattered: what planning freed (at 8,192 ranks x
// 1,000 tensors the table of the gathered plans, the holdings, the deferred writes and the
// replies) otherwise stays resident through the commit, whose checksums and encoded metadata are
// allocated anew; there it took the peak from 388 to 349 MiB, for 14 ms (docs/PERFORMANCE.md,
// "Grid cells and deferred writes").
void ReturnFreedHeap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// A plan cache keeps a native plan's last committed metadata file instead of its chunks unless the
// file is larger by more than this.
constexpr uint64_t kPlanFileSlackBytes = uint64_t{64} << 10;

// `plan` without its chunks, as a cache keeps it between saves beside the file they are restored
// from: its tensors with their names, dtypes and shapes, and all else.
std::shared_ptr<const GlobalSavePlan> WithoutChunks(const GlobalSavePlan& plan) {
  auto out = std::make_shared<GlobalSavePlan>();
  const std::vector<TensorMetadata>& tensors = plan.metadata.tensors;
  out->metadata = WithoutTensors(plan.metadata);
  out->metadata.tensors.resize(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    TensorMetadata& tensor = out->metadata.tensors[t];
    tensor.name = tensors[t].name;
    tensor.dtype = tensors[t].dtype;
    tensor.shape = tensors[t].shape;
  }
  out->ranks = plan.ranks;
  return out;
}

// The plan `compact` (WithoutChunks) with its chunks decoded from `file`, the metadata file a save
// from that plan committed: the same tensors in the same order, each with the plan's chunks in
// the plan's order (the ranks' cached writes name them by index), held as cells.
// Their checksums are not needed: the commit takes the ranks' apart.
// Anything else is an internal error: the cache holds a file that is not its plan's.
Result<std::shared_ptr<const GlobalSavePlan>> RestoreChunks(const GlobalSavePlan& compact,
                                                           const std::string& file,
                                                           std::string_view path,
                                                           ThreadPool* pool) {
  // Its tensors as cells, as PlanSave holds them (SavePlanOptions::chunk_cells), each as it is
  // decoded: the chunks of all of them at once would be 600 MiB at 8,192 ranks x 1,000 tensors.
  Result<CheckpointMetadata> decoded =
      DecodeMetadata(file, JoinPath(path, "(cached plan)"), pool, nullptr, /*chunk_cells=*/true);
  if (!decoded.ok()) {
    return InternalError("the save plan cache's copy of its plan does not decode: " +
                         decoded.status().ToString());
  }
  const std::vector<TensorMetadata>& planned = compact.metadata.tensors;
  std::vector<TensorMetadata>& tensors = decoded->tensors;
  bool same = tensors.size() == planned.size();
  for (size_t t = 0; same && t < tensors.size(); ++t) {
    same = tensors[t].name == planned[t].name && tensors[t].dtype == planned[t].dtype &&
           tensors[t].shape == planned[t].shape;
  }
  if (!same) {
    return InternalError(
        "the save plan cache's copy of its plan holds other tensors than the plan");
  }
  auto out = std::make_shared<GlobalSavePlan>();
  out->metadata = compact.metadata;  // no chunks: cheap
  out->metadata.tensors = std::move(tensors);
  out->ranks = compact.ranks;
  return std::shared_ptr<const GlobalSavePlan>(std::move(out));
}

// Coordinator: takes the reports (and frees them before it encodes the metadata: 75 MiB at 8,192
// ranks x 1,000 tensors), has the writer write what must precede the commit (for
// PyTorch DCP the file of the objects, for Megatron its files), makes the data durable, writes
// and renames the metadata (the commit point), has the writers of the other kinds remove what a
// replaced checkpoint of theirs left (its metadata first, so that a crash before this point
// leaves the old checkpoint loadable), then removes files of earlier or failed saves that the new
// metadata does not name.
//
// The metadata's tensors are `tensors`: metadata->tensors, or those of the plan the cache holds
// (metadata->tensors then empty), with the checksums the ranks report kept apart from them
// (CheckpointWriter::PrepareCommitApart).
//
// The metadata is written under `condition` (PlanOnCoordinator's), so that of two saves racing to
// the same path on a store that checks conditions (object storage) only one commits; the other
// fails with kAlreadyExists and leaves its data files, which no metadata names, to the cleanup of
// the next save there.
// With `committed_file`, the bytes of the metadata file are left there once it is committed.
Status CommitOnCoordinator(std::vector<std::string> reports, std::string_view path,
                           Store& store, int coordinator, const CheckpointWriter& writer,
                           const std::optional<FileCondition>& condition,
                           const std::vector<TensorMetadata>& tensors,
                           CheckpointMetadata* metadata, ThreadPool* pool,
                           std::string* committed_file) {
  // The checksums are kept apart only where the tensors are not the metadata's own or are held as
  // cells (which have no checksums to fill in): a table of them costs 12 bytes a chunk more than
  // filling them in.
  std::string encoded;
  const bool cells = std::any_of(tensors.begin(), tensors.end(),
                                 [](const TensorMetadata& t) { return t.cells.has_value(); });
  if (&tensors == &metadata->tensors && !cells) {
    SP_RETURN_IF_ERROR(CollectReports(reports, tensors, metadata, nullptr, pool));
    std::vector<std::string>().swap(reports);
    SP_ASSIGN_OR_RETURN(encoded, writer.PrepareCommit(store, path, coordinator, metadata));
  } else {
    ChunkChecksums checksums;
    SP_RETURN_IF_ERROR(CollectReports(reports, tensors, metadata, &checksums, pool));
    std::vector<std::string>().swap(reports);
    SP_ASSIGN_OR_RETURN(encoded, writer.PrepareCommitApart(store, path, coordinator, metadata,
                                                           tensors, checksums));
  }
  const std::string metadata_name(writer.metadata_file_name());
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  Status written =
      WriteFileDurably(store, path, metadata_name, metadata_name + ".tmp-" + metadata->save_id,
                       encoded, condition.has_value() ? &*condition : nullptr);
  if (written.code() == StatusCode::kAlreadyExists) {
    return AlreadyExistsError(
        "the save to " + std::string(path) + " was not committed: another save " +
        (condition->kind == FileCondition::Kind::kAbsent ? "committed a checkpoint there"
                                                         : "replaced the checkpoint there") +
        " while this one was writing (" + std::string(written.message()) + ")");
  }
  SP_RETURN_IF_ERROR(written);
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  for (const std::unique_ptr<CheckpointWriter>& other : AllCheckpointWriters()) {
    if (other->kind() == writer.kind()) continue;
    SP_RETURN_IF_ERROR(other->RemoveReplaced(store, path, metadata_name));
  }
  RemoveUnreferencedFiles(store, path, *metadata);
  store.DropUnfinishedWrites(path).status().IgnoreError();
  if (committed_file != nullptr) *committed_file = std::move(encoded);
  return OkStatus();
}

}  // namespace

Status Save(const SaveState& state, std::string_view path, const SaveOptions& options) {
  return SaveWithLocalStatus(state, path, options, OkStatus());
}

Status SaveWithLocalStatus(const SaveState& state, std::string_view path,
                           const SaveOptions& options, const Status& local_failure) {
  SaveStats local_stats;
  SaveStats& stats = options.stats != nullptr ? *options.stats : local_stats;
  stats = SaveStats();
  Clock::time_point clock = Clock::now();
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, options.comm, options.store, options.pool,
                                          options.threads, options.coordinator));
  Communicator& comm = ctx->comm();
  const int root = options.coordinator;
  if (options.checksum_block_bytes == 0) {
    return InvalidArgumentError("checksum_block_bytes must be positive");
  }
  SavePlanCache* cache = options.plan_cache;
  std::optional<LocalSavePlan> local_plan;
  std::string layout_key;  // with a cache: this rank's layout (LayoutKey)
  bool sent_cached = false;
  Result<std::string> request = [&]() -> Result<std::string> {
    SP_RETURN_IF_ERROR(local_failure);
    SP_ASSIGN_OR_RETURN(LocalSavePlan plan, BuildLocalPlan(state, options.fills(), comm.rank()));
    local_plan = std::move(plan);
    PlanRequest out;
    if (cache != nullptr) {
      layout_key = LayoutKey(*local_plan, options, comm);
      std::unique_lock<std::mutex> lock = CacheAccess::Lock(*cache);
      SavePlanCacheState& cached = CacheAccess::State(*cache);
      auto it = cached.ranks.find(comm.rank());
      if (it != cached.ranks.end() && it->second.plan_id != 0 && it->second.key == layout_key) {
        out.kind = PlanRequest::Kind::kCached;
        out.plan_id = it->second.plan_id;
        out.files_save_id = it->second.save_id;
        out.plan = EncodeLocalSavePlan(LocalSavePlan{{}, local_plan->objects});
        sent_cached = true;
      }
    }
    if (!sent_cached) {
      out.kind = PlanRequest::Kind::kRuled;
      out.plan = EncodeRuledLocalPlan(*local_plan, SendsSharedPart(*local_plan, comm.rank(), root));
    }
    return EncodePlanRequest(out);
  }();
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                      GatherOrFail(comm, std::move(request), root));

  CheckpointMetadata metadata;
  std::optional<PendingMetadata> pending_metadata;  // the coordinator's, for a shared plan
  std::optional<FileCondition> commit_condition;  // the coordinator's (PlanOnCoordinator)
  std::vector<PlanRequest> requests;  // the coordinator's, as decoded from the first exchange
  auto plan_on_coordinator = [&]() -> Result<std::vector<std::string>> {
    for (size_t r = 0; r < gathered.size(); ++r) {
      SP_ASSIGN_OR_RETURN(PlanRequest decoded, DecodePlanRequest(gathered[r]));
      std::string().swap(gathered[r]);  // its plan is in `decoded` now: do not hold it twice
      if (decoded.kind == PlanRequest::Kind::kNothing) {
        if (requests.size() != gathered.size()) {
          return InternalError("rank " + std::to_string(r) + " sent no plan");
        }
        continue;  // its request of the first exchange stands
      }
      if (requests.size() == gathered.size()) {
        requests[r] = std::move(decoded);
      } else {
        requests.push_back(std::move(decoded));
      }
    }
    return PlanOnCoordinator(requests, path, options, ctx->store(), ctx->pool(), cache,
                             &metadata, &pending_metadata, &commit_condition);
  };
  Result<std::vector<std::string>> payloads =
      comm.rank() == root ? plan_on_coordinator() : Result<std::vector<std::string>>(
                                                        std::vector<std::string>());
  SP_ASSIGN_OR_RETURN(std::string my_payload, ScatterOrFail(comm, std::move(payloads), root));
  stats.plan_exchanges = 1;
  // A plan is needed but something is missing (AskForMissing): a rank that sent the id of its
  // cached plan sends its plan, a rank asked for its shared part sends it, the others confirm
  // their request. The first round can leave the shared part of a rank that sent an id missing,
  // the second cannot.
  for (int round = 0;; ++round) {
    const std::optional<PlanReply::Kind> kind = PlanReplyKind(my_payload);
    if (kind != PlanReply::Kind::kResend && kind != PlanReply::Kind::kResendShared) break;
    PlanRequest again;
    if (kind == PlanReply::Kind::kResendShared || sent_cached) {
      again.kind = PlanRequest::Kind::kRuled;
      again.plan = EncodeRuledLocalPlan(
          *local_plan, kind == PlanReply::Kind::kResendShared ||
                           SendsSharedPart(*local_plan, comm.rank(), root));
      sent_cached = false;
    } else {
      again.kind = PlanRequest::Kind::kNothing;
    }
    SP_ASSIGN_OR_RETURN(gathered, GatherOrFail(comm, EncodePlanRequest(again), root));
    payloads = comm.rank() == root ? plan_on_coordinator()
                                   : Result<std::vector<std::string>>(std::vector<std::string>());
    const auto asks = [](const std::string& reply) {
      const std::optional<PlanReply::Kind> k = PlanReplyKind(reply);
      return k == PlanReply::Kind::kResend || k == PlanReply::Kind::kResendShared;
    };
    if (payloads.ok() && round >= 1 && std::any_of(payloads->begin(), payloads->end(), asks)) {
      payloads = InternalError("the coordinator asked three times for the ranks' local plans");
    }
    SP_ASSIGN_OR_RETURN(my_payload, ScatterOrFail(comm, std::move(payloads), root));
    ++stats.plan_exchanges;
  }
  Lap(&clock, &stats.plan_seconds);
  if (comm.rank() == root) ReturnFreedHeap();

  // A plan the cache keeps without its chunks gets them back from the file it keeps, decoded on a
  // thread of its own while this rank writes its files (on the pool, whose threads the writes
  // hold), so that the decode does not wait for them nor they for it.
  std::future<Result<std::shared_ptr<const GlobalSavePlan>>> restoring;
  if (pending_metadata && pending_metadata->committed_file != nullptr) {
    restoring = std::async(std::launch::async, [plan = pending_metadata->plan,
                                                file = pending_metadata->committed_file,
                                                at = std::string(path)] {
      return RestoreChunks(*plan, *file, at, nullptr);
    });
  }

  std::vector<OpenFile> files;
  Result<std::string> report = [&]() -> Result<std::string> {
    SP_ASSIGN_OR_RETURN(PlanReply reply, DecodePlanReply(my_payload));
    RankWriteOrder order = std::move(reply.order);
    const bool from_cache =
        reply.kind == PlanReply::Kind::kFilesOnly || reply.kind == PlanReply::Kind::kRenamed;
    if (cache != nullptr) {
      std::unique_lock<std::mutex> lock = CacheAccess::Lock(*cache);
      SavePlanCacheState::RankPart& mine = CacheAccess::State(*cache).ranks[comm.rank()];
      if (from_cache && (mine.plan_id != reply.plan_id || mine.key != layout_key)) {
        return InternalError("the save plan cache of rank " + std::to_string(comm.rank()) +
                             " no longer holds the plan the coordinator used");
      }
      if (reply.kind == PlanReply::Kind::kRenamed) {
        order.format = mine.format;
        order.plan = mine.writes;
        order.files = mine.files;
        SP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                            MakeCheckpointWriter(order.format, /*megatron=*/false));
        for (FileOrder& f : order.files) {
          if (!writer->RenameForSave(mine.save_id, reply.save_id, &f.name, &f.header)) {
            return InternalError("rank " + std::to_string(comm.rank()) + " cannot rename file " +
                                 f.name + " of its cached plan for save " + reply.save_id);
          }
        }
      } else {
        if (reply.kind == PlanReply::Kind::kFilesOnly) {
          order.plan = mine.writes;
        } else if (reply.plan_id != 0) {
          mine.key = layout_key;
          mine.plan_id = reply.plan_id;
          mine.writes = order.plan;
        }
        SP_RETURN_IF_ERROR(
            BuildOwnHeaders(state, reply.save_id, options.checksum_block_bytes, &order));
        if (reply.plan_id != 0) {
          mine.files = order.files;
          mine.save_id = reply.save_id;
          mine.format = order.format;
        }
      }
      CacheAccess::Count(*cache, from_cache);
    } else if (reply.kind != PlanReply::Kind::kOrder) {
      return InternalError("a cached save plan was used without a cache");
    } else {
      SP_RETURN_IF_ERROR(
          BuildOwnHeaders(state, reply.save_id, options.checksum_block_bytes, &order));
    }
    stats.plan_cached = from_cache;
    for (const ChunkWrite& w : order.plan.writes) stats.bytes_written += w.byte_length;
    stats.files_written = static_cast<uint32_t>(order.files.size());
    return WriteRankFiles(order, state, path, options, ctx->store(),
                          ctx->pool(), &files, &clock, &stats);
  }();
  // A save whose plan the cache holds commits with the plan's tensors, kept alive here even if
  // another save replaces the cache's plan meanwhile. A plan the cache keeps without its chunks
  // takes them from the decode started above; the cache then holds the plan whole until this
  // save has committed.
  std::shared_ptr<const GlobalSavePlan> shared_plan;
  Status restored = OkStatus();
  if (pending_metadata) {
    shared_plan = pending_metadata->plan;
    if (restoring.valid()) {
      Result<std::shared_ptr<const GlobalSavePlan>> whole = restoring.get();
      std::unique_lock<std::mutex> lock = CacheAccess::Lock(*cache);
      SavePlanCacheState& cached = CacheAccess::State(*cache);
      if (!whole.ok()) {
        restored = whole.status();
        if (cached.plan == shared_plan) cached.plan_id = 0;  // plan afresh next time
      } else {
        if (cached.plan == shared_plan) {
          cached.plan = *whole;
          cached.committed_file.reset();
        }
        shared_plan = std::move(whole).value();
      }
    }
    metadata = std::move(*pending_metadata).WithoutTensors();
    pending_metadata.reset();
  }
  Result<std::vector<std::string>> reports = GatherOrFail(comm, std::move(report), root);
  if (!reports.ok()) {
    RemoveFiles(ctx->store(), files);
    return reports.status();
  }
  Status committed = restored;
  if (comm.rank() == root && committed.ok()) {
    Result<std::unique_ptr<CheckpointWriter>> writer =
        MakeCheckpointWriter(options.format, options.megatron);
    // The committed file of a native plan kept without writes: the cache keeps it instead of
    // the plan's chunks until the next save from the plan.
    const bool keep_file = shared_plan != nullptr && options.format == CheckpointFormat::kNative;
    std::string committed_file;
    committed = writer.ok()
                    ? CommitOnCoordinator(std::move(*reports), path, ctx->store(), root,
                                          **writer, commit_condition,
                                          shared_plan ? shared_plan->metadata.tensors
                                                      : metadata.tensors,
                                          &metadata, &ctx->pool(),
                                          keep_file ? &committed_file : nullptr)
                    : writer.status();
    if (committed.ok() && keep_file) {
      // Kept for a plan larger than the cache's threshold, unless the file is the larger by more
      // than kPlanFileSlackBytes (it holds the objects' values too).
      const uint64_t chunk_bytes = ChunkListBytes(shared_plan->metadata.tensors);
      std::unique_lock<std::mutex> lock = CacheAccess::Lock(*cache);
      SavePlanCacheState& cached = CacheAccess::State(*cache);
      if (cached.plan == shared_plan && !cached.plan_has_writes &&
          (chunk_bytes > CacheAccess::KeepFileAboveBytes(*cache) ||
           CacheAccess::KeepFileAboveBytes(*cache) == 0) &&
          committed_file.size() <= chunk_bytes + kPlanFileSlackBytes) {
        cached.plan = WithoutChunks(*shared_plan);
        cached.committed_file = std::make_shared<const std::string>(std::move(committed_file));
      }
    }
  }
  // A failed commit leaves the data files alone: the metadata may already be in place. Files
  // that end up unreferenced are removed by the next save at this path.
  Status agreed = AgreeOnStatus(comm, committed);
  Lap(&clock, &stats.commit_seconds);
  return agreed;
}

}  // namespace sp
