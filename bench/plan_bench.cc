// Planning benchmark: a global save plan for many ranks, each holding one box of every tensor.
//
// The tensors cycle through the layouts of a parallel job on a mesh of FSDP (ranks / 8) x tensor
// parallel (8) (1,024 ranks by default): row-sharded over all ranks, column-sharded over TP and
// replicated over FSDP, a 2-D grid (FSDP rows x TP columns), and fully replicated; one tensor
// in ten is cut irregularly instead (row bands split at a column that varies by band). Reports
// the median of 5 runs of PlanSave, of the native writer laying out the data files of that plan
// (names and every file's safetensors header, as consolidation and tools build them; a save's
// ranks build the headers of their own files instead, timed for one rank), of PlanLoad for one
// rank reading every tensor whole (the consolidation case: every stored chunk intersects the
// target), of PlanLoad for one rank loading its own boxes (with the grids the metadata carries,
// and without), and the size of the metadata with the time to encode and decode it (format 3,
// format 2, format 1, and the wire encoding a load sends its ranks for checkpoints of other
// formats; decoded on the pool, as a load does), the time from a native metadata file's bytes on
// a load's coordinator to its ranks' decoded metadata (as loads did it, through the wire encoding,
// and as they do now, each rank decoding the file), and of the commit's collection of the reports
// the ranks send once they have written (every chunk's checksums and every file's size;
// engine/write_reports.h), on the pool, on one thread, and as it was collected before.
//
// First, once and in a process of its own (so that its heap does not weigh on the timings after
// it), the coordinator's peak memory: the ranks' local plans arrive as the messages a save
// gathers (plan/plan_codec.h), and the coordinator decodes them, plans, names the files (the ranks
// build their headers), encodes every rank's reply and the committed metadata, as
// engine/save.cc does. Its peak resident set (VmHWM, reset after the messages are built) is
// printed with the bytes gathered.
// It is measured twice, each in a process of its own: with the messages as whole local plans
// (every rank's names, shapes and boxes; the baseline), and as the ruled plans a save sends
// (plan/ruled_plan.h: the tensors carry the mesh rules of the layouts above, so each rank sends a
// digest, the irregular tensors' boxes and its objects, and rank 0 the shared part).
//
// PlanSave runs on a pool of `--threads` threads, as a save's coordinator plans on its pool
// (default: the engine's default pool size, DefaultIoThreads()); `--threads 1` plans on the
// calling thread alone, as saves did before planning used the pool.
//
// `--coordinator-ruled --cached-commit apart` commits the ruled coordinator's plan as a save with
// a plan cache does (the cache holds the plan; the metadata is encoded from its chunks and a table
// of the checksums), and `--cached-commit copy` as such a save did before (through a copy of the
// plan with the checksums filled in); without it, as a save without a cache (filled into the
// plan's own chunks). With a cache it also prints what the cache keeps of the plan between saves
// and, with `apart`, the time a save from the cached plan takes to decode its chunks back from
// the committed file the cache keeps instead of them. The coordinator frees each rank's writes
// once that rank's reply holds them, as engine/save.cc does; `--keep-writes` keeps them (beside
// the replies, and in the cache's plan whole), as it did before.
//
// `--plan-save-only` times PlanSave alone (on every rank's whole plan, on the gathered table and
// on the ruled plans) and prints it in one line with the plan's chunks and their bytes, for
// bench/dcp_plan_bench.py, which plans the same layout with torch DCP's planner.
//
// `--open-only` times opening the committed metadata file alone: decoding it
// (`DecodeMetadata`), and as a load's rank takes it (`DecodeNativeCheckpointMetadata`: decoded,
// checked and indexed), and the latter for the same metadata in format 2 (tables at fixed width)
// beside it, with both sizes. With either of these two, `--runs N` sets how many times each
// figure is measured (medians; 5 by default): comparing two builds on a noisy machine wants more.
//
// `--load-coordinator-only` times what a load's coordinator does before its ranks can plan when
// each is sent its part: opening the committed file, then answering every other rank's boxes
// (`--runs N` as above).
//
// Usage: plan_bench [ranks] [tensors] [--coordinator-only |
//                   --coordinator-ruled [--cached-commit apart|copy] [--keep-writes] |
//                   --plan-save-only |
//                   --open-only | --load-coordinator-only] [--threads N] [--runs N]
//        (ranks must be a multiple of 128; the flags run one coordinator measurement alone)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <malloc.h>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "shardpoint/engine/load_internal.h"
#include "shardpoint/engine/save_messages.h"
#include "shardpoint/engine/write_reports.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/format/writer.h"
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/load_plan.h"
#include "shardpoint/plan/plan_codec.h"
#include "shardpoint/plan/ruled_plan.h"
#include "shardpoint/plan/save_plan.h"
#include "shardpoint/store/memory_store.h"

namespace {

using sp::Box;
using sp::Shape;

constexpr double kTargetSeconds = 0.2;

// [offset, size) of piece `index` of `parts` equal pieces of [0, length).
std::pair<int64_t, int64_t> Piece(int64_t length, int64_t parts, int64_t index) {
  const int64_t size = length / parts;
  return {size * index, size};
}

// The box rank `rank` holds of tensor number `t`: one tensor in ten is irregular (t % 10 == 9),
// the others take the layout chosen by t % 4.
Box LayoutBox(int t, int64_t rank, int64_t ranks, const Shape& shape) {
  const int64_t tp = 8, fsdp = ranks / 128 * 16;  // = ranks / tp: no data-parallel dim
  const int64_t tp_rank = rank % tp, fsdp_rank = (rank / tp) % fsdp;
  Box box = Box::Whole(shape);
  if (t % 10 == 9) {
    // Irregular: ranks 2k and 2k + 1 split the k-th band of 8 rows at a column that differs from
    // band to band, as flat optimizer shards cut rows (not a grid: the sweeps plan it).
    const int64_t band = rank / 2, cut = 256 + (band * 37 + t) % 512;
    box.offsets[0] = band * 8;
    box.sizes[0] = 8;
    box.offsets[1] = rank % 2 == 0 ? 0 : cut;
    box.sizes[1] = rank % 2 == 0 ? cut : shape[1] - cut;
    return box;
  }
  switch (t % 4) {
    case 0:  // row-sharded over all ranks
      std::tie(box.offsets[0], box.sizes[0]) = Piece(shape[0], ranks, rank);
      break;
    case 1:  // column-sharded over TP, replicated over FSDP and DP
      std::tie(box.offsets[1], box.sizes[1]) = Piece(shape[1], tp, tp_rank);
      break;
    case 2:  // FSDP rows x TP columns, replicated over DP
      std::tie(box.offsets[0], box.sizes[0]) = Piece(shape[0], fsdp, fsdp_rank);
      std::tie(box.offsets[1], box.sizes[1]) = Piece(shape[1], tp, tp_rank);
      break;
    default:  // replicated everywhere
      break;
  }
  return box;
}

// The same layouts as device-mesh rules on the (dp, fsdp, tp) mesh, whose row-major positions are
// the ranks (SaveTensor::layout); nullopt for the irregular tensors.
std::optional<sp::MeshLayout> LayoutRule(int t, int64_t ranks) {
  if (t % 10 == 9) return std::nullopt;
  using sp::Placement;
  const Placement r = Placement::Replicate(), rows = Placement::Shard(0),
                  cols = Placement::Shard(1);
  const int64_t tp = 8, fsdp = ranks / 128 * 16;  // as LayoutBox
  const Shape mesh = {ranks / (tp * fsdp), fsdp, tp};
  switch (t % 4) {
    case 0: return sp::MeshLayout{mesh, {rows, rows, rows}, {}};
    case 1: return sp::MeshLayout{mesh, {r, r, cols}, {}};
    case 2: return sp::MeshLayout{mesh, {r, rows, cols}, {}};
    default: return sp::MeshLayout{mesh, {r, r, r}, {}};
  }
}

// Rank `rank`'s plan; with `rules`, its tensors carry their layout rules (checked against the
// boxes, as a save checks them).
sp::LocalSavePlan MakeLocal(int64_t rank, int64_t ranks, int tensors, bool rules = false) {
  sp::LocalSavePlan local;
  local.tensors.reserve(tensors);
  for (int t = 0; t < tensors; ++t) {
    const Shape shape = {ranks * 4, 1024};
    local.tensors.push_back(
        sp::LocalTensor{"model.layers." + std::to_string(t / 8) + ".w" + std::to_string(t % 8),
                        sp::DType::kBFloat16,
                        shape,
                        {LayoutBox(t, rank, ranks, shape)}});
    if (rules) {
      local.tensors.back().layout = LayoutRule(t, ranks);
      if (sp::Status s = sp::CheckRuledBoxes(rank, &local.tensors.back()); !s.ok()) {
        std::fprintf(stderr, "layout rule of tensor %d: %s\n", t, s.ToString().c_str());
        std::abort();
      }
    }
  }
  return local;
}

std::vector<sp::LocalSavePlan> MakeLocals(int64_t ranks, int tensors) {
  std::vector<sp::LocalSavePlan> locals(ranks);
  for (int64_t r = 0; r < ranks; ++r) locals[r] = MakeLocal(r, ranks, tensors);
  return locals;
}

// A field of /proc/self/status in MiB ("VmHWM", "VmRSS"), or -1.
double StatusMiB(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(status, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') {
      return std::atof(line.c_str() + n + 1) / 1024.0;  // the kernel prints kB
    }
  }
  return -1;
}

