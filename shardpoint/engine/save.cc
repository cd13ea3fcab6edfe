// Save: local plan -> gather -> global plan (coordinator) -> scatter -> parallel checksummed
// writes -> gather reports -> atomic commit by the coordinator -> every rank learns the outcome.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/base/random_id.h"
#include "shardpoint/engine/save.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/engine/chunk_writes.h"
#include "shardpoint/engine/cleanup.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/local_state.h"
#include "shardpoint/engine/save_internal.h"
#include "shardpoint/engine/save_messages.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_dcp/megatron.h"
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

// PyTorch DCP data files keep torch's names ("__<rank>_<k>.distcp") unless they would replace the
// files of a committed DCP checkpoint before the new one is committed: then they carry the save id.
Result<std::string> DcpNameSuffix(Store& store, std::string_view path, std::string_view save_id) {
  SP_ASSIGN_OR_RETURN(bool replacing, store.Exists(JoinPath(path, torch_dcp::kDcpMetadataFileName)));
  return replacing ? "-" + std::string(save_id) : std::string();
}

// Native data files: a safetensors header, then the chunks at their planned offsets.
void SetNativeFileLayout(CheckpointMetadata* md, std::vector<std::string>* headers) {
  std::vector<uint64_t> data_bytes(md->files.size(), 0);
  for (const TensorMetadata& t : md->tensors) {
    for (const StoredChunk& c : t.chunks) data_bytes[c.file] += c.byte_length;
  }
  for (uint32_t f = 0; f < md->files.size(); ++f) {
    (*headers)[f] = BuildDataFileHeader(*md, f);
    md->files[f].data_start = (*headers)[f].size();
    md->files[f].size = (*headers)[f].size() + data_bytes[f];
  }
}

