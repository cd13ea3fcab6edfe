// Save: local plan -> gather -> global plan (coordinator) -> scatter -> parallel checksummed
// writes -> gather reports -> atomic commit by the coordinator -> every rank learns the outcome.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <set>

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
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/writer.h"
#include "shardpoint/plan/plan_codec.h"
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

Result<LocalSavePlan> BuildLocalPlan(const SaveState& state, bool data_optional) {
  LocalSavePlan plan;
  std::set<std::string_view> names;
  for (const SaveTensor& t : state.tensors) {
    SP_ASSIGN_OR_RETURN(LocalTensor local, ToLocalTensor(t, names, data_optional));
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

// Coordinator: picks the format's writer, refuses to replace a committed checkpoint (of any
// format) unless asked, plans, has the writer lay out the data files, creates the directory, and
// returns one payload per rank.
Result<std::vector<std::string>> PlanOnCoordinator(const std::vector<std::string>& gathered,
                                                   std::string_view path,
                                                   const SaveOptions& options, Store& store,
                                                   CheckpointMetadata* metadata) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      MakeCheckpointWriter(options.format, options.megatron));
  std::set<std::string_view> committed_names;
  for (const std::unique_ptr<CheckpointWriter>& w : AllCheckpointWriters()) {
    if (!committed_names.insert(w->metadata_file_name()).second) continue;
    SP_ASSIGN_OR_RETURN(bool exists, store.Exists(JoinPath(path, w->metadata_file_name())));
    if (exists && !options.overwrite) {
      return AlreadyExistsError("a committed checkpoint already exists at " + std::string(path) +
                                " (pass overwrite to replace it)");
    }
  }
  std::vector<LocalSavePlan> locals;
  locals.reserve(gathered.size());
  for (size_t r = 0; r < gathered.size(); ++r) {
    SP_ASSIGN_OR_RETURN(LocalSavePlan local, DecodeLocalSavePlan(gathered[r]));
    locals.push_back(std::move(local));
  }
  SavePlanOptions plan_options;
  plan_options.files_per_rank = std::max(1, options.files_per_rank);
  plan_options.dedup_to_lowest_rank = options.dedup_to_lowest_rank;
  plan_options.save_id = RandomHexId(12);
  plan_options.checksum_block_bytes = options.checksum_block_bytes;
  plan_options.separate_key_prefixes = options.separate_key_prefixes;
  SP_ASSIGN_OR_RETURN(GlobalSavePlan plan, PlanSave(locals, plan_options));
  plan.metadata.world_size = static_cast<int32_t>(gathered.size());
  plan.metadata.attributes = options.attributes;

  plan.metadata.format = writer->format();
  SP_ASSIGN_OR_RETURN(const std::vector<std::string> headers,
                      writer->LayOutFiles(store, path, &plan.metadata));
  // The writer may move chunks within their files (framing between them): writes follow.
  for (RankSavePlan& rank : plan.ranks) {
    for (ChunkWrite& w : rank.writes) {
      w.data_offset = plan.metadata.tensors.at(w.tensor).chunks.at(w.chunk).data_offset;
    }
  }
  SP_RETURN_IF_ERROR(CreateDurableDirs(store, path));

  std::vector<std::string> payloads(plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    RankWriteOrder order;
    order.format = writer->format();
    order.plan = plan.ranks[r];
    for (uint32_t f : plan.ranks[r].files) {
      const DataFile& file = plan.metadata.files[f];
      order.files.push_back({f, file.name, headers[f], file.size});
    }
    payloads[r] = EncodeRankWriteOrder(order);
  }
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
    store.RemoveFile(f.temp_path).IgnoreError();
    store.RemoveFile(f.final_path).IgnoreError();
  }
}

// Every rank: writes the files of its order through the format's chunk writer and returns the
// checksum report.
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
    open.temp_path = open.final_path + ".tmp";
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
    SP_RETURN_IF_ERROR(file.WriteAt(0, AsBytes(f.header)));
  }
  // Direct writes stage through the pool's buffers, kept for reuse until the save is done.
  BufferPool::Stay stay(pool.staging());
  WriteReport report;
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
  Lap(clock, &stats->write_seconds);
  SP_RETURN_IF_ERROR(ParallelFor(&pool, static_cast<int64_t>(files->size()), [&](int64_t i) {
    OpenFile& f = (*files)[i];
    SP_RETURN_IF_ERROR(f.file->Sync());
    SP_RETURN_IF_ERROR(f.file->Close());
    return store.Rename(f.temp_path, f.final_path);
  }));
  Lap(clock, &stats->sync_seconds);
  return EncodeWriteReport(report);
}

