// Consolidate: plan every output file from the metadata, then fill them slab by slab on the pool.
#include "shardpoint/manage/consolidate.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "shardpoint/checkpoint.h"
#include "shardpoint/manage/consolidate_plan.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/opened_checkpoint.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/plan/load_plan.h"

namespace sp {
namespace {

// Slabs are at least this big (unless the tensor is smaller), so I/O stays efficient.
constexpr uint64_t kMinSlabBytes = uint64_t{64} << 10;

std::string TempName(std::string_view name) { return "." + std::string(name) + ".partial"; }

// A region of one output tensor, contiguous in the output file.
struct Slab {
  size_t file = 0;
  size_t tensor = 0;
  Box box;
  uint64_t byte_offset = 0;  // from the tensor's first byte
  uint64_t bytes = 0;
  std::vector<ReadItem> reads;
};

// Cuts a tensor into boxes contiguous in row-major order of at most `max_bytes` (at least one
// element): the leading dims fixed, a range of dim k, the trailing dims whole.
void CutTensor(const Shape& shape, size_t element_size, uint64_t max_bytes, Slab prototype,
               std::vector<Slab>& out) {
  const size_t n = shape.size();
  if (ShapeVolume(shape) == 0) return;
  if (n == 0) {
    prototype.box = Box({}, {});
    prototype.bytes = element_size;
    out.push_back(std::move(prototype));
    return;
  }
  std::vector<uint64_t> step(n, element_size);
  for (size_t d = n - 1; d > 0; --d) step[d - 1] = step[d] * static_cast<uint64_t>(shape[d]);
  size_t k = 0;
  while (k + 1 < n && step[k] > max_bytes) ++k;
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(max_bytes / step[k]));
  std::vector<int64_t> index(n, 0);  // odometer over dims < k
  for (;;) {
    for (int64_t lo = 0; lo < shape[k]; lo += rows) {
      Slab s = prototype;
      s.box.offsets = index;
      s.box.offsets[k] = lo;
      s.box.sizes.assign(n, 1);
      s.box.sizes[k] = std::min(rows, shape[k] - lo);
      for (size_t d = k + 1; d < n; ++d) s.box.sizes[d] = shape[d];
      for (size_t d = 0; d <= k; ++d) s.byte_offset += static_cast<uint64_t>(s.box.offsets[d]) * step[d];
      s.bytes = static_cast<uint64_t>(s.box.sizes[k]) * step[k];
      out.push_back(std::move(s));
    }
    size_t d = k;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
}

// Every slab of the plan, with the stored-chunk reads that fill it (from the load planner, which
// also proves each slab is covered exactly once).
Result<std::vector<Slab>> PlanSlabs(const ConsolidationPlan& plan, const CheckpointMetadata& md,
                                    uint64_t slab_bytes) {
  std::vector<Slab> slabs;
  std::vector<LocalTensor> targets;
  std::vector<std::vector<size_t>> slab_of;  // per target, per box: index into slabs
  for (size_t f = 0; f < plan.files.size(); ++f) {
    for (size_t i = 0; i < plan.files[f].tensors.size(); ++i) {
      const OutputTensor& t = plan.files[f].tensors[i];
      const size_t first = slabs.size();
      Slab prototype;
      prototype.file = f;
      prototype.tensor = i;
      // A driver-decoded chunk (zstd or strided DCP item) is read and decoded whole for every
      // slab that needs it: such tensors go in one slab, so each chunk is decoded once.
      const bool decoded = std::any_of(
          t.source->chunks.begin(), t.source->chunks.end(),
          [](const StoredChunk& c) { return c.encoding == ChunkEncoding::kDriverDecoded; });
      CutTensor(t.source->shape, DTypeSize(t.dtype), decoded ? UINT64_MAX : slab_bytes, prototype,
                slabs);
      LocalTensor& target = targets.emplace_back();
      target = LocalTensor{t.source->name, t.dtype, t.source->shape, {}};
      std::vector<size_t>& boxes = slab_of.emplace_back();
      for (size_t s = first; s < slabs.size(); ++s) {
        target.boxes.push_back(slabs[s].box);
        boxes.push_back(s);
      }
    }
  }
  SP_ASSIGN_OR_RETURN(LoadPlan load, PlanLoad(targets, md, LoadPlanOptions{true, true}));
  for (ReadItem& item : load.items) {
    slabs[slab_of[item.target][item.target_box]].reads.push_back(std::move(item));
  }
  return slabs;
}

// The source data files the slabs read.
std::vector<bool> FilesRead(const std::vector<Slab>& slabs, const ConsolidationPlan& plan,
                            const CheckpointMetadata& md) {
  std::vector<bool> needed(md.files.size(), false);
  for (const Slab& slab : slabs) {
    const TensorMetadata& t = *plan.files[slab.file].tensors[slab.tensor].source;
    for (const ReadItem& item : slab.reads) needed[t.chunks[item.stored_chunk].file] = true;
  }
  return needed;
}

// The state shared by the slab tasks of one call.
struct Job {
  Job(const ConsolidationPlan& plan_in, const CheckpointMetadata& md_in, ThreadPool& pool_in,
      const ConsolidateOptions& options_in)
      : plan(plan_in), md(md_in), pool(pool_in), options(options_in),
        headers(md_in.files.size()) {}