// An FNV-1a digest of every stored chunk's box: the tensors in name order, each name's bytes and
// then its chunks in (offsets, sizes) order, each value 8 bytes little-endian.
// bench/dcp_plan_bench.py computes the same over DCP's metadata of the layout.
uint64_t ChunkDigest(const sp::CheckpointMetadata& metadata) {
  uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](uint8_t byte) { h = (h ^ byte) * 1099511628211ull; };
  std::vector<const sp::TensorMetadata*> tensors;
  for (const sp::TensorMetadata& t : metadata.tensors) tensors.push_back(&t);
  std::sort(tensors.begin(), tensors.end(),
            [](const auto* a, const auto* b) { return a->name < b->name; });
  for (const sp::TensorMetadata* t : tensors) {
    for (char c : t->name) mix(static_cast<uint8_t>(c));
    std::vector<std::vector<int64_t>> boxes;
    for (const sp::StoredChunk& c : t->chunks) {
      std::vector<int64_t>& key = boxes.emplace_back(c.box.offsets.begin(), c.box.offsets.end());
      key.insert(key.end(), c.box.sizes.begin(), c.box.sizes.end());
    }
    std::sort(boxes.begin(), boxes.end());
    for (const std::vector<int64_t>& key : boxes) {
      for (int64_t v : key) {
        for (int i = 0; i < 8; ++i) mix(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
      }
    }
  }
  return h;
}

// One checksum per block of every chunk, as a commit fills them in (values do not matter here).
void FillCommittedChecksums(uint64_t block_bytes, std::vector<sp::TensorMetadata>* tensors) {
  for (sp::TensorMetadata& t : *tensors) {
    for (sp::StoredChunk& c : t.chunks) {
      c.block_crc32c.assign(sp::ChecksumBlockCount(c.byte_length, block_bytes), 0x12345678u);
    }
  }
}

// Decodes ruled messages (plan/ruled_plan.h) into `plans` as a save's coordinator does.
bool DecodeRuled(const std::vector<std::string>& gathered, sp::GatheredPlans* plans) {
  sp::SharedPlans shared(gathered.size());
  std::vector<sp::SharedPlans::Message> opened(gathered.size());
  for (size_t r = 0; r < gathered.size(); ++r) {
    sp::Result<sp::SharedPlans::Message> message = sp::SharedPlans::Open(gathered[r]);
    sp::Status s = message.ok() ? shared.Add(*message) : message.status();
    if (!s.ok()) {
      std::fprintf(stderr, "ruled plan of rank %zu: %s\n", r, s.ToString().c_str());
      return false;
    }
    opened[r] = *message;
  }
  for (size_t r = 0; r < gathered.size(); ++r) {
    if (sp::Status s = shared.Expand(opened[r], static_cast<uint32_t>(r), plans); !s.ok()) {
      std::fprintf(stderr, "Expand failed: %s\n", s.ToString().c_str());
      return false;
    }
  }
  return true;
}

// The checksums the ranks report for `tensors` (one value per block of `block_bytes`; the values
// do not matter here), in the table a commit collects them into (engine/write_reports.h).
sp::ChunkChecksums ReportedChecksums(const std::vector<sp::TensorMetadata>& tensors,
                                     uint64_t block_bytes) {
  sp::ChunkChecksums checksums = sp::LayOutChunkChecksums(tensors, block_bytes).value();
  for (sp::ChunkChecksums::Tensor& table : checksums.tensors) {
    std::fill(table.crcs.begin(), table.crcs.end(), 0x12345678u);
  }
  return checksums;
}

// How a commit collected the ranks' write reports before it walked them in place on its pool
// (engine/write_reports.h): each report decoded into a WriteReport (a vector per chunk), each
// chunk's checksum count checked against the chunk itself, the checksums copied into the table,
// rank after rank on one thread. The same checks, with shorter messages.
sp::Status CollectReportsAsBefore(const std::vector<std::string>& reports,
                                  const std::vector<sp::TensorMetadata>& tensors,
                                  sp::CheckpointMetadata* metadata,
                                  sp::ChunkChecksums* checksums) {
  const uint64_t block_bytes = metadata->checksum_block_bytes;
  SP_ASSIGN_OR_RETURN(*checksums, sp::LayOutChunkChecksums(tensors, block_bytes));
  std::vector<bool> file_reported(metadata->files.size(), false);
  std::vector<std::vector<bool>> reported(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) reported[t].resize(tensors[t].chunks.size());
  for (size_t r = 0; r < reports.size(); ++r) {
    SP_ASSIGN_OR_RETURN(sp::WriteReport report, sp::DecodeWriteReport(reports[r]));
    for (sp::ChunkReport& c : report.chunks) {
      if (c.tensor >= tensors.size() || c.chunk >= tensors[c.tensor].chunks.size()) {
        return sp::InternalError("an unknown chunk");
      }
      const sp::StoredChunk& chunk = tensors[c.tensor].chunks[c.chunk];
      if (c.block_crc32c.size() != sp::ChecksumBlockCount(chunk.byte_length, block_bytes)) {
        return sp::InternalError("a wrong count of checksums");
      }
      reported[c.tensor][c.chunk] = true;
      std::copy(c.block_crc32c.begin(), c.block_crc32c.end(),
                checksums->tensors[c.tensor].crcs.begin() +
                    checksums->tensors[c.tensor].start(c.chunk));
    }
    for (const sp::FileReport& f : report.files) {
      sp::DataFile& file = metadata->files.at(f.index);
      if (file.writer_rank != static_cast<int32_t>(r) || file_reported[f.index]) {
        return sp::InternalError("a file reported by another rank or twice");
      }
      file_reported[f.index] = true;
      file.data_start = f.data_start;
      file.size = f.size;
    }
  }
  for (bool f : file_reported) {
    if (!f) return sp::InternalError("a file unreported");
  }
  for (const std::vector<bool>& chunks : reported) {
    for (bool c : chunks) {
      if (!c) return sp::InternalError("a chunk unreported");
    }
  }
  return sp::OkStatus();
}

// How a commit of a save with a plan cache built its metadata before the checksums were kept
// apart: `summary` with a copy of `tensors` (tensor by tensor on `pool`), the checksums filled
// into the copy.
sp::Result<sp::CheckpointMetadata> CopiedWithChecksums(
    const sp::CheckpointMetadata& summary, const std::vector<sp::TensorMetadata>& tensors,
    sp::ThreadPool* pool) {
  sp::CheckpointMetadata md = summary;
  md.tensors.resize(tensors.size());
  SP_RETURN_IF_ERROR(sp::ParallelFor(pool, static_cast<int64_t>(tensors.size()), [&](int64_t t) {
    md.tensors[t] = tensors[t];
    return sp::OkStatus();
  }));
  SP_RETURN_IF_ERROR(
      sp::FillChecksums(ReportedChecksums(tensors, summary.checksum_block_bytes), &md.tensors));
  return md;
}