// Coordinator: refuses to replace a committed checkpoint unless asked, plans, lays out each data
// file's header, creates the directory, and returns the global plan plus one payload per rank.
Result<std::vector<std::string>> PlanOnCoordinator(const std::vector<std::string>& gathered,
                                                   std::string_view path,
                                                   const SaveOptions& options, Store& store,
                                                   CheckpointMetadata* metadata) {
  if (options.format != CheckpointFormat::kNative && options.format != CheckpointFormat::kTorchDcp) {
    return InvalidArgumentError("cannot save in the safetensors format (use consolidation)");
  }
  if (options.megatron && options.format != CheckpointFormat::kTorchDcp) {
    return InvalidArgumentError("a Megatron checkpoint is a torch-dcp checkpoint "
                                "(format kTorchDcp)");
  }
  for (std::string_view name : {std::string_view(kMetadataFileName),
                                std::string_view(torch_dcp::kDcpMetadataFileName)}) {
    SP_ASSIGN_OR_RETURN(bool exists, store.Exists(JoinPath(path, name)));
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

  plan.metadata.format = options.format;
  std::vector<std::string> headers(plan.metadata.files.size());
  if (options.format == CheckpointFormat::kTorchDcp) {
    plan.metadata.checksum_block_bytes = 0;
    SP_ASSIGN_OR_RETURN(const std::string suffix, DcpNameSuffix(store, path, plan.metadata.save_id));
    SP_RETURN_IF_ERROR(torch_dcp::LayoutDcpFiles(&plan.metadata, suffix));
    for (RankSavePlan& rank : plan.ranks) {
      for (ChunkWrite& w : rank.writes) {
        w.data_offset = plan.metadata.tensors.at(w.tensor).chunks.at(w.chunk).data_offset;
      }
    }
  } else {
    SetNativeFileLayout(&plan.metadata, &headers);
  }
  SP_RETURN_IF_ERROR(CreateDurableDirs(store, path));

  std::vector<std::string> payloads(plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    RankWriteOrder order;
    order.format = options.format;
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

// Removes this rank's files of a failed save (best effort: the save already failed).
void RemoveFiles(Store& store, const std::vector<OpenFile>& files) {
  for (const OpenFile& f : files) {
    store.RemoveFile(f.temp_path).IgnoreError();
    store.RemoveFile(f.final_path).IgnoreError();
  }
}

// Every rank: writes the files of its order and returns the checksum report.
Result<std::string> WriteRankFiles(const RankWriteOrder& order, const SaveState& state,
                                   std::string_view path, const SaveOptions& options, Store& store,
                                   ThreadPool& pool, std::vector<OpenFile>* files,
                                   Clock::time_point* clock, SaveStats* stats) {
  std::map<uint32_t, size_t> file_slot;  // checkpoint file index -> position in *files
  for (const FileOrder& f : order.files) {
    OpenFile open;
    open.order = &f;
    open.final_path = JoinPath(path, f.name);
    open.temp_path = open.final_path + ".tmp";
    SP_ASSIGN_OR_RETURN(open.file, store.NewWritableFile(open.temp_path));
    // Registered before anything else can fail, so that a failed save removes it.
    file_slot[f.index] = files->size();
    files->push_back(std::move(open));
    WritableFile& file = *files->back().file;
    SP_RETURN_IF_ERROR(file.Preallocate(f.size));
    SP_RETURN_IF_ERROR(file.WriteAt(0, AsBytes(f.header)));
  }
  WriteReport report;
  report.chunks.resize(order.plan.writes.size());
  std::vector<DcpItem> items(order.format == CheckpointFormat::kTorchDcp ? order.plan.writes.size() : 0);
  ByteBudget budget(options.fill_budget_bytes);
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
    DcpItem* item = items.empty() ? nullptr : &items[w];
    if (piece.data == nullptr && write.byte_length > 0) {
      if (!options.fill_piece) return InternalError("a piece without memory and no fill_piece");
      ChunkReport* chunk_report = &report.chunks[w];
      group.Run([&, chunk_report, item, w] {
        return WriteFilledChunk(order.plan.writes[w], tensor, options, order.format, file, budget,
                                chunk_report, item);
      });
    } else if (item != nullptr) {
      SP_RETURN_IF_ERROR(QueueDcpItem(write, tensor.dtype, piece, file, &options.on_chunk_written,
                                      group, item));
    } else {
      QueueNativeChunk(write, piece.data, file, options.checksum_block_bytes,
                       &options.on_chunk_written, group, &report.chunks[w]);
    }
  }
  SP_RETURN_IF_ERROR(group.Wait());
  for (DcpItem& item : items) SP_RETURN_IF_ERROR(item.WriteTail());
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

// A Megatron save (SaveOptions::megatron): common.pt with the objects and metadata.json, both
// durable before `.metadata` commits; the objects move to *objects so that no BYTE_IO item is
// written for them.
Status WriteMegatronFiles(Store& store, std::string_view path, std::string_view temp_suffix,
                          CheckpointMetadata* metadata, std::vector<ObjectEntry>* objects) {
  SP_ASSIGN_OR_RETURN(std::string common, torch_dcp::BuildMegatronCommonFile(*metadata));
  for (const auto& [name, bytes] :
       {std::pair<std::string_view, std::string>{torch_dcp::kMegatronCommonFileName, std::move(common)},
        {torch_dcp::kMegatronConfigFileName, torch_dcp::EncodeMegatronConfig()}}) {
    SP_RETURN_IF_ERROR(
        WriteFileDurably(store, path, name, std::string(name) + std::string(temp_suffix), bytes));
  }
  *objects = std::exchange(metadata->objects, {});
  return OkStatus();
}

// After a commit that is not a Megatron save: Megatron-Core files left by a replaced Megatron
// checkpoint would make readers take this checkpoint for one (and read the old common.pt), so
// they go, when metadata.json is Megatron's (best effort: the new checkpoint is committed).
void RemoveReplacedMegatronFiles(Store& store, std::string_view path) {
  const std::string config_path = JoinPath(path, torch_dcp::kMegatronConfigFileName);
  Result<std::unique_ptr<ReadableFile>> file = store.OpenReadable(config_path);
  if (!file.ok() || (*file)->size() > torch_dcp::kMaxMegatronConfigBytes) return;
  std::string text((*file)->size(), '\0');
  MutableByteView out(reinterpret_cast<std::byte*>(text.data()), text.size());
  if (!(*file)->ReadAt(0, out).ok() || !torch_dcp::ParseMegatronConfig(text, config_path).ok()) {
    return;
  }
  store.RemoveFile(config_path).IgnoreError();
  store.RemoveFile(JoinPath(path, torch_dcp::kMegatronCommonFileName)).IgnoreError();
}

// Coordinator: takes the reports, makes the data durable, writes and renames the metadata (for
// PyTorch DCP, after the file of the objects), removes the other format's metadata if a
// checkpoint of that format was replaced, then removes files of earlier or failed saves that the
// new metadata does not name.
Status CommitOnCoordinator(const std::vector<std::string>& reports, std::string_view path,
                           Store& store, int coordinator, bool megatron,
                           CheckpointMetadata* metadata) {
  SP_RETURN_IF_ERROR(CollectReports(reports, metadata));
  const std::string temp_suffix = ".tmp-" + metadata->save_id;
  std::string metadata_name = kMetadataFileName, other_name = torch_dcp::kDcpMetadataFileName;
  std::string encoded;
  if (metadata->format == CheckpointFormat::kTorchDcp) {
    std::swap(metadata_name, other_name);
    // The same answer as when the files were named: only this commit changes `.metadata`.
    SP_ASSIGN_OR_RETURN(const std::string suffix, DcpNameSuffix(store, path, metadata->save_id));
    std::vector<ObjectEntry> common_objects;  // a Megatron save's objects go to common.pt only
    if (megatron) {
      SP_RETURN_IF_ERROR(WriteMegatronFiles(store, path, temp_suffix, metadata, &common_objects));
    }
    SP_ASSIGN_OR_RETURN(torch_dcp::DcpObjectFile objects,
                        torch_dcp::BuildDcpObjectFile(*metadata, coordinator, suffix));
    SP_ASSIGN_OR_RETURN(encoded, torch_dcp::BuildDcpMetadataFile(*metadata, objects, path));
    if (megatron) metadata->objects = std::move(common_objects);
    if (!objects.items.empty()) {
      SP_RETURN_IF_ERROR(
          WriteFileDurably(store, path, objects.name, objects.name + ".tmp", objects.bytes));
      metadata->files.push_back(DataFile{objects.name, 0, objects.bytes.size(), coordinator});
    }
  } else {
    encoded = EncodeMetadata(*metadata);
  }
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  SP_RETURN_IF_ERROR(
      WriteFileDurably(store, path, metadata_name, metadata_name + temp_suffix, encoded));
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  // A checkpoint of the other format replaced by this one: its metadata goes only now, so that
  // a crash before this point leaves the old checkpoint loadable.
  const std::string other_path = JoinPath(path, other_name);
  if (Result<bool> other = store.Exists(other_path); other.ok() && *other) {
    SP_RETURN_IF_ERROR(store.RemoveFile(other_path));
    SP_RETURN_IF_ERROR(store.SyncDir(path));
  }
  if (!megatron) RemoveReplacedMegatronFiles(store, path);
  RemoveUnreferencedFiles(store, path, *metadata);
  return OkStatus();
}

}  // namespace

void RemoveUnreferencedFiles(Store& store, std::string_view path,
                             const CheckpointMetadata& metadata) {
  Result<std::vector<DirEntry>> entries = store.ListDir(path);
  if (!entries.ok()) return;
  std::set<std::string> keep;
  for (const DataFile& f : metadata.files) keep.insert(f.name);
  for (const DirEntry& e : *entries) {
    if (e.is_directory || keep.count(e.name)) continue;
    bool ours = (e.name.starts_with("d-") && (e.name.ends_with(".safetensors") ||
                                               e.name.ends_with(".safetensors.tmp"))) ||
                (e.name.starts_with("__") && (e.name.ends_with(".distcp") ||
                                              e.name.ends_with(".distcp.tmp"))) ||
                e.name.starts_with(std::string(kMetadataFileName) + ".tmp-") ||
                e.name.starts_with(std::string(torch_dcp::kDcpMetadataFileName) + ".tmp-");
    if (ours) store.RemoveFile(JoinPath(path, e.name)).IgnoreError();
  }
}

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
    SP_ASSIGN_OR_RETURN(LocalSavePlan plan, BuildLocalPlan(state, options.fill_piece != nullptr));
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
  Status committed = comm.rank() == root
                         ? CommitOnCoordinator(*reports, path, ctx->store(), root,
                                               options.megatron, &metadata)
                         : OkStatus();
  // A failed commit leaves the data files alone: the metadata may already be in place. Files
  // that end up unreferenced are removed by the next save at this path.
  Status agreed = AgreeOnStatus(comm, committed);
  Lap(&clock, &stats.commit_seconds);
  return agreed;
}

}  // namespace sp