  const ConsolidationPlan& plan;
  const CheckpointMetadata& md;
  ThreadPool& pool;
  const ConsolidateOptions& options;
  std::vector<std::unique_ptr<ReadableFile>> sources;
  HeaderChecksums headers;  // the sources' checksums, where their metadata holds none
  std::vector<std::unique_ptr<WritableFile>> outputs;
  uint64_t window = 0;
  std::vector<uint32_t> slab_crc32;  // torch files: the CRC-32 of each slab's bytes
  std::atomic<uint64_t> bytes_read{0};
  std::mutex progress_mu;
  uint64_t bytes_written = 0;  // guarded by progress_mu
  uint64_t next_report = 0;    // guarded by progress_mu
};

void ReportProgress(Job& job, uint64_t bytes) {
  if (!job.options.progress) return;
  std::lock_guard<std::mutex> lock(job.progress_mu);
  job.bytes_written += bytes;
  if (job.bytes_written < job.next_report) return;
  job.next_report = job.bytes_written + std::max<uint64_t>(1, job.plan.total_bytes / 100);
  job.options.progress(job.bytes_written, job.plan.total_bytes);
}

Status FillSlab(Job& job, const Slab& slab, size_t index) {
  const OutputTensor& out = job.plan.files[slab.file].tensors[slab.tensor];
  const TensorMetadata& stored = *out.source;
  AlignedBuffer buffer(slab.bytes);
  const ReadDestination dest{buffer.data(), slab.box, out.dtype};
  std::vector<ReadRequest> requests;
  requests.reserve(slab.reads.size());
  for (const ReadItem& item : slab.reads) {
    requests.push_back(MakeReadRequest(stored, item.stored_chunk, dest, item.region));
  }
  ReadExecutorOptions read_options;
  read_options.window = job.window;
  read_options.header_checksums = &job.headers;
  SP_ASSIGN_OR_RETURN(uint64_t read,
                      ExecuteReads(requests, job.md, job.sources, job.pool, read_options));
  job.bytes_read.fetch_add(read, std::memory_order_relaxed);
  if (job.plan.files[slab.file].torch) {
    job.slab_crc32[index] = Crc32(0, buffer.data(), slab.bytes);
  }
  WritableFile& file = *job.outputs[slab.file];
  const uint64_t offset = out.file_offset + slab.byte_offset;
  SP_RETURN_IF_ERROR(file.WriteAt(offset, buffer.view()));
  file.StartWriteback(offset, slab.bytes);
  ReportProgress(job, slab.bytes);
  return OkStatus();
}

// Creates every output under its temporary name, reserves its size and writes its head.
Status CreateOutputs(Job& job, Store& store, std::string_view out_dir) {
  for (const OutputFile& f : job.plan.files) {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                        store.NewWritableFile(JoinPath(out_dir, TempName(f.name))));
    SP_RETURN_IF_ERROR(file->Preallocate(f.size));
    SP_RETURN_IF_ERROR(file->WriteAt(0, AsBytes(f.head)));
    job.outputs.push_back(std::move(file));
  }
  return OkStatus();
}

// Syncs and renames every output into place, then writes the index (or removes a stale one).
Status Commit(Job& job, Store& store, std::string_view out_dir) {
  for (size_t f = 0; f < job.outputs.size(); ++f) {
    SP_RETURN_IF_ERROR(job.outputs[f]->Sync());
    SP_RETURN_IF_ERROR(job.outputs[f]->Close());
  }
  for (const OutputFile& f : job.plan.files) {
    SP_RETURN_IF_ERROR(
        store.Rename(JoinPath(out_dir, TempName(f.name)), JoinPath(out_dir, f.name)));
  }
  const std::string index_name = IndexFileName(job.options.format);
  if (!job.plan.index_name.empty()) {
    SP_RETURN_IF_ERROR(
        WriteFileDurably(store, out_dir, index_name, TempName(index_name), job.plan.index_json));
  } else if (Result<bool> e = store.Exists(JoinPath(out_dir, index_name)); e.ok() && *e) {
    SP_RETURN_IF_ERROR(store.RemoveFile(JoinPath(out_dir, index_name)));
  }
  return store.SyncDir(out_dir);
}

// Output names of this format already in the directory.
Result<std::vector<std::string>> ExistingOutputs(Store& store, std::string_view out_dir,
                                                 ConsolidateFormat format) {
  std::vector<std::string> names;
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(out_dir));
  for (const DirEntry& e : entries) {
    if (!e.is_directory && IsOutputFileName(format, e.name)) names.push_back(e.name);
  }
  return names;
}

