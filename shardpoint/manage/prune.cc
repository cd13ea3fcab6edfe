// Prune: plan the new metadata, copy the surviving chunks of affected files, commit, clean up.
#include "shardpoint/manage/prune.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/base/random_id.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/engine/header_checksums.h"
#include "shardpoint/engine/opened_checkpoint.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/store/open_store.h"

namespace sp {
namespace {

// One surviving chunk of a rewritten file: where it was, and where it goes.
struct ChunkCopy {
  const TensorMetadata* tensor = nullptr;  // in the old metadata
  const StoredChunk* chunk = nullptr;      // in the old metadata
  uint64_t new_offset = 0;                 // relative to the new file's data_start
};

struct RewrittenFile {
  uint32_t old_file = 0;
  uint32_t new_file = 0;
  std::string header;
  std::vector<ChunkCopy> copies;  // in new_offset order
  // Format 4: the old file's checksums, from its header (TakeHeaderChecksums).
  DataFileChecksums old_checksums;
};

struct PrunePlan {
  CheckpointMetadata next;
  std::vector<RewrittenFile> rewrites;
  std::vector<std::string> old_files_to_remove;
  PruneReport report;
};

bool Matches(std::string_view name, const std::vector<std::string>& prefixes,
             std::vector<bool>* used) {
  bool any = false;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (name.starts_with(prefixes[i])) {
      (*used)[i] = true;
      any = true;
    }
  }
  return any;
}

// Splits the old tensors and objects into kept (in `next`) and removed (in the report), and
// marks the old files that hold pruned / kept chunks.
Status SplitKeys(const CheckpointMetadata& md, const std::vector<std::string>& prefixes,
                 std::string_view path, PrunePlan* plan, std::vector<bool>* has_pruned,
                 std::vector<bool>* has_kept) {
  std::vector<bool> used(prefixes.size(), false);
  for (const TensorMetadata& t : md.tensors) {
    const bool pruned = Matches(t.name, prefixes, &used);
    for (const StoredChunk& c : t.chunks) {
      if (c.file >= md.files.size()) return InternalError("chunk refers to a missing file");
      (pruned ? *has_pruned : *has_kept)[c.file] = true;
    }
    if (pruned) {
      plan->report.tensors_removed.push_back(t.name);
      plan->report.tensor_bytes_removed += t.total_bytes();
    } else {
      plan->next.tensors.push_back(t);
    }
  }
  for (const ObjectEntry& o : md.objects) {
    if (Matches(o.name, prefixes, &used)) {
      plan->report.objects_removed.push_back(o.name);
    } else {
      plan->next.objects.push_back(o);
    }
  }
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (!used[i]) {
      return NotFoundError("prefix '" + prefixes[i] + "' matches no tensor or object in " +
                           std::string(path));
    }
  }
  return OkStatus();
}

// Gives every kept file its new index and every rewritten file a new name; fills `file_map`
// (old index -> new index, or -1 when dropped).
void AssignFiles(const CheckpointMetadata& md, const std::vector<bool>& has_pruned,
                 const std::vector<bool>& has_kept, PrunePlan* plan,
                 std::vector<int64_t>* file_map) {
  const std::string tag = RandomHexId(6);
  std::map<int32_t, int> rewritten_per_rank;
  file_map->assign(md.files.size(), -1);
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    const DataFile& old = md.files[f];
    if (!has_pruned[f]) {
      plan->report.files_untouched.push_back(old.name);
    } else if (!has_kept[f]) {
      plan->report.files_dropped.push_back(old.name);
      plan->old_files_to_remove.push_back(old.name);
      continue;
    }
    (*file_map)[f] = static_cast<int64_t>(plan->next.files.size());
    DataFile file = old;
    if (has_pruned[f]) {
      const int k = rewritten_per_rank[old.writer_rank]++;
      file.name = DataFileName(md.save_id + ".p" + tag, old.writer_rank, k);
      plan->report.files_rewritten.push_back(old.name);
      plan->report.files_written.push_back(file.name);
      plan->old_files_to_remove.push_back(old.name);
      plan->rewrites.push_back({f, static_cast<uint32_t>(plan->next.files.size()), "", {}, {}});
    }
    plan->next.files.push_back(std::move(file));
  }
}