// How the coordinator measurement commits: as a save without a plan cache (the checksums filled
// into the plan's own chunks), or as one with a cache, which holds the plan: from the plan's
// chunks and a table of the checksums (as engine/save.cc does), or through a copy of the plan
// (as it did before).
enum class Commit { kInPlace, kApart, kCopied };

// The coordinator of a save of this layout, from the gathered messages to the encoded replies
// and metadata; prints its peak resident set. With `ruled`, the messages are ruled plans
// (plan/ruled_plan.h) as a save sends them: every rank's digest and own part, the shared part
// from rank 0 alone; otherwise every rank's whole local plan (as saves sent them before).
// Returns false on a failure (printed).
bool MeasureCoordinator(int64_t ranks, int tensors, bool ruled, Commit commit, bool keep_writes,
                        bool chunk_cells, sp::ThreadPool* pool) {
  std::vector<std::string> gathered(ranks);
  size_t gathered_bytes = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    const sp::LocalSavePlan local = MakeLocal(r, ranks, tensors, ruled);
    gathered[r] = ruled ? sp::EncodeRuledLocalPlan(local, sp::SendsSharedPart(local, r, 0))
                        : sp::EncodeLocalSavePlan(local);
    gathered_bytes += gathered[r].size();
  }
  const double before = StatusMiB("VmRSS");
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // resets VmHWM to the current resident set
  }
  const auto start = std::chrono::steady_clock::now();
  size_t reply_bytes = 0, metadata_bytes = 0;
  size_t held_chunk_bytes = 0, held_write_bytes = 0;  // what a cache keeps of the plan
  std::string committed;  // the metadata file, which a cache keeps instead of the chunks
  double decoded_s = 0, planned_s = 0;
  {
    sp::GatheredPlans plans(gathered.size());
    if (ruled) {
      if (!DecodeRuled(gathered, &plans)) return false;
    } else {
      for (const std::string& message : gathered) {
        if (sp::Status s = sp::DecodeLocalSavePlanInto(message, &plans); !s.ok()) {
          std::fprintf(stderr, "DecodeLocalSavePlanInto failed: %s\n", s.ToString().c_str());
          return false;
        }
      }
    }
    decoded_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    gathered = {};  // as engine/save.cc releases the ranks' messages once they are in the table
    sp::SavePlanOptions options;
    options.save_id = "bench";
    options.pool = pool;
    options.chunk_cells = chunk_cells;  // as a native save plans (engine/save.cc)
    options.defer_writes = chunk_cells;
    sp::Result<sp::GlobalSavePlan> plan = sp::PlanSave(plans, options);
    if (!plan.ok()) {
      std::fprintf(stderr, "PlanSave failed: %s\n", plan.status().ToString().c_str());
      return false;
    }
    planned_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() -
                decoded_s;
    plans = {};
    sp::MemoryStore store;
    std::unique_ptr<sp::CheckpointWriter> writer =
        sp::MakeCheckpointWriter(sp::CheckpointFormat::kNative, false).value();
    // As a save: the ranks build their files' headers and report where each file's data starts
    // (CheckpointWriter::ranks_build_headers), so the coordinator only names the files.
    if (!writer->NameFiles(store, "/bench", &plan->metadata).ok()) return false;
    std::vector<uint64_t> data_bytes(plan->metadata.files.size(), 0);
    std::vector<uint64_t> lengths;
    for (const sp::TensorMetadata& t : plan->metadata.tensors) {
      sp::ChunkByteLengths(t, &lengths);
      for (size_t c = 0; c < lengths.size(); ++c) data_bytes[sp::ChunkFile(t, c)] += lengths[c];
    }
    for (size_t f = 0; f < data_bytes.size(); ++f) {  // as the reports set them
      plan->metadata.files[f].data_start = 4096;
      plan->metadata.files[f].size = 4096 + data_bytes[f];
    }
    // The replies, rank by rank on the pool as engine/save.cc encodes them, held until they are
    // scattered. Each rank's writes are freed once its reply holds them (as engine/save.cc does;
    // with --keep-writes, as it did before: kept beside the replies, and by a cache).
    // Writes the plan defers are built a round of ranks at a time, as engine/save.cc does.
    std::vector<std::string> replies(plan->ranks.size());
    const uint32_t world = static_cast<uint32_t>(plan->ranks.size());
    for (uint32_t first = 0; first < world;) {
      const uint32_t end = sp::DeferredRoundEnd(*plan, first, uint64_t{1} << 20);
      if (!sp::TakeDeferredWrites(&*plan, first, end, pool).ok()) return false;
      (void)sp::ParallelFor(pool, end - first, [&](int64_t i) {
        replies[first + i] = sp::EncodeRankSavePlan(plan->ranks[first + i]);
        if (!keep_writes) std::vector<sp::ChunkWrite>().swap(plan->ranks[first + i].writes);
        return sp::OkStatus();
      });
      first = end;
    }
    sp::DropDeferredWrites(&*plan);
    for (const std::string& reply : replies) reply_bytes += reply.size();
    replies = {};
    malloc_trim(0);  // as engine/save.cc does once the replies are scattered (ReturnFreedHeap)
    const uint64_t block_bytes = plan->metadata.checksum_block_bytes;
    if (commit == Commit::kInPlace && chunk_cells) {
      // As engine/save.cc commits a plan holding grid cells: the checksums in a table apart.
      metadata_bytes = sp::EncodeMetadata(sp::WithoutTensors(plan->metadata),
                                          plan->metadata.tensors,
                                          ReportedChecksums(plan->metadata.tensors, block_bytes))
                           .size();
    } else if (commit == Commit::kInPlace) {
      FillCommittedChecksums(block_bytes, &plan->metadata.tensors);
      metadata_bytes = sp::EncodeMetadata(plan->metadata).size();
    } else {
      // Everything but the tensors, which stay the plan's (as the cache holds it).
      const sp::CheckpointMetadata summary = sp::WithoutTensors(plan->metadata);
      if (commit == Commit::kApart) {
        committed = sp::EncodeMetadata(summary, plan->metadata.tensors,
                                       ReportedChecksums(plan->metadata.tensors, block_bytes));
        metadata_bytes = committed.size();
      } else {
        sp::Result<sp::CheckpointMetadata> md =
            CopiedWithChecksums(summary, plan->metadata.tensors, pool);
        if (!md.ok()) return false;
        metadata_bytes = sp::EncodeMetadata(*md).size();
      }
      held_chunk_bytes = sp::ChunkListBytes(plan->metadata.tensors);
      for (const sp::RankSavePlan& r : plan->ranks) {
        held_write_bytes += r.writes.capacity() * sizeof(sp::ChunkWrite);
      }
      if (keep_writes) committed = {};  // as before: the cache kept the plan whole
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double peak = StatusMiB("VmHWM");
  if (ruled) {
    std::printf("  coordinator, ruled plans (layout rules; a digest from each rank, the shared "
                "part from rank 0)%s%s:\n",
                chunk_cells ? ""
                            : ", a StoredChunk per chunk and every rank's writes at once (before)",
                commit == Commit::kApart    ? ", committed as with a plan cache"
                : commit == Commit::kCopied ? ", committed as with a plan cache through a copy of "
                                              "the plan (as before)"
                                            : "");
  } else {
    std::printf("plan_bench: ranks=%lld tensors=%d\n  coordinator, whole plans (every rank's "
                "names, shapes and boxes; the baseline):\n",
                static_cast<long long>(ranks), tensors);
  }
  std::printf(
      "    peak RSS %.0f MiB (%.0f MiB before decoding, holding the %.1f MiB of gathered plans), "
      "%.2f s from the gathered messages to %.1f MiB of replies and %.1f MiB of metadata, of "
      "which %.2f s to decode them into the plans' table and %.2f s to plan (PlanSave)\n",
      peak, before, static_cast<double>(gathered_bytes) / (1 << 20), seconds,
      static_cast<double>(reply_bytes) / (1 << 20), static_cast<double>(metadata_bytes) / (1 << 20),
      decoded_s, planned_s);
  if (!committed.empty()) {
    // As the cache keeps it (engine/save.cc): the committed file instead of the plan's chunks,
    // which the next save from the plan decodes back on a thread of its own (no pool) while the
    // ranks write.
    const auto restore_start = std::chrono::steady_clock::now();
    const double restore_rss = StatusMiB("VmRSS");
    {
      std::ofstream clear("/proc/self/clear_refs");
      clear << "5";
    }
    // As cells where the plan held them (engine/save.cc, RestoreChunks).
    sp::Result<sp::CheckpointMetadata> restored =
        sp::DecodeMetadata(committed, "/bench", nullptr, nullptr, chunk_cells);
    if (!restored.ok()) {
      std::fprintf(stderr, "DecodeMetadata failed: %s\n", restored.status().ToString().c_str());
      return false;
    }
    const double restore_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - restore_start).count();
    std::printf("    between saves the cache holds the committed metadata file, %.1f MiB, instead "
                "of the plan's %.1f MiB of chunk lists (and none of the ranks' writes); a save "
                "from the plan decodes the chunks back (%.1f MiB) in %.2f s on one thread, while "
                "the ranks write, raising the resident set by at most %.0f MiB\n",
                static_cast<double>(committed.size()) / (1 << 20),
                static_cast<double>(held_chunk_bytes) / (1 << 20),
                static_cast<double>(sp::ChunkListBytes(restored->tensors)) / (1 << 20), restore_s,
                StatusMiB("VmHWM") - restore_rss);
  } else if (commit != Commit::kInPlace) {
    std::printf("    between saves the cache holds the plan: %.1f MiB of chunk lists and %.1f MiB "
                "of the ranks' writes%s\n",
                static_cast<double>(held_chunk_bytes) / (1 << 20),
                static_cast<double>(held_write_bytes) / (1 << 20),
                keep_writes ? " (--keep-writes)" : "");
  }
  std::fflush(stdout);
  return true;
}