// Creates out_dir (*created: whether it was absent) and lists the outputs already there.
Status PrepareOutputDirectory(Store& store, std::string_view source, std::string_view out_dir,
                              const ConsolidateOptions& options, std::vector<std::string>* stale,
                              bool* created) {
  const std::string src = NormalizePath(source), out = NormalizePath(out_dir);
  const Result<bool> source_is_directory = store.IsDirectory(src);
  const bool source_is_file = source_is_directory.ok() && !*source_is_directory;
  // The same directory however spelled (absolute, "c01/../c01", a link alias, a bind mount):
  // compared by device and inode, and textually for stores without either.
  SP_ASSIGN_OR_RETURN(bool same, store.SameFile(src, out));
  bool holds_file = false;
  if (source_is_file) {
    const std::string parent = ParentPath(src);
    SP_ASSIGN_OR_RETURN(holds_file, store.SameFile(parent.empty() ? "." : parent, out));
  }
  if (same || holds_file || src == out || (source_is_file && ParentPath(src) == out)) {
    return InvalidArgumentError("the output directory " + std::string(out_dir) +
                                " holds the source checkpoint; choose another directory");
  }
  SP_ASSIGN_OR_RETURN(bool exists, store.Exists(out_dir));
  SP_RETURN_IF_ERROR(store.CreateDirs(out_dir));
  *created = !exists;
  SP_ASSIGN_OR_RETURN(*stale, ExistingOutputs(store, out_dir, options.format));
  if (!stale->empty() && !options.overwrite) {
    return AlreadyExistsError(std::string(out_dir) + " already holds " + stale->front() +
                              (stale->size() > 1 ? " and " + std::to_string(stale->size() - 1) +
                                                       " more output file(s)"
                                                 : std::string()) +
                              "; pass overwrite to replace them");
  }
  return OkStatus();
}

Status RunSlabs(Job& job, const std::vector<Slab>& slabs) {
  job.slab_crc32.assign(slabs.size(), 0);
  TaskGroup group(&job.pool);
  for (size_t i = 0; i < slabs.size(); ++i) {
    group.Run([&job, &slab = slabs[i], i, &group]() -> Status {
      if (group.cancelled()) return OkStatus();
      return FillSlab(job, slab, i).WithContext(
          "consolidating tensor '" + job.plan.files[slab.file].tensors[slab.tensor].name +
          "' into " + job.plan.files[slab.file].name);
    });
  }
  return group.Wait();
}

// Torch archives: the ZIP framing after each tensor (data descriptor, next local header) and the
// central directory need every tensor's CRC-32, combined from its slabs' (in order).
Status WriteTorchFraming(Job& job, const std::vector<Slab>& slabs) {
  std::vector<std::vector<uint32_t>> crcs(job.plan.files.size());
  for (size_t f = 0; f < job.plan.files.size(); ++f) {
    crcs[f].assign(job.plan.files[f].tensors.size(), 0);
  }
  for (size_t i = 0; i < slabs.size(); ++i) {
    if (!job.plan.files[slabs[i].file].torch) continue;
    uint32_t& crc = crcs[slabs[i].file][slabs[i].tensor];
    crc = Crc32Combine(crc, job.slab_crc32[i], slabs[i].bytes);
  }
  for (size_t f = 0; f < job.plan.files.size(); ++f) {
    const OutputFile& file = job.plan.files[f];
    if (!file.torch) continue;
    const torch_save::TorchSaveLayout& layout = *file.torch;
    for (size_t i = 0; i + 1 < file.tensors.size(); ++i) {
      SP_RETURN_IF_ERROR(job.outputs[f]->WriteAt(layout.data_offset(i) + layout.data_bytes(i),
                                                 AsBytes(layout.Between(i, crcs[f][i]))));
    }
    const size_t n = file.tensors.size();
    const uint64_t tail_offset =
        n == 0 ? file.head.size() : layout.data_offset(n - 1) + layout.data_bytes(n - 1);
    SP_RETURN_IF_ERROR(job.outputs[f]->WriteAt(tail_offset, AsBytes(layout.Tail(crcs[f]))));
  }
  return OkStatus();
}

