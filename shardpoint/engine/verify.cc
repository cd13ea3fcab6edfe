// Verify: checks a committed checkpoint end to end and reports every defect it finds.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "shardpoint/engine/verify.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/engine/context.h"
#include "shardpoint/engine/header_checksums.h"
#include "shardpoint/engine/opened_checkpoint.h"
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
  std::vector<const Box*> boxes;
  boxes.reserve(t.chunks.size());
  for (const StoredChunk& c : t.chunks) {
    if (!WithinShape(c.box, t.shape)) {
      defects.Add(prefix + "chunk " + c.box.ToString() + " lies outside shape " +
                  ShapeToString(t.shape));
      return;
    }
    boxes.push_back(&c.box);
  }
  if (std::optional<std::pair<size_t, size_t>> pair = FindOverlappingPair(boxes)) {
    defects.Add(prefix + "chunks " + boxes[pair->first]->ToString() + " and " +
                boxes[pair->second]->ToString() + " overlap");
    return;
  }
  // Checked sums (metadata.h): a count that would wrap saturates and so never matches.
  const uint64_t covered = CountChunkElements(t);
  const uint64_t volume = static_cast<uint64_t>(ShapeVolume(t.shape));
  if (covered != volume) {
    defects.Add(prefix + "chunks cover " + std::to_string(covered) + " of " +
                std::to_string(volume) + " elements");
  }
}

// The block's pairs but the checksums (version 3.1: 8 hex digits a block), checked apart.
std::string MetadataBlockToString(const std::map<std::string, std::string>& block) {
  std::string out = "{";
  for (const auto& [key, value] : block) {
    if (key == "crc32c") continue;
    out += (out.size() > 1 ? ", " : "") + key + "=" + value;
  }
  return out + "}";
}

// A version "MAJOR.MINOR" as written in data file headers: decimal numbers of at most 9 digits
// without leading zeros; nullopt for anything else.
std::optional<std::pair<uint32_t, uint32_t>> ParseVersion(std::string_view text) {
  const size_t dot = text.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  uint32_t parts[2];
  const std::string_view pieces[2] = {text.substr(0, dot), text.substr(dot + 1)};
  for (int i = 0; i < 2; ++i) {
    const std::string_view p = pieces[i];
    if (p.empty() || p.size() > 9 || (p[0] == '0' && p.size() > 1)) return std::nullopt;
    parts[i] = 0;
    for (char c : p) {
      if (c < '0' || c > '9') return std::nullopt;
      parts[i] = parts[i] * 10 + static_cast<uint32_t>(c - '0');
    }
  }
  return std::make_pair(parts[0], parts[1]);
}

// Whether a data file's "__metadata__" block `found` is the one its writer puts there
// (format/native/data_file.cc): `built` holds what this reader would write. The format version is
// "MAJOR.MINOR", at least 1.0 and at most the metadata's: the files of a checkpoint are written
// before its metadata, by the same or an older writer (a prune of a version-1 checkpoint keeps
// its untouched version-1 files under version-2 metadata; data files are the same in both).
// The block checksums ("crc32c", from version 3.1) are checked apart (ReadHeaderChecksums): the
// built header holds room for them, the written one their values.
bool MetadataBlockMatches(const CheckpointMetadata& md, std::map<std::string, std::string> found,
                          std::map<std::string, std::string> built) {
  auto version = found.find("format_version");
  if (version == found.end()) return false;
  const std::optional<std::pair<uint32_t, uint32_t>> parsed = ParseVersion(version->second);
  if (!parsed || parsed->first < 1 ||
      *parsed > std::make_pair(md.version_major, md.version_minor)) {
    return false;
  }
  found.erase(version);
  built.erase("format_version");
  found.erase("crc32c");
  built.erase("crc32c");
  return found == built;
}