// Points the kept chunks at their new files, packs the chunks of rewritten files back to back in
// their old order, and builds each rewritten file's header and sizes: with the checksums of its
// chunks, and its CRC in the metadata, where the data files hold them (version 3.1).
Status LayOutRewrites(const CheckpointMetadata& md, const std::vector<int64_t>& file_map,
                      PrunePlan* plan) {
  std::map<uint32_t, RewrittenFile*> by_old;
  for (RewrittenFile& r : plan->rewrites) by_old[r.old_file] = &r;
  // Old chunk pointers, found by name in the old metadata (both are sorted by name).
  std::vector<std::pair<StoredChunk*, ChunkCopy>> moved;
  for (TensorMetadata& t : plan->next.tensors) {
    const TensorMetadata* old_tensor = md.FindTensor(t.name);
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      const uint32_t old_file = t.chunks[c].file;
      t.chunks[c].file = static_cast<uint32_t>(file_map[old_file]);
      if (by_old.count(old_file))
        moved.push_back({&t.chunks[c], {old_tensor, &old_tensor->chunks[c], 0}});
    }
  }
  std::sort(moved.begin(), moved.end(), [](const auto& a, const auto& b) {
    return a.second.chunk->data_offset < b.second.chunk->data_offset;
  });
  for (auto& [chunk, copy] : moved) {
    RewrittenFile& r = *by_old.at(copy.chunk->file);
    copy.new_offset =
        r.copies.empty() ? 0 : r.copies.back().new_offset + r.copies.back().chunk->byte_length;
    chunk->data_offset = copy.new_offset;
    r.copies.push_back(copy);
  }
  for (RewrittenFile& r : plan->rewrites) {
    uint64_t data_bytes = 0;
    for (const ChunkCopy& c : r.copies) data_bytes += c.chunk->byte_length;
    r.header = BuildDataFileHeader(plan->next, r.new_file);
    DataFile& file = plan->next.files[r.new_file];
    // Format 4: filled from the old headers once they are read (TakeHeaderChecksums).
    if (plan->next.data_file_checksums && !md.checksums_in_headers) {
      std::vector<uint32_t> crcs;  // the copies are in data offset order, as the entries
      for (const ChunkCopy& c : r.copies) {
        crcs.insert(crcs.end(), c.chunk->block_crc32c.begin(), c.chunk->block_crc32c.end());
      }
      SP_RETURN_IF_ERROR(FillDataFileChecksums(&r.header, crcs));
      file.header_crc32c = Crc32c(r.header);
    }
    file.data_start = r.header.size();
    file.size = r.header.size() + data_bytes;
    plan->report.bytes_copied += data_bytes;
  }
  return OkStatus();
}

Result<PrunePlan> MakePlan(const CheckpointMetadata& md, const std::vector<std::string>& prefixes,
                           std::string_view path) {
  PrunePlan plan;
  plan.next = md;
  plan.next.tensors.clear();
  plan.next.objects.clear();
  plan.next.files.clear();
  plan.next.version_major = kNativeFormatMajor;
  plan.next.version_minor = kNativeFormatMinor;
  std::vector<bool> has_pruned(md.files.size(), false), has_kept(md.files.size(), false);
  SP_RETURN_IF_ERROR(SplitKeys(md, prefixes, path, &plan, &has_pruned, &has_kept));
  std::vector<int64_t> file_map;
  AssignFiles(md, has_pruned, has_kept, &plan, &file_map);
  SP_RETURN_IF_ERROR(LayOutRewrites(md, file_map, &plan));
  return plan;
}

// Format 4, where the metadata holds no checksums: each rewritten file's header takes its copies'
// checksums from the old file's header, checked against its CRC.
Status TakeHeaderChecksums(Store& store, std::string_view path, const CheckpointMetadata& md,
                           PrunePlan* plan) {
  for (RewrittenFile& r : plan->rewrites) {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in,
                        OpenDataFile(store, path, md, r.old_file));
    SP_ASSIGN_OR_RETURN(r.old_checksums, ReadHeaderChecksums(md, r.old_file, *in));
    std::vector<uint32_t> crcs;  // the copies are in data offset order, as the entries
    for (const ChunkCopy& c : r.copies) {
      const std::span<const uint32_t> of =
          r.old_checksums.Of(c.chunk->data_offset, c.chunk->byte_length);
      crcs.insert(crcs.end(), of.begin(), of.end());
    }
    SP_RETURN_IF_ERROR(FillDataFileChecksums(&r.header, crcs)
                           .WithContext("data file " + md.files[r.old_file].name));
    plan->next.files[r.new_file].header_crc32c = Crc32c(r.header);
  }
  return OkStatus();
}