// Checks that some rank reported every chunk, and takes the checksums of native chunks.
Status CollectReports(const std::vector<std::string>& reports, CheckpointMetadata* metadata) {
  std::vector<std::vector<bool>> reported(metadata->tensors.size());
  for (size_t t = 0; t < metadata->tensors.size(); ++t) {
    reported[t].resize(metadata->tensors[t].chunks.size());
  }
  for (size_t r = 0; r < reports.size(); ++r) {
    SP_ASSIGN_OR_RETURN(WriteReport report, DecodeWriteReport(reports[r]));
    for (ChunkReport& c : report.chunks) {
      if (c.tensor >= metadata->tensors.size() ||
          c.chunk >= metadata->tensors[c.tensor].chunks.size()) {
        return InternalError("rank " + std::to_string(r) + " reported an unknown chunk");
      }
      reported[c.tensor][c.chunk] = true;
      metadata->tensors[c.tensor].chunks[c.chunk].block_crc32c = std::move(c.block_crc32c);
    }
  }
  for (size_t t = 0; t < metadata->tensors.size(); ++t) {
    for (size_t c = 0; c < reported[t].size(); ++c) {
      if (!reported[t][c]) {
        return InternalError("no rank reported writing tensor '" + metadata->tensors[t].name +
                             "' chunk " + metadata->tensors[t].chunks[c].box.ToString());
      }
    }
  }
  return OkStatus();
}

// Coordinator: takes the reports, has the writer write what must precede the commit (for
// PyTorch DCP the file of the objects, for Megatron its files), makes the data durable, writes
// and renames the metadata (the commit point), has the writers of the other kinds remove what a
// replaced checkpoint of theirs left (its metadata first, so that a crash before this point
// leaves the old checkpoint loadable), then removes files of earlier or failed saves that the new
// metadata does not name.
Status CommitOnCoordinator(const std::vector<std::string>& reports, std::string_view path,
                           Store& store, int coordinator, const CheckpointWriter& writer,
                           CheckpointMetadata* metadata) {
  SP_RETURN_IF_ERROR(CollectReports(reports, metadata));
  SP_ASSIGN_OR_RETURN(const std::string encoded,
                      writer.PrepareCommit(store, path, coordinator, metadata));
  const std::string metadata_name(writer.metadata_file_name());
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  SP_RETURN_IF_ERROR(WriteFileDurably(store, path, metadata_name,
                                      metadata_name + ".tmp-" + metadata->save_id, encoded));
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  for (const std::unique_ptr<CheckpointWriter>& other : AllCheckpointWriters()) {
    if (other->kind() == writer.kind()) continue;
    SP_RETURN_IF_ERROR(other->RemoveReplaced(store, path, metadata_name));
  }
  RemoveUnreferencedFiles(store, path, *metadata);
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
  Result<std::string> local = [&]() -> Result<std::string> {
    SP_RETURN_IF_ERROR(local_failure);
    SP_ASSIGN_OR_RETURN(LocalSavePlan plan, BuildLocalPlan(state, options.fills()));
    return EncodeLocalSavePlan(plan);
  }();
  SP_ASSIGN_OR_RETURN(std::vector<std::string> gathered,
                      GatherOrFail(comm, std::move(local), root));

  CheckpointMetadata metadata;
  Result<std::vector<std::string>> payloads =
      comm.rank() == root
          ? PlanOnCoordinator(gathered, path, options, ctx->store(), &metadata)
          : Result<std::vector<std::string>>(std::vector<std::string>());
  SP_ASSIGN_OR_RETURN(std::string my_payload, ScatterOrFail(comm, std::move(payloads), root));
  Lap(&clock, &stats.plan_seconds);

  std::vector<OpenFile> files;
  Result<std::string> report = [&]() -> Result<std::string> {
    SP_ASSIGN_OR_RETURN(RankWriteOrder order, DecodeRankWriteOrder(my_payload));
    for (const ChunkWrite& w : order.plan.writes) stats.bytes_written += w.byte_length;
    stats.files_written = static_cast<uint32_t>(order.files.size());
    return WriteRankFiles(order, state, path, options, ctx->store(),
                          ctx->pool(), &files, &clock, &stats);
  }();
  Result<std::vector<std::string>> reports = GatherOrFail(comm, std::move(report), root);
  if (!reports.ok()) {
    RemoveFiles(ctx->store(), files);
    return reports.status();
  }
  Status committed = OkStatus();
  if (comm.rank() == root) {
    Result<std::unique_ptr<CheckpointWriter>> writer =
        MakeCheckpointWriter(options.format, options.megatron);
    committed = writer.ok() ? CommitOnCoordinator(*reports, path, ctx->store(), root, **writer,
                                                  &metadata)
                            : writer.status();
  }
  // A failed commit leaves the data files alone: the metadata may already be in place. Files
  // that end up unreferenced are removed by the next save at this path.
  Status agreed = AgreeOnStatus(comm, committed);
  Lap(&clock, &stats.commit_seconds);
  return agreed;
}

}  // namespace sp