// Whether chunk `c`'s checksums in its file's header (`in_file`) are those of the metadata.
void CheckChunkChecksums(const CheckpointMetadata& md, const TensorMetadata& t,
                         const StoredChunk& c, const DataFileChecksums& in_file,
                         DefectList& defects) {
  if (c.byte_length == 0) return;  // an empty chunk has none
  const std::span<const uint32_t> found = in_file.Of(c.data_offset, c.byte_length);
  const std::span<const uint32_t> want(c.block_crc32c.data(), c.block_crc32c.size());
  if (!std::equal(found.begin(), found.end(), want.begin(), want.end())) {
    defects.Add("data file " + md.files[c.file].name + ": its header's block checksums of " +
                "tensor '" + t.name + "' chunk " + c.box.ToString() +
                " differ from the metadata's");
  }
}

// Opens data file f and checks its size and its safetensors header against `expected_bytes`, the
// header the metadata implies (BuildDataFileHeaders).
std::unique_ptr<ReadableFile> CheckFile(const CheckpointMetadata& md, uint32_t f,
                                        const std::string& expected_bytes, Store& store,
                                        std::string_view path, DefectList& defects,
                                        std::optional<DataFileChecksums>* checksums) {
  const DataFile& file = md.files[f];
  DataFileAttempt opened = TryOpenDataFile(store, path, md, f);
  if (opened.file == nullptr) {
    // A link out of the checkpoint (kFailedPrecondition) is reported once, by ReportLinks.
    if (opened.open_error.code() == StatusCode::kFailedPrecondition) return nullptr;
    defects.Add("data file " + file.name + " cannot be opened: " + opened.open_error.message());
    return nullptr;
  }
  std::unique_ptr<ReadableFile> handle = std::move(opened.file);
  if (!opened.size_matches) {
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
  if (!MetadataBlockMatches(md, found->metadata, expected->metadata)) {
    defects.Add("data file " + file.name + ": its safetensors header's __metadata__ " +
                MetadataBlockToString(found->metadata) +
                " does not match the metadata (expected " +
                MetadataBlockToString(expected->metadata) + ")");
    return nullptr;
  }
  if (md.data_file_checksums) {
    // That the header's bytes have the CRC the metadata records, and the checksums they hold.
    Result<DataFileChecksums> in_header = ReadHeaderChecksums(md, f, *handle);
    if (in_header.ok()) {
      *checksums = std::move(*in_header);
    } else {
      defects.Add(in_header.status().message());
    }
  }
  return handle;
}

// Reads a driver-decoded chunk (a compressed or strided DCP item) whole and decodes it exactly as
// a load does (DecodeStoredChunk into chunk.byte_length bytes): what load would refuse (a stream
// that is garbage, truncated, too long, or an item of another shape) is an error here.
Status CheckDecodedChunk(const CheckpointMetadata& md, const TensorMetadata& t,
                         const StoredChunk& c, const ReadableFile& file,
                         std::atomic<uint64_t>* bytes) {
  AlignedBuffer stored(c.stored_length);
  SP_RETURN_IF_ERROR(file.ReadAt(md.files[c.file].data_start + c.data_offset,
                                 MutableByteView(stored.data(), c.stored_length)));
  bytes->fetch_add(c.stored_length, std::memory_order_relaxed);
  AlignedBuffer decoded(c.byte_length);
  return DecodeStoredChunk(md, t, c, ByteView(stored.data(), c.stored_length), decoded.data());
}

constexpr int kMaxLinkWalkDepth = 8;
constexpr size_t kMaxLinkWalkEntries = size_t{1} << 16;

// Every symbolic link below the checkpoint directory `root` (`relative`: the directory walked, ""
// at the top): a note when it stays inside (or the store allows links out), a defect otherwise.
// Linked directories are not entered. Stores without links find none.
Status ReportLinks(Store& store, std::string_view root, const std::string& relative, int depth,
                   size_t* seen, VerifyReport& report, DefectList& defects) {
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(JoinPath(root, relative)));
  for (const DirEntry& e : entries) {
    if (++*seen > kMaxLinkWalkEntries) return OkStatus();
    const std::string name = JoinPath(relative, e.name);
    SP_ASSIGN_OR_RETURN(LinkInfo link, store.FindLink(root, name));
    if (link.through_link) {
      const std::string what = name + " is a symbolic link to " + link.target;
      if (link.inside) {
        report.notes.push_back(what + " (inside the checkpoint)");
      } else if (store.allows_external_links()) {
        report.notes.push_back(what + ", outside the checkpoint (external links are allowed)");
      } else {
        defects.Add(what + ", outside the checkpoint directory " + std::string(root) +
                    " (refused unless external links are allowed)");
      }
    } else if (e.is_directory && depth < kMaxLinkWalkDepth) {
      SP_RETURN_IF_ERROR(ReportLinks(store, root, name, depth + 1, seen, report, defects));
    }
  }
  return OkStatus();
}

}  // namespace