// Runs the coordinator's measurement in a child process (so that its heap neither counts in the
// other's peak nor weighs on the timings after it). Returns false when it failed.
bool MeasureCoordinatorApart(const char* self, int64_t ranks, int tensors, bool ruled,
                             bool chunk_cells, int threads) {
  std::fflush(stdout);
  const std::string ranks_arg = std::to_string(ranks), tensors_arg = std::to_string(tensors);
  const std::string threads_arg = std::to_string(threads);
  const pid_t child = fork();
  if (child == 0) {
    execl("/proc/self/exe", self, ranks_arg.c_str(), tensors_arg.c_str(),
          ruled ? "--coordinator-ruled" : "--coordinator-only", "--threads", threads_arg.c_str(),
          chunk_cells ? static_cast<char*>(nullptr) : "--chunk-lists",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int child_status = 0;
  return child > 0 && waitpid(child, &child_status, 0) == child && WIFEXITED(child_status) &&
         WEXITSTATUS(child_status) == 0;
}

struct Timing {
  double wall_s;        // median wall-clock seconds
  double cpu_s;         // median process CPU seconds (steadier on a busy machine)
  double first_wall_s;  // the first run's wall-clock seconds (into memory not yet reused)
};

// How many times Median measures (--runs).
int g_runs = 5;

// Runs `fn` g_runs times; the value it returns is destroyed outside the timed region.
template <typename Fn>
Timing Median(Fn&& fn) {
  std::vector<double> wall, cpu;
  for (int i = 0; i < g_runs; ++i) {
    const std::clock_t cpu_start = std::clock();
    const auto start = std::chrono::steady_clock::now();
    auto result = fn();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    cpu.push_back(static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC);
    if (!result.ok()) std::abort();
  }
  const double first = wall[0];
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return Timing{wall[wall.size() / 2], cpu[cpu.size() / 2], first};
}

// The plan's metadata as a save commits it: its files laid out, a checksum per block.
bool Committed(sp::CheckpointMetadata* metadata) {
  sp::MemoryStore store;
  std::unique_ptr<sp::CheckpointWriter> writer =
      sp::MakeCheckpointWriter(sp::CheckpointFormat::kNative, false).value();
  metadata->save_id = "0123456789ab";
  if (sp::Status s = writer->LayOutFiles(store, "/bench", metadata).status(); !s.ok()) {
    std::fprintf(stderr, "LayOutFiles failed: %s\n", s.ToString().c_str());
    return false;
  }
  FillCommittedChecksums(metadata->checksum_block_bytes, &metadata->tensors);
  return true;
}

// Where the bytes of the encoded metadata (`total` bytes, of version `major`) go: the block
// checksums (none from version 4: they are in the data files' headers); the records of grid
// tensors without them (cut points and the runs of their cells' files and offsets) and the runs
// they hold; the records of listed tensors without them; and the rest (header, summary with the
// files, indexes). A tensor's record is measured as the growth of a file holding only it.
void PrintMetadataBytes(const sp::CheckpointMetadata& metadata, uint64_t total, uint32_t major) {
  uint64_t checksum_bytes = 0, grid_bytes = 0, list_bytes = 0, grids = 0, runs = 0, chunks = 0,
           listed_chunks = 0;
  sp::CheckpointMetadata one = metadata;
  one.tensors.clear();
  one.objects.clear();
  const uint64_t base = sp::EncodeMetadata(one, major).size();
  for (const sp::TensorMetadata& tensor : metadata.tensors) {
    uint64_t crcs = 0;
    if (major < 4) {
      for (const sp::StoredChunk& chunk : tensor.chunks) crcs += 4 * chunk.block_crc32c.size();
    }
    one.tensors.assign(1, tensor);
    const uint64_t record = sp::EncodeMetadata(one, major).size() - base - crcs;
    checksum_bytes += crcs;
    chunks += tensor.chunks.size();
    if (!sp::FindChunkGrid(tensor.chunks, tensor.shape)) {
      list_bytes += record;
      listed_chunks += tensor.chunks.size();
      continue;
    }
    ++grids;
    grid_bytes += record;
    int64_t last_file = -1, last_offset = -1;
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      const int64_t file = c == 0 ? 0 : tensor.chunks[c].file - tensor.chunks[c - 1].file;
      const int64_t offset = static_cast<int64_t>(
          tensor.chunks[c].data_offset - (c == 0 ? 0 : tensor.chunks[c - 1].data_offset));
      if (c == 0 || file != last_file || offset != last_offset) ++runs;
      last_file = file;
      last_offset = offset;
    }
  }
  const double mib = 1 << 20;
  std::printf("metadata_bytes version=%u total_mib=%.1f chunks=%llu checksums_mib=%.1f "
              "grids=%llu grid_records_mib=%.1f grid_runs=%llu listed=%zu listed_chunks=%llu "
              "listed_records_mib=%.1f rest_mib=%.1f\n",
              major, total / mib, static_cast<unsigned long long>(chunks), checksum_bytes / mib,
              static_cast<unsigned long long>(grids), grid_bytes / mib,
              static_cast<unsigned long long>(runs), metadata.tensors.size() - grids,
              static_cast<unsigned long long>(listed_chunks), list_bytes / mib,
              (total - checksum_bytes - grid_bytes - list_bytes) / mib);
}

// --open-only: the plan's metadata committed, encoded as the native file (format 4, and formats
// 3.1, which holds the checksums in the records as well, and 2, at fixed width, as the
// baselines), and the times to open it.
bool MeasureOpen(sp::CheckpointMetadata metadata, sp::ThreadPool* pool) {
  if (!Committed(&metadata)) return false;
  const std::string native = sp::EncodeMetadata(metadata);
  const std::string native_v31 = sp::EncodeMetadata(metadata, 3);  // the checksums in records
  const std::string native_v2 = sp::EncodeMetadata(metadata, 2);   // fixed width
  PrintMetadataBytes(metadata, native.size(), sp::kNativeFormatMajor);
  PrintMetadataBytes(metadata, native_v31.size(), 3);
  metadata = {};
  if (sp::Result<sp::CheckpointMetadata> decoded =
          sp::DecodeNativeCheckpointMetadata(native, "/bench", pool);
      !decoded.ok()) {
    std::fprintf(stderr, "DecodeNativeCheckpointMetadata failed: %s\n",
                 decoded.status().ToString().c_str());
    return false;
  }
  const Timing decode =
      Median([&] { return sp::DecodeMetadata(native, "/bench/.metadata", pool); });
  const Timing open =
      Median([&] { return sp::DecodeNativeCheckpointMetadata(native, "/bench", pool); });
  const Timing open_v31 =
      Median([&] { return sp::DecodeNativeCheckpointMetadata(native_v31, "/bench", pool); });
  const Timing open_v2 =
      Median([&] { return sp::DecodeNativeCheckpointMetadata(native_v2, "/bench", pool); });
  std::printf("open metadata_mib=%.1f runs=%d decode_s=%.6f open_s=%.6f "
              "format31_mib=%.1f format31_open_s=%.6f format2_mib=%.1f format2_open_s=%.6f\n",
              static_cast<double>(native.size()) / (1 << 20), g_runs, decode.wall_s, open.wall_s,
              static_cast<double>(native_v31.size()) / (1 << 20), open_v31.wall_s,
              static_cast<double>(native_v2.size()) / (1 << 20), open_v2.wall_s);
  return true;
}

// --load-coordinator-only: what the coordinator of a load does before any rank can plan when each
// rank is sent its part (engine/load.cc, MetadataPartsOfLoad): it opens the committed native file
// (decoded, checked and indexed), then answers every rank but rank 0, in rounds of 512, from the
// boxes it saved with. Times both, and prints the bytes asked for and answered: for the file of
// format 4, then (the baseline) for the same metadata as format 3.1, whose parts carry the chunks'
// checksums.
bool MeasureLoadCoordinator(sp::CheckpointMetadata metadata, int64_t ranks, int tensors,
                            sp::ThreadPool* pool) {
  if (!Committed(&metadata)) return false;
  const std::string native = sp::EncodeMetadata(metadata);
  const std::string native_v31 = sp::EncodeMetadata(metadata, 3);
  metadata = {};
  std::vector<std::string> requests(static_cast<size_t>(ranks));
  uint64_t request_bytes = 0;
  for (int64_t r = 1; r < ranks; ++r) {
    sp::ChunkFilter boxes;
    sp::LocalSavePlan local = MakeLocal(r, ranks, tensors);
    for (sp::LocalTensor& t : local.tensors) boxes[t.name] = std::move(t.boxes);
    requests[r] = sp::MetadataRequest(&boxes);
    request_bytes += requests[r].size();
  }
  for (const std::string* file : {&native, &native_v31}) {
    const Timing open =
        Median([&] { return sp::DecodeNativeCheckpointMetadata(*file, "/bench", pool); });
    const sp::Result<sp::CheckpointMetadata> opened =
        sp::DecodeNativeCheckpointMetadata(*file, "/bench", pool);
    if (!opened.ok()) {
      std::fprintf(stderr, "DecodeNativeCheckpointMetadata failed: %s\n",
                   opened.status().ToString().c_str());
      return false;
    }
    uint64_t answer_bytes = 0;
    const Timing answers = Median([&]() -> sp::Result<size_t> {
      const sp::MetadataPartEncoder encoder(*opened, pool);
      std::string whole;
      answer_bytes = 0;
      for (int64_t first = 0; first < ranks; first += 512) {
        const int64_t end = std::min<int64_t>(ranks, first + 512);
        std::vector<std::string> out(static_cast<size_t>(end - first));
        SP_RETURN_IF_ERROR(sp::AnswerMetadataRequests(
            encoder, std::span<const std::string>(requests).subspan(first, end - first),
            static_cast<int>(first), std::string(17, 'n'), 0, &whole, out, pool));
        for (const std::string& answer : out) answer_bytes += answer.size();
      }
      return size_t{0};
    });
    std::printf("load_coordinator format=%u.%u ranks=%lld tensors=%d runs=%d metadata_mib=%.1f "
                "open_s=%.6f requests_mib=%.1f answers_s=%.6f answers_cpu_s=%.6f "
                "answers_mib=%.1f\n",
                opened->version_major, opened->version_minor, static_cast<long long>(ranks),
                tensors, g_runs, static_cast<double>(file->size()) / (1 << 20), open.wall_s,
                static_cast<double>(request_bytes) / (1 << 20), answers.wall_s, answers.cpu_s,
                static_cast<double>(answer_bytes) / (1 << 20));
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool coordinator_only = false, coordinator_ruled = false, plan_save_only = false;
  bool open_only = false, load_coordinator_only = false;
  bool runs_given = false, usage = false, keep_writes = false;
  bool chunk_cells = true;
  Commit commit = Commit::kInPlace;
  int threads = sp::DefaultIoThreads();
  std::vector<const char*> positional;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--coordinator-only") == 0) {
      coordinator_only = true;
    } else if (std::strcmp(argv[i], "--coordinator-ruled") == 0) {
      coordinator_ruled = true;
    } else if (std::strcmp(argv[i], "--plan-save-only") == 0) {
      plan_save_only = true;
    } else if (std::strcmp(argv[i], "--open-only") == 0) {
      open_only = true;
    } else if (std::strcmp(argv[i], "--load-coordinator-only") == 0) {
      load_coordinator_only = true;
    } else if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc) {
      g_runs = std::atoi(argv[++i]);
      runs_given = true;
      usage = usage || g_runs < 1;
    } else if (std::strcmp(argv[i], "--cached-commit") == 0 && i + 1 < argc) {
      ++i;
      commit = std::strcmp(argv[i], "apart") == 0  ? Commit::kApart
               : std::strcmp(argv[i], "copy") == 0 ? Commit::kCopied
                                                   : Commit::kInPlace;
      usage = usage || commit == Commit::kInPlace;
    } else if (std::strcmp(argv[i], "--keep-writes") == 0) {
      keep_writes = true;
    } else if (std::strcmp(argv[i], "--chunk-lists") == 0) {
      chunk_cells = false;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
      usage = usage || threads < 1;
    } else if (argv[i][0] == '-') {
      usage = true;
    } else {
      positional.push_back(argv[i]);
    }
  }
  const int64_t ranks = positional.size() > 0 ? std::atoll(positional[0]) : 1024;
  const int tensors = positional.size() > 1 ? std::atoi(positional[1]) : 500;
  if (usage || positional.size() > 2 || ranks < 128 || ranks % 128 != 0 || tensors < 1 ||
      coordinator_only + coordinator_ruled + plan_save_only + open_only +
              load_coordinator_only >
          1 ||
      (runs_given && !plan_save_only && !open_only && !load_coordinator_only) ||
      ((commit != Commit::kInPlace || keep_writes) && !coordinator_ruled) ||
      (!chunk_cells && !coordinator_ruled && !coordinator_only)) {
    std::fprintf(stderr,
                 "usage: plan_bench [ranks: multiple of 128] [tensors >= 1] "
                 "[--coordinator-only | --coordinator-ruled [--cached-commit apart|copy] "
                 "[--keep-writes] [--chunk-lists] | "
                 "--plan-save-only | --open-only | --load-coordinator-only] [--threads N >= 1] "
                 "[--runs N >= 1]\n");
    return 2;
  }
  // A pool of one thread plans as without one: on the calling thread.
  std::unique_ptr<sp::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<sp::ThreadPool>(threads);
  if (coordinator_ruled) {
    return MeasureCoordinator(ranks, tensors, true, commit, keep_writes, chunk_cells, pool.get())
               ? 0
               : 1;
  }
  if (coordinator_only) {
    return MeasureCoordinator(ranks, tensors, false, Commit::kInPlace, false, chunk_cells,
                              pool.get())
               ? 0
               : 1;
  }
  if (!plan_save_only && !open_only && !load_coordinator_only) {
    std::printf("plan_bench: PlanSave on %d thread(s)\n", threads);
    // The whole plans, then the ruled ones as a save plans them (grid tensors held as cells), then
    // the ruled ones with a StoredChunk per chunk and all writes at once (before; the baseline).
    const std::pair<bool, bool> runs[] = {{false, true}, {true, true}, {true, false}};
    for (const auto& [ruled, cells] : runs) {
      if (!MeasureCoordinatorApart(argv[0], ranks, tensors, ruled, cells, threads)) {
        std::fprintf(stderr, "the coordinator's measurement failed\n");
        return 1;
      }
    }
  }
  const std::vector<sp::LocalSavePlan> locals = MakeLocals(ranks, tensors);
  sp::SavePlanOptions options;
  options.save_id = "bench";
  options.pool = pool.get();
  sp::Result<sp::GlobalSavePlan> plan = sp::PlanSave(locals, options);
  if (!plan.ok()) {
    std::fprintf(stderr, "PlanSave failed: %s\n", plan.status().ToString().c_str());
    return 1;
  }
  size_t chunks = 0;
  uint64_t chunk_bytes = 0;
  for (const auto& t : plan->metadata.tensors) {
    chunks += t.chunks.size();
    for (const sp::StoredChunk& c : t.chunks) chunk_bytes += c.byte_length;
  }
  if (open_only) return MeasureOpen(plan->metadata, pool.get()) ? 0 : 1;
  if (load_coordinator_only) {
    return MeasureLoadCoordinator(plan->metadata, ranks, tensors, pool.get()) ? 0 : 1;
  }
  const Timing save = Median([&] { return sp::PlanSave(locals, options); });
  // The coordinator plans on the ranks' messages decoded into one table (plan/gathered_plans.h).
  sp::GatheredPlans gathered_plans(locals.size());
  for (const sp::LocalSavePlan& local : locals) gathered_plans.AddRank(local);
  const Timing save_gathered = Median([&] { return sp::PlanSave(gathered_plans, options); });
  gathered_plans = {};
  // And on the ruled plans a save sends (its layouts' rules, the irregular tenth as boxes).
  Timing save_ruled, save_ruled_cells;
  {
    std::vector<std::string> messages(ranks);
    for (int64_t r = 0; r < ranks; ++r) {
      const sp::LocalSavePlan local = MakeLocal(r, ranks, tensors, true);
      messages[r] = sp::EncodeRuledLocalPlan(local, sp::SendsSharedPart(local, r, 0));
    }
    sp::GatheredPlans ruled_plans(messages.size());
    if (!DecodeRuled(messages, &ruled_plans)) return 1;
    save_ruled = Median([&] { return sp::PlanSave(ruled_plans, options); });
    sp::SavePlanOptions as_cells = options;
    as_cells.chunk_cells = true;
    as_cells.defer_writes = true;
    save_ruled_cells = Median([&] { return sp::PlanSave(ruled_plans, as_cells); });
  }
  if (plan_save_only) {
    // One line for bench/dcp_plan_bench.py, which plans the same layout with torch DCP's planner
    // and checks that both find the same chunks.
    std::printf("plan_save ranks=%lld tensors=%d threads=%d chunks=%zu chunk_bytes=%llu "
                "digest=%llu whole_s=%.6f gathered_s=%.6f ruled_s=%.6f ruled_cells_s=%.6f\n",
                static_cast<long long>(ranks), tensors, threads, chunks,
                static_cast<unsigned long long>(chunk_bytes),
                static_cast<unsigned long long>(ChunkDigest(plan->metadata)), save.wall_s,
                save_gathered.wall_s, save_ruled.wall_s, save_ruled_cells.wall_s);
    return 0;
  }

  sp::MemoryStore store;
  std::unique_ptr<sp::CheckpointWriter> writer =
      sp::MakeCheckpointWriter(sp::CheckpointFormat::kNative, false).value();
  const Timing layout = Median([&] {
    sp::CheckpointMetadata md = plan->metadata;
    return writer->LayOutFiles(store, "/bench", &md);
  });
  // What a rank of a save does instead: the headers of its own files, from its own chunks.
  const uint32_t header_rank = static_cast<uint32_t>(ranks / 2 + 3);
  const Timing rank_headers = Median([&]() -> sp::Result<size_t> {
    size_t bytes = 0;
    for (uint32_t f = 0; f < plan->metadata.files.size(); ++f) {
      if (plan->metadata.files[f].writer_rank != static_cast<int32_t>(header_rank)) continue;
      std::vector<sp::DataFileChunk> chunks;
      for (const sp::ChunkWrite& w : plan->ranks[header_rank].writes) {
        if (w.file != f) continue;
        const sp::TensorMetadata& t = plan->metadata.tensors[w.tensor];
        const sp::StoredChunk& c = t.chunks[w.chunk];
        chunks.push_back(sp::DataFileChunk{t.name, t.dtype, &c.box, c.data_offset, c.byte_length});
      }
      bytes += writer->BuildFileHeader(plan->metadata.save_id, std::move(chunks),
                                       plan->metadata.checksum_block_bytes)
                   .size();
    }
    return bytes;
  });

  // A save whose plan comes from a SavePlanCache: before the replies, the coordinator renames
  // the cached layout's files for the new save id (engine/save_plan_cache.h).
  sp::CheckpointMetadata laid_out = plan->metadata;
  laid_out.save_id = "0123456789ab";
  if (!writer->LayOutFiles(store, "/bench", &laid_out).ok()) return 1;
  const Timing cached = Median([&]() -> sp::Result<std::vector<sp::DataFile>> {
    std::vector<sp::DataFile> files = laid_out.files;
    for (sp::DataFile& f : files) {
      if (!writer->RenameForSave(laid_out.save_id, "ba9876543210", &f.name, nullptr)) {
        return sp::InternalError("rename");
      }
    }
    return files;
  });
  // Its commit, from the checksums the ranks report to the encoded metadata file: as
  // engine/save.cc commits it, the checksums collected into a table and the file encoded from the
  // cached plan's chunks and the table; and, for comparison, as it did before, through a copy of
  // the plan's tensors with the checksums filled in.
  sp::CheckpointMetadata summary = laid_out;
  summary.tensors.clear();
  summary.save_id = "ba9876543210";
  const Timing commit_apart = Median([&]() -> sp::Result<size_t> {
    return sp::EncodeMetadata(summary, laid_out.tensors,
                              ReportedChecksums(laid_out.tensors, laid_out.checksum_block_bytes))
        .size();
  });
  const Timing commit_copied = Median([&]() -> sp::Result<size_t> {
    SP_ASSIGN_OR_RETURN(sp::CheckpointMetadata md,
                        CopiedWithChecksums(summary, laid_out.tensors, pool.get()));
    return sp::EncodeMetadata(md).size();
  });

  // The reports the ranks send once written (engine/save_messages.h), which every commit collects
  // first (engine/write_reports.h): as it does, walked in place on one thread and on the pool;
  // and, for comparison, as it did before (CollectReportsAsBefore).
  std::vector<std::string> reports(plan->ranks.size());
  size_t report_bytes = 0;
  for (size_t r = 0; r < plan->ranks.size(); ++r) {
    sp::WriteReport report;
    for (const sp::ChunkWrite& w : plan->ranks[r].writes) {
      const sp::StoredChunk& c = laid_out.tensors[w.tensor].chunks[w.chunk];
      report.chunks.push_back(sp::ChunkReport{
          w.tensor, w.chunk,
          std::vector<uint32_t>(
              sp::ChecksumBlockCount(c.byte_length, laid_out.checksum_block_bytes), 0x12345678u)});
    }
    for (uint32_t f : plan->ranks[r].files) {
      report.files.push_back(
          sp::FileReport{f, laid_out.files[f].data_start, laid_out.files[f].size});
    }
    reports[r] = sp::EncodeWriteReport(report);
    report_bytes += reports[r].size();
  }
  const auto collect = [&](bool before, sp::ThreadPool* on) {
    return Median([&]() -> sp::Result<sp::ChunkChecksums> {
      sp::CheckpointMetadata files = summary;
      sp::ChunkChecksums checksums;
      SP_RETURN_IF_ERROR(
          before ? CollectReportsAsBefore(reports, laid_out.tensors, &files, &checksums)
                 : sp::CollectReports(reports, laid_out.tensors, &files, &checksums, on));
      return checksums;
    });
  };
  const Timing collect_before = collect(true, nullptr);
  const Timing collect_one = collect(false, nullptr);
  const Timing collect_pool = collect(false, pool.get());
  reports = {};

  std::vector<sp::LocalTensor> targets;
  for (const auto& t : plan->metadata.tensors) {
    targets.push_back(sp::LocalTensor{t.name, t.dtype, t.shape, {Box::Whole(t.shape)}});
  }
  sp::Result<sp::LoadPlan> load_plan = sp::PlanLoad(targets, plan->metadata, sp::LoadPlanOptions{});
  if (!load_plan.ok()) {
    std::fprintf(stderr, "PlanLoad failed: %s\n", load_plan.status().ToString().c_str());
    return 1;
  }
  const Timing load =
      Median([&] { return sp::PlanLoad(targets, plan->metadata, sp::LoadPlanOptions{}); });

  // The same plans with every tensor swept (plan/box_set.h), as before chunk grids.
  const sp::LoadPlanOptions swept{.chunk_grids = false};
  const std::vector<sp::LocalTensor>& own_boxes = locals[ranks / 2 + 3].tensors;
  const Timing own_swept = Median([&] { return sp::PlanLoad(own_boxes, plan->metadata, swept); });
  const Timing load_swept = Median([&] { return sp::PlanLoad(targets, plan->metadata, swept); });
  const size_t own_items =
      sp::PlanLoad(own_boxes, plan->metadata, sp::LoadPlanOptions{})->items.size();

  // The committed metadata (the native .metadata file of the laid-out plan) and its wire
  // encoding (what a load broadcast before; now only for other formats): bytes, and the time to
  // decode them.
  // As committed: one checksum per block of every chunk (values do not matter here).
  sp::CheckpointMetadata committed = laid_out;
  FillCommittedChecksums(committed.checksum_block_bytes, &committed.tensors);
  // Decoded on the pool, as the engine does (the coordinator of a load and each of its ranks).
  sp::ThreadPool* const on = pool.get();
  const std::string native = sp::EncodeMetadata(committed);
  const std::string native_v2 = sp::EncodeMetadata(committed, 2);
  const std::string native_v1 = sp::EncodeMetadata(committed, 1);
  for (const std::string* bytes : {&native, &native_v2, &native_v1}) {
    if (sp::Result<sp::CheckpointMetadata> decoded =
            sp::DecodeMetadata(*bytes, "/bench/.metadata", on);
        !decoded.ok()) {
      std::fprintf(stderr, "DecodeMetadata failed: %s\n", decoded.status().ToString().c_str());
      return 1;
    }
  }
  const Timing encode_native =
      Median([&]() -> sp::Result<std::string> { return sp::EncodeMetadata(committed); });
  const Timing open_native =
      Median([&] { return sp::DecodeMetadata(native, "/bench/.metadata", on); });
  const Timing open_v2 =
      Median([&] { return sp::DecodeMetadata(native_v2, "/bench/.metadata", on); });
  const Timing open_v1 =
      Median([&] { return sp::DecodeMetadata(native_v1, "/bench/.metadata", on); });
  // Encoded first with the process's peak resident set reset: how far encoding the broadcast
  // raises it above what the coordinator of a load already holds.
  const double wire_rss = StatusMiB("VmRSS");
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // resets VmHWM to the current resident set
  }
  const std::string wire = sp::EncodeMetadataForWire(committed);
  const double wire_peak = StatusMiB("VmHWM") - wire_rss;
  const Timing encode_wire =
      Median([&]() -> sp::Result<std::string> { return sp::EncodeMetadataForWire(committed); });
  const Timing open_wire = Median([&] { return sp::DecodeMetadataFromWire(wire, on); });
  // A load's metadata step, from the file's bytes on its coordinator to the metadata decoded on
  // a rank (the broadcast between them not counted): as loads did it, the coordinator opening the
  // file, encoding it for the wire and each rank decoding that; as they do now, each rank opening
  // the file's bytes (engine/load.cc).
  const Timing step_before = Median([&]() -> sp::Result<sp::CheckpointMetadata> {
    std::string bytes;
    {
      SP_ASSIGN_OR_RETURN(sp::CheckpointMetadata md,
                          sp::DecodeNativeCheckpointMetadata(native, "/bench", on));
      bytes = sp::EncodeMetadataForWire(md);
    }
    return sp::DecodeMetadataFromWire(bytes, on);
  });
  const Timing step_now =
      Median([&] { return sp::DecodeNativeCheckpointMetadata(native, "/bench", on); });

  // One rank loading its own boxes of the layout it saved (the restart case), planned against the
  // whole checkpoint's metadata as a load's ranks have it (the file's bytes, decoded: grids
  // stored, the other tensors indexed on arrival); and against the same metadata without grids
  // or indexes, each grid found again from the chunks by the plan and the rest swept (as before
  // grids and indexes were carried).
  const std::vector<sp::LocalTensor>& own = locals[ranks / 2 + 3].tensors;
  const sp::CheckpointMetadata received =
      sp::DecodeNativeCheckpointMetadata(native, "/bench", on).value();
  const Timing own_load =
      Median([&] { return sp::PlanLoad(own, received, sp::LoadPlanOptions{}); });
  size_t grids = 0, indexes = 0;
  for (const sp::TensorMetadata& t : received.tensors) {
    grids += t.grid.has_value();
    indexes += t.index.has_value();
  }
  sp::CheckpointMetadata bare = received;
  for (sp::TensorMetadata& t : bare.tensors) t.grid.reset(), t.index.reset();
  const Timing own_found = Median([&] { return sp::PlanLoad(own, bare, sp::LoadPlanOptions{}); });
  bare = {};
  // The same rank's part of the metadata, as a load rank other than rank 0
  // decodes it (LoadOptions::own_chunks_only): every byte checked, only the chunks its boxes reach
  // kept; and its load plan on that part, which must pair the same reads.
  sp::ChunkFilter filter;
  for (const sp::LocalTensor& t : own) filter[t.name] = t.boxes;
  const Timing step_part =
      Median([&] { return sp::DecodeNativeCheckpointMetadata(native, "/bench", on, &filter); });
  const sp::CheckpointMetadata part =
      sp::DecodeNativeCheckpointMetadata(native, "/bench", on, &filter).value();
  size_t part_chunks = 0;
  for (const sp::TensorMetadata& t : part.tensors) part_chunks += t.chunks.size();
  const Timing own_part_load =
      Median([&] { return sp::PlanLoad(own, part, sp::LoadPlanOptions{}); });
  const size_t own_part_items = sp::PlanLoad(own, part, sp::LoadPlanOptions{})->items.size();
  if (own_part_items != sp::PlanLoad(own, received, sp::LoadPlanOptions{})->items.size()) {
    std::fprintf(stderr, "the load plan on the rank's part pairs %zu reads, on the whole %zu\n",
                 own_part_items, sp::PlanLoad(own, received, {})->items.size());
    return 1;
  }

  // The coordinator of a load sending each rank but rank 0 its part (engine/load.cc,
  // MetadataPartsOfLoad): every rank's boxes of the saved layout to the wire encoding of its
  // part, on the pool, from the metadata the coordinator opened; the bytes each rank is sent,
  // against the whole file every rank was sent before; and one rank's decoding of its part.
  // Each rank's request as it sends it (not timed), then the coordinator's answers in rounds of
  // 512 ranks, as a load makes them (AnswerMetadataRequests, engine/load_internal.h).
  std::vector<std::string> requests(static_cast<size_t>(ranks));
  for (int64_t r = 1; r < ranks; ++r) {
    sp::ChunkFilter boxes;
    for (const sp::LocalTensor& t : locals[r].tensors) boxes[t.name] = t.boxes;
    requests[r] = sp::MetadataRequest(&boxes);
  }
  uint64_t request_bytes = 0;
  for (const std::string& request : requests) request_bytes += request.size();
  std::vector<uint64_t> part_bytes(static_cast<size_t>(ranks), 0);
  size_t distinct_requests = 0;
  {
    std::vector<std::string_view> sorted(requests.begin() + 1, requests.end());
    std::sort(sorted.begin(), sorted.end());
    distinct_requests = static_cast<size_t>(std::unique(sorted.begin(), sorted.end()) -
                                            sorted.begin());
  }
  const Timing parts = Median([&]() -> sp::Result<size_t> {
    const sp::MetadataPartEncoder encoder(received, on);
    std::string whole;
    for (int64_t first = 0; first < ranks; first += 512) {
      const int64_t end = std::min<int64_t>(ranks, first + 512);
      std::vector<std::string> out(static_cast<size_t>(end - first));
      SP_RETURN_IF_ERROR(sp::AnswerMetadataRequests(
          encoder, std::span<const std::string>(requests).subspan(first, end - first),
          static_cast<int>(first), std::string(17, 'n'), 0, &whole, out, on));
      for (int64_t r = first; r < end; ++r) part_bytes[r] = out[r - first].size();
    }
    return size_t{0};
  });
  uint64_t parts_total = 0, parts_largest = 0;
  for (uint64_t b : part_bytes) parts_total += b, parts_largest = std::max(parts_largest, b);
  const std::string sent = sp::EncodeMetadataPartForWire(received, filter);
  const Timing decode_sent = Median([&] { return sp::DecodeMetadataFromWire(sent, on); });
  size_t sent_chunks = 0;
  const sp::Result<sp::CheckpointMetadata> sent_decoded = sp::DecodeMetadataFromWire(sent, on);
  for (const sp::TensorMetadata& t : sent_decoded->tensors) sent_chunks += t.chunks.size();
  if (sent_chunks != part_chunks) {
    std::fprintf(stderr, "the part sent holds %zu chunks, the part decoded from the file %zu\n",
                 sent_chunks, part_chunks);
    return 1;
  }

  std::printf("  chunks=%zu\n", chunks);
  const bool target_size = ranks == 1024 && tensors == 500;
  std::printf(
      "  PlanSave median of 5: %.4f s wall, %.4f s cpu  (target: < %.1f s wall for 1024 x 500",
      save.wall_s, save.cpu_s, kTargetSeconds);
  std::printf(target_size ? ": %s)\n" : "; not this size%s)\n",
              target_size ? (save.wall_s < kTargetSeconds ? "met" : "NOT met") : "");
  std::printf("    of which planning on the gathered plans (as the coordinator does): %.4f s wall, "
              "%.4f s cpu\n",
              save_gathered.wall_s, save_gathered.cpu_s);
  std::printf("    and on the ruled plans a save sends (the layouts' rules; the irregular tenth as "
              "boxes): %.4f s wall, %.4f s cpu; with the tensors held as cells and the writes "
              "deferred, as a native save plans them: %.4f s wall, %.4f s cpu\n",
              save_ruled.wall_s, save_ruled.cpu_s, save_ruled_cells.wall_s,
              save_ruled_cells.cpu_s);
  std::printf(
      "  native file layout median of 5: %.4f s wall, %.4f s cpu  (%zu files: names and "
      "headers, with a copy of the metadata)\n",
      layout.wall_s, layout.cpu_s, plan->metadata.files.size());
  std::printf(
      "  one rank's file headers median of 5: %.6f s wall  (what a save does instead of the "
      "layout above: each rank builds the headers of its own files)\n",
      rank_headers.wall_s);
  std::printf(
      "  cached plan median of 5: %.4f s wall, %.4f s cpu  (the coordinator's planning in a save "
      "through a SavePlanCache, before its replies: the cached layout's files renamed)\n"
      "    and its commit, the reported checksums to the encoded metadata, from the cached plan's "
      "chunks and a table of the checksums: %.4f s wall (the first of 5: %.4f s); through a "
      "copy of the plan (as before): %.4f s wall (the first of 5: %.4f s)\n",
      cached.wall_s, cached.cpu_s, commit_apart.wall_s, commit_apart.first_wall_s,
      commit_copied.wall_s, commit_copied.first_wall_s);
  std::printf(
      "  the commit's collection of the ranks' write reports (%.1f MiB), median of 5: %.4f s wall "
      "on the pool, %.4f s wall on one thread; as before (each report decoded, each chunk read, "
      "one thread): %.4f s wall\n",
      static_cast<double>(report_bytes) / (1 << 20), collect_pool.wall_s, collect_one.wall_s,
      collect_before.wall_s);
  std::printf(
      "  PlanLoad median of 5: %.4f s wall, %.4f s cpu  (one rank reading every tensor "
      "whole: %zu items)\n",
      load.wall_s, load.cpu_s, load_plan->items.size());
  std::printf(
      "  PlanLoad of one rank median of 5: %.4f s wall, %.4f s cpu  (rank %lld's own boxes of "
      "the saved layout: %zu items; on the metadata a load receives, %zu tensors with their "
      "grid and %zu with an index)\n",
      own_load.wall_s, own_load.cpu_s, static_cast<long long>(ranks / 2 + 3), own_items, grids,
      indexes);
  std::printf("    the same without grids or indexes (grids found again from the chunks, the "
              "rest swept): %.4f s cpu\n",
              own_found.cpu_s);
  std::printf("  without chunk grids (every tensor swept): PlanLoad %.4f s cpu, of one rank %.4f s "
              "cpu\n",
              load_swept.cpu_s, own_swept.cpu_s);
  std::printf("  metadata: %.1f MiB native (format 3, packed tables), encoded in %.4f s and "
              "opened in %.4f s (medians of 5); format 2 (tables at fixed width) %.1f MiB, "
              "opened in %.4f s; format 1 (every chunk listed) %.1f MiB, opened in %.4f s; "
              "encoded for the wire (a load's broadcast of another format's metadata) %.1f MiB, "
              "encoded in %.4f s (raising the peak resident set by %.0f MiB) and decoded in "
              "%.4f s\n",
              static_cast<double>(native.size()) / (1 << 20), encode_native.wall_s,
              open_native.wall_s, static_cast<double>(native_v2.size()) / (1 << 20),
              open_v2.wall_s, static_cast<double>(native_v1.size()) / (1 << 20),
              open_v1.wall_s, static_cast<double>(wire.size()) / (1 << 20), encode_wire.wall_s,
              wire_peak, open_wire.wall_s);
  std::printf("  a load's metadata, from the file's bytes on the coordinator to a rank's decoded "
              "metadata (the broadcast between them not counted), median of 5: %.4f s as loads "
              "did it (opened by the coordinator, encoded for the wire, decoded by each rank: "
              "%.1f MiB broadcast), %.4f s now (the file's %.1f MiB broadcast, opened by each "
              "rank)\n",
              step_before.wall_s, static_cast<double>(wire.size()) / (1 << 20), step_now.wall_s,
              static_cast<double>(native.size()) / (1 << 20));
  std::printf("    a load rank's part of it (rank %lld's boxes; LoadOptions::own_chunks_only), "
              "median of 5: %.4f s wall, %.4f s cpu to decode the file keeping %zu of the %zu "
              "chunks, %.2f MiB of chunk lists against %.1f MiB for the whole copy; its load "
              "plan on the part %.4f s cpu (%zu reads, as on the whole)\n",
              static_cast<long long>(ranks / 2 + 3), step_part.wall_s, step_part.cpu_s,
              part_chunks, chunks,
              static_cast<double>(sp::ChunkListBytes(part.tensors)) / (1 << 20),
              static_cast<double>(sp::ChunkListBytes(received.tensors)) / (1 << 20),
              own_part_load.cpu_s, own_part_items);
  std::printf("    each rank sent its part (LoadOptions::own_chunks_only): the coordinator answers "
              "the %lld ranks but rank 0 (%zu distinct requests, %.1f MiB in all, %.3f MiB from "
              "rank %lld) in %.4f s wall, %.4f s cpu "
              "(median of 5, on the pool, in rounds of 512), %.1f MiB in all; a rank is sent "
              "%.3f MiB (rank %lld; the largest %.3f MiB) against the whole file's %.1f MiB, "
              "and decodes it in %.4f s wall\n",
              static_cast<long long>(ranks - 1), distinct_requests,
              static_cast<double>(request_bytes) / (1 << 20),
              static_cast<double>(requests[ranks / 2 + 3].size()) / (1 << 20),
              static_cast<long long>(ranks / 2 + 3), parts.wall_s, parts.cpu_s,
              static_cast<double>(parts_total) / (1 << 20),
              static_cast<double>(sent.size()) / (1 << 20),
              static_cast<long long>(ranks / 2 + 3),
              static_cast<double>(parts_largest) / (1 << 20),
              static_cast<double>(native.size()) / (1 << 20), decode_sent.wall_s);
  return 0;
}