// Writes one rewritten file under its temporary name and renames it into place. `written`
// collects the paths to remove if the prune fails before its commit.
Status WriteRewrite(Store& store, std::string_view path, const CheckpointMetadata& md,
                    const PrunePlan& plan, const RewrittenFile& r, AlignedBuffer& buffer,
                    std::vector<std::string>* written) {
  const DataFile& old = md.files[r.old_file];
  const DataFile& file = plan.next.files[r.new_file];
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in, OpenDataFile(store, path, md, r.old_file));
  const std::string final_path = JoinPath(path, file.name);
  const std::string temp_path = final_path + ".tmp";
  written->push_back(temp_path);
  written->push_back(final_path);
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, store.NewWritableFile(temp_path));
  SP_RETURN_IF_ERROR(out->WriteAt(0, AsBytes(r.header)));
  const uint64_t block = md.checksum_block_bytes;
  const uint64_t step = std::max<uint64_t>(block, buffer.size() / block * block);
  std::atomic<uint64_t> bytes_read{0};
  for (const ChunkCopy& c : r.copies) {
    StoredChunkRef ref{in.get(), c.tensor, c.chunk, old.data_start + c.chunk->data_offset, block,
                       md.checksums_in_headers
                           ? r.old_checksums.Of(c.chunk->data_offset, c.chunk->byte_length)
                           : OwnChecksums(*c.chunk)};
    for (uint64_t lo = 0; lo < c.chunk->byte_length; lo += step) {
      const uint64_t hi = std::min(lo + step, c.chunk->byte_length);
      SP_RETURN_IF_ERROR(ReadChunkBytes(ref, lo, hi, buffer.data(), true, &bytes_read));
      SP_RETURN_IF_ERROR(
          out->WriteAt(file.data_start + c.new_offset + lo, ByteView(buffer.data(), hi - lo)));
    }
  }
  SP_RETURN_IF_ERROR(out->Sync());
  SP_RETURN_IF_ERROR(out->Close());
  return store.Rename(temp_path, final_path);
}

// docs/FORMAT.md §4 step 3: data durable, metadata to a temporary name, fsync, rename, fsync.
Status CommitMetadata(Store& store, std::string_view path, const CheckpointMetadata& next) {
  SP_RETURN_IF_ERROR(store.SyncDir(path));
  SP_RETURN_IF_ERROR(WriteFileDurably(store, path, kMetadataFileName,
                                      std::string(kMetadataFileName) + ".tmp-" + next.save_id,
                                      EncodeMetadata(next)));
  return store.SyncDir(path);
}

}  // namespace

Result<PruneReport> Prune(std::string_view path, const std::vector<std::string>& prefixes,
                          const PruneOptions& options) {
  if (prefixes.empty()) return InvalidArgumentError("prune needs at least one key prefix");
  for (const std::string& p : prefixes) {
    if (p.empty()) return InvalidArgumentError("an empty prefix would remove every key");
  }
  std::unique_ptr<Store> owned;
  Store* store = options.store;
  if (store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned, OpenStore(path));  // a plain path: POSIX; s3://...
    store = owned.get();
  }
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, ReadCheckpointMetadata(path, store));
  if (md.format != CheckpointFormat::kNative || md.checksum_block_bytes == 0) {
    return FailedPreconditionError("prune edits native shardpoint checkpoints only; " +
                                   std::string(path) + " is in another format");
  }
  SP_ASSIGN_OR_RETURN(PrunePlan plan, MakePlan(md, prefixes, path));
  if (options.dry_run) return plan.report;
  if (md.checksums_in_headers) SP_RETURN_IF_ERROR(TakeHeaderChecksums(*store, path, md, &plan));

  AlignedBuffer buffer(std::max<uint64_t>(options.copy_buffer_bytes, md.checksum_block_bytes));
  std::vector<std::string> written;
  for (const RewrittenFile& r : plan.rewrites) {
    Status s = WriteRewrite(*store, path, md, plan, r, buffer, &written);
    if (!s.ok()) {
      for (const std::string& w : written) store->RemoveFile(w).IgnoreError();
      return s;
    }
  }
  // A failed commit removes nothing: the rename may have happened.
  SP_RETURN_IF_ERROR(CommitMetadata(*store, path, plan.next));
  for (const std::string& name : plan.old_files_to_remove) {
    store->RemoveFile(JoinPath(path, name)).IgnoreError();
  }
  return plan.report;
}

}  // namespace sp