Result<VerifyReport> Verify(std::string_view path, Store* store, ThreadPool* pool) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EngineContext> ctx,
                      EngineContext::Make(path, nullptr, store, pool, 0));
  VerifyReport report;
  DefectList defects;
  Result<bool> is_directory = ctx->store().IsDirectory(path);
  size_t seen = 0;
  if (is_directory.ok() && *is_directory) {
    SP_RETURN_IF_ERROR(ReportLinks(ctx->store(), path, "", 0, &seen, report, defects));
  }
  Result<CheckpointMetadata> opened = ReadCheckpointMetadata(path, &ctx->store());
  if (!opened.ok() && opened.status().code() == StatusCode::kFailedPrecondition) {
    // A link out of the checkpoint kept a file the metadata is read from closed: reported above.
    report.defects = defects.Take();
    if (!report.defects.empty()) return report;
  }
  SP_ASSIGN_OR_RETURN(CheckpointMetadata md, std::move(opened));
  report.has_checksums = md.checksum_block_bytes > 0;
  std::vector<std::unique_ptr<ReadableFile>> files(md.files.size());
  const std::vector<std::string> headers =
      md.format == CheckpointFormat::kNative ? BuildDataFileHeaders(md)
                                             : std::vector<std::string>(md.files.size());
  std::vector<std::optional<DataFileChecksums>> in_headers(md.files.size());
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    files[f] = CheckFile(md, f, headers[f], ctx->store(), path, defects, &in_headers[f]);
    if (files[f]) ++report.files_checked;
  }
  std::atomic<uint64_t> bytes{0};
  TaskGroup group(&ctx->pool());
  for (const TensorMetadata& t : md.tensors) {
    CheckCoverage(t, defects);
    for (const StoredChunk& c : t.chunks) {
      if (c.file >= files.size() || !files[c.file]) continue;
      ++report.chunks_checked;
      // Format 4: the header's checksums are the chunk's (a header that does not match its CRC
      // is a defect reported above, and its chunks are not read); before, they must be the
      // metadata's.
      if (md.checksums_in_headers && !in_headers[c.file]) continue;
      if (in_headers[c.file] && !md.checksums_in_headers) {
        CheckChunkChecksums(md, t, c, *in_headers[c.file], defects);
      }
      if (c.encoding == ChunkEncoding::kDriverDecoded) {
        group.Run([&md, &t, &c, file = files[c.file].get(), &bytes, &defects]() -> Status {
          Status s = CheckDecodedChunk(md, t, c, *file, &bytes);
          if (!s.ok()) defects.Add(s.message());
          return OkStatus();
        });
        continue;
      }
      if (!report.has_checksums) continue;
      const std::span<const uint32_t> crcs =
          md.checksums_in_headers ? in_headers[c.file]->Of(c.data_offset, c.byte_length)
                                  : OwnChecksums(c);
      StoredChunkRef ref{files[c.file].get(), &t, &c, md.files[c.file].data_start + c.data_offset,
                         md.checksum_block_bytes, crcs};
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