void RemoveTemporaries(Job& job, Store& store, std::string_view out_dir) {
  for (std::unique_ptr<WritableFile>& f : job.outputs) f->Close().IgnoreError();
  for (const OutputFile& f : job.plan.files) {
    store.RemoveFile(JoinPath(out_dir, TempName(f.name))).IgnoreError();
  }
  store.RemoveFile(JoinPath(out_dir, TempName(IndexFileName(job.options.format)))).IgnoreError();
}

Result<ConsolidateResult> Execute(Job& job, EngineContext& ctx, std::string_view source,
                                  std::string_view out_dir, const std::vector<Slab>& slabs,
                                  const std::vector<std::string>& stale) {
  SP_ASSIGN_OR_RETURN(job.sources, OpenDataFiles(ctx.store(), source, job.md,
                                                 FilesRead(slabs, job.plan, job.md)));
  Status status = CreateOutputs(job, ctx.store(), out_dir);
  if (status.ok()) status = RunSlabs(job, slabs);
  if (status.ok()) status = WriteTorchFraming(job, slabs);
  if (status.ok()) status = Commit(job, ctx.store(), out_dir);
  if (!status.ok()) {
    RemoveTemporaries(job, ctx.store(), out_dir);
    return status;
  }
  ConsolidateResult result;
  for (const OutputFile& f : job.plan.files) result.files.push_back(f.name);
  for (const std::string& name : stale) {
    if (std::find(result.files.begin(), result.files.end(), name) == result.files.end() &&
        name != job.plan.index_name) {
      ctx.store().RemoveFile(JoinPath(out_dir, name)).IgnoreError();
    }
  }
  result.index_file = job.plan.index_name;
  result.tensors = job.plan.tensors;
  result.total_bytes = job.plan.total_bytes;
  result.bytes_read = job.bytes_read.load();
  result.selection = job.plan.selection;
  if (job.options.progress) job.options.progress(job.plan.total_bytes, job.plan.total_bytes);
  return result;
}

}  // namespace

Result<ConsolidateResult> Consolidate(std::string_view source, std::string_view out_dir,
                                      const ConsolidateOptions& options) {
  if (options.memory_budget_bytes == 0) {
    return InvalidArgumentError("the memory budget must be positive");
  }
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(source, nullptr, options.store, options.pool,
                                          options.threads));
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, ReadCheckpointMetadata(source, &ctx->store()));
  if (!options.mapping.empty()) {
    Result<CheckpointMetadata> mapped = MapCheckpointMetadata(md, options.mapping);
    if (!mapped.ok()) {
      return mapped.status().WithContext("mapping the tensors of " + std::string(source));
    }
    md = *std::move(mapped);
  }
  SP_ASSIGN_OR_RETURN(ConsolidationPlan plan, PlanConsolidation(md, options));
  // Per thread: the slab, the read staging window, and a cast's packed and converted copies.
  const uint64_t threads = static_cast<uint64_t>(std::max(1, ctx->pool().size()));
  const uint64_t slab_bytes = std::max(kMinSlabBytes, options.memory_budget_bytes / (4 * threads));
  SP_ASSIGN_OR_RETURN(std::vector<Slab> slabs, PlanSlabs(plan, md, slab_bytes));
  std::vector<std::string> stale;
  bool created = false;
  SP_RETURN_IF_ERROR(
      PrepareOutputDirectory(ctx->store(), source, out_dir, options, &stale, &created));
  Job job(plan, md, ctx->pool(), options);
  job.window = slab_bytes;
  Result<ConsolidateResult> result = Execute(job, *ctx, source, out_dir, slabs, stale);
  if (!result.ok() && created) ctx->store().RemoveDir(out_dir).IgnoreError();  // when empty
  return result;
}

}  // namespace sp
