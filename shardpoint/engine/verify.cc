// Verify: checks a committed checkpoint end to end and reports every defect it finds.
#include <algorithm>
#include <mutex>
#include <optional>
#include <set>

#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/plan/box_set.h"

namespace sp {
namespace {

constexpr uint64_t kVerifyTaskBytes = uint64_t{16} << 20;

class DefectList {
 public:
  void Add(std::string defect) {
    std::lock_guard<std::mutex> lock(mu_);
    defects_.push_back(std::move(defect));
  }
  std::vector<std::string> Take() { return std::move(defects_); }

 private:
  std::mutex mu_;
  std::vector<std::string> defects_;
};

void CheckCoverage(const TensorMetadata& t, DefectList& defects) {
  const std::string prefix = "tensor '" + t.name + "': ";
  int64_t covered = 0;
  std::vector<const Box*> boxes;
  boxes.reserve(t.chunks.size());
  for (const StoredChunk& c : t.chunks) {
    if (!WithinShape(c.box, t.shape)) {
      defects.Add(prefix + "chunk " + c.box.ToString() + " lies outside shape " +
                  ShapeToString(t.shape));
      return;
    }
    covered += c.box.volume();
    boxes.push_back(&c.box);
  }
  if (std::optional<std::pair<size_t, size_t>> pair = FindOverlappingPair(boxes)) {
    defects.Add(prefix + "chunks " + boxes[pair->first]->ToString() + " and " +
                boxes[pair->second]->ToString() + " overlap");
    return;
  }
  if (covered != ShapeVolume(t.shape)) {
    defects.Add(prefix + "chunks cover " + std::to_string(covered) + " of " +
                std::to_string(ShapeVolume(t.shape)) + " elements");
  }
}

// Opens data file f and checks its size and its safetensors header against the metadata.
std::unique_ptr<ReadableFile> CheckFile(const CheckpointMetadata& md, uint32_t f, Store& store,
                                        std::string_view path, DefectList& defects) {
  const DataFile& file = md.files[f];
  Result<std::unique_ptr<ReadableFile>> opened = store.OpenReadable(JoinPath(path, file.name));
  if (!opened.ok()) {
    defects.Add("data file " + file.name + " cannot be opened: " + opened.status().message());
    return nullptr;
  }
  std::unique_ptr<ReadableFile> handle = std::move(opened).value();
  if (handle->size() != file.size) {
    defects.Add("data file " + file.name + " has " + std::to_string(handle->size()) +
                " bytes, expected " + std::to_string(file.size));
    return nullptr;
  }
  if (md.format != CheckpointFormat::kNative) return handle;  // its driver parsed the file
  Result<SafetensorsHeader> found = ReadSafetensorsHeader(*handle);
  if (!found.ok()) {
    defects.Add("data file " + file.name + ": " + found.status().message());
    return nullptr;
  }
  const std::string expected_bytes = BuildDataFileHeader(md, f);
  Result<SafetensorsHeader> expected =
      ParseSafetensorsHeader(expected_bytes, file.size, handle->path());
  bool same = expected.ok() && expected->data_start == found->data_start &&
              expected->entries.size() == found->entries.size();
  for (size_t i = 0; same && i < found->entries.size(); ++i) {
    const SafetensorsEntry& a = expected->entries[i];
    const SafetensorsEntry& b = found->entries[i];
    same = a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin &&
           a.end == b.end;
  }
  if (!same) {
    defects.Add("data file " + file.name + ": its safetensors header does not match the metadata");
    return nullptr;
  }
  return handle;
}

}  // namespace

Result<VerifyReport> Verify(std::string_view path, Store* store, ThreadPool* pool) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, nullptr, store, pool, 0));
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, ReadCheckpointMetadata(path, &ctx->store()));
  VerifyReport report;
  report.has_checksums = md.checksum_block_bytes > 0;
  DefectList defects;
  std::vector<std::unique_ptr<ReadableFile>> files(md.files.size());
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    files[f] = CheckFile(md, f, ctx->store(), path, defects);
    if (files[f]) ++report.files_checked;
  }
  std::atomic<uint64_t> bytes{0};
  TaskGroup group(&ctx->pool());
  for (const TensorMetadata& t : md.tensors) {
    CheckCoverage(t, defects);
    for (const StoredChunk& c : t.chunks) {
      if (c.file >= files.size() || !files[c.file]) continue;
      ++report.chunks_checked;
      if (!report.has_checksums) continue;
      StoredChunkRef ref{files[c.file].get(), &t, &c, md.files[c.file].data_start + c.data_offset,
                         md.checksum_block_bytes};
      for (uint64_t lo = 0; lo < c.byte_length; lo += kVerifyTaskBytes) {
        uint64_t hi = std::min(lo + kVerifyTaskBytes, c.byte_length);
        group.Run([ref, lo, hi, &bytes, &defects]() -> Status {
          AlignedBuffer buffer(hi - lo);
          Status s = ReadChunkBytes(ref, lo, hi, buffer.data(), true, &bytes);
          if (!s.ok()) defects.Add(s.message());
          return OkStatus();
        });
      }
    }
  }
  SP_RETURN_IF_ERROR(group.Wait());
  // Object items the driver located but did not read (DCP): each decoded once, then dropped.
  std::set<StoredObjectItem> items;
  for (const ObjectEntry& o : md.objects) {
    if (!o.stored || !items.insert(*o.stored).second) continue;
    ObjectEntry copy = o;
    Status read = ReadObjectPayloads(ctx->store(), path, md, std::span<ObjectEntry>(&copy, 1));
    if (!read.ok()) defects.Add(read.message());
  }
  report.bytes_checked = bytes.load();
  report.defects = defects.Take();
  return report;
}

}  // namespace sp
