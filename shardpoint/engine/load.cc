// Load: the coordinator reads the metadata and broadcasts it; every rank plans its reads from box
// intersections and hands them to the read executor; every rank returns the same outcome.
#include <algorithm>
#include <set>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/collective.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/local_state.h"
#include "shardpoint/engine/read_executor.h"
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

// Opens the data files the requests need, checking each one's size against the metadata.
Result<std::vector<std::unique_ptr<ReadableFile>>> OpenFiles(
    std::span<const ReadRequest> requests, const CheckpointMetadata& metadata, Store& store,
    std::string_view path) {
  std::vector<std::unique_ptr<ReadableFile>> files(metadata.files.size());
  for (const ReadRequest& r : requests) {
    const uint32_t f = r.chunk->file;
    if (files[f]) continue;
    const DataFile& file = metadata.files[f];
    Result<std::unique_ptr<ReadableFile>> opened = store.OpenReadable(JoinPath(path, file.name));
    if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
      // The metadata is committed, so a missing file is damage, not an absent checkpoint.
      return DataLossError("data file " + JoinPath(path, file.name) +
                           " named by the committed metadata is missing: " +
                           opened.status().message());
    }
    SP_ASSIGN_OR_RETURN(files[f], std::move(opened));
    if (files[f]->size() != file.size) {
      return DataLossError("data file " + files[f]->path() + " has " +
                           std::to_string(files[f]->size()) + " bytes, expected " +
                           std::to_string(file.size) + " (truncated or replaced)");
    }
  }
  return files;
}

Result<LoadResult> LoadLocal(const LoadState& state, const CheckpointMetadata& metadata,
                             std::string_view path, const LoadOptions& options,
                             EngineContext& ctx) {
  SP_ASSIGN_OR_RETURN(std::vector<LocalTensor> targets, BuildTargets(state));
  SP_ASSIGN_OR_RETURN(LoadPlan plan,
                      PlanLoad(targets, metadata, LoadPlanOptions{options.strict,
                                                                  options.allow_cast}));
  LoadResult result;
  result.missing_keys = plan.missing_keys;
  result.unexpected_keys = plan.unexpected_keys;
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
  for (const ObjectEntry& object : metadata.objects) {
    if (!wanted.count(object.name)) result.unexpected_keys.push_back(object.name);
  }
  std::sort(result.unexpected_keys.begin(), result.unexpected_keys.end());

  std::vector<ReadRequest> requests;
  requests.reserve(plan.items.size());
  for (const ReadItem& item : plan.items) {
    const TensorMetadata* stored = plan.stored[item.target];
    const LoadTensor& dest = state.tensors[item.target];
    requests.push_back(ReadRequest{stored, &stored->chunks[item.stored_chunk], &dest,
                                   &dest.pieces[item.target_box], item.region});
  }
  SP_ASSIGN_OR_RETURN(auto files, OpenFiles(requests, metadata, ctx.store(), path));
  ReadExecutorOptions read_options;
  read_options.verify = options.verify_checksums;
  // Staging per task; a cast needs up to twice more for the packed and converted copies.
  const uint64_t tasks = static_cast<uint64_t>(std::max(1, ctx.pool().size()));
  read_options.window = std::max<uint64_t>(std::max<uint64_t>(1, metadata.checksum_block_bytes),
                                           options.memory_budget_bytes / (3 * tasks));
  SP_ASSIGN_OR_RETURN(result.bytes_read,
                      ExecuteReads(requests, metadata, files, ctx.pool(), read_options));
  return result;
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

Result<LoadResult> Load(const LoadState& state, std::string_view path,
                        const LoadOptions& options) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, options.comm, options.store, options.pool,
                                          options.threads, options.coordinator));
  Communicator& comm = ctx->comm();
  const int root = options.coordinator;
  // The coordinator opens the checkpoint, whatever its format, and every rank gets the decoded
  // metadata (or the same error), so a corrupt file fails identically everywhere.
  Result<std::string> encoded = [&]() -> Result<std::string> {
    if (comm.rank() != root) return std::string();
    SP_ASSIGN_OR_RETURN(CheckpointMetadata metadata,
                        OpenCheckpointMetadata(ctx->store(), path, &ctx->pool()));
    return EncodeMetadataForWire(metadata);
  }();
  SP_ASSIGN_OR_RETURN(std::string bytes, BroadcastOrFail(comm, std::move(encoded), root));
  Result<LoadResult> result = [&]() -> Result<LoadResult> {
    SP_ASSIGN_OR_RETURN(CheckpointMetadata metadata, DecodeMetadataFromWire(bytes));
    return LoadLocal(state, metadata, path, options, *ctx);
  }();
  SP_RETURN_IF_ERROR(AgreeOnStatus(comm, result.status()));
  return result;
}

}  // namespace sp
