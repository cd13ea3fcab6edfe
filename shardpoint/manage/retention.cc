// Retention: listing step checkpoints, planning and executing garbage collection.
#include "shardpoint/manage/retention.h"

#include <algorithm>
#include <memory>

#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/store/open_store.h"

namespace sp {
namespace {

constexpr char kDcpMetadataFileName[] = ".metadata";
constexpr int kMaxStepDigits = 18;
constexpr int kMaxDepth = 32;  // nesting below a checkpoint directory

// `store`, or the store of `path`'s URL (a plain path: POSIX; s3://...) owned by `owned`.
Result<Store*> StoreFor(std::string_view path, Store* store, std::unique_ptr<Store>* owned) {
  if (store != nullptr) return store;
  SP_ASSIGN_OR_RETURN(*owned, OpenStore(path));
  return owned->get();
}

// Adds the sizes of every file under `path` to *bytes.
Status SumBytes(Store& store, const std::string& path, int depth, uint64_t* bytes) {
  if (depth > kMaxDepth) {
    return FailedPreconditionError("directory " + path + " is nested more than " +
                                   std::to_string(kMaxDepth) + " levels deep");
  }
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(path));
  for (const DirEntry& e : entries) {
    if (e.is_directory) {
      SP_RETURN_IF_ERROR(SumBytes(store, JoinPath(path, e.name), depth + 1, bytes));
    } else {
      *bytes += e.size;
    }
  }
  return OkStatus();
}

// Fills committed, format and problem from the files directly in the checkpoint directory.
void ClassifyCommit(Store& store, const std::vector<DirEntry>& entries, StepCheckpoint* c) {
  auto has = [&](std::string_view name) {
    return std::any_of(entries.begin(), entries.end(),
                       [&](const DirEntry& e) { return !e.is_directory && e.name == name; });
  };
  if (has(kMetadataFileName)) {
    Result<std::unique_ptr<ReadableFile>> file =
        store.OpenReadable(JoinPath(c->path, kMetadataFileName));
    Result<std::unique_ptr<MetadataReader>> reader =
        file.ok() ? MetadataReader::Open(std::move(*file))
                  : Result<std::unique_ptr<MetadataReader>>(file.status());
    if (reader.ok()) {
      c->committed = true;
      c->format = "native";
    } else {
      c->problem = std::string(reader.status().message());
    }
    return;
  }
  if (has(kDcpMetadataFileName)) {
    c->committed = true;
    c->format = "torch-dcp";
  }
}

Result<StepCheckpoint> Examine(Store& store, std::string_view directory, const DirEntry& entry,
                               int64_t step) {
  StepCheckpoint c;
  c.step = step;
  c.name = entry.name;
  c.path = JoinPath(directory, entry.name);
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(c.path));
  ClassifyCommit(store, entries, &c);
  SP_RETURN_IF_ERROR(SumBytes(store, c.path, 0, &c.bytes));
  return c;
}

// Removes everything under `path` (not `path` itself): files first, then subdirectories.
Status RemoveContents(Store& store, const std::string& path, int depth) {
  if (depth > kMaxDepth) {
    return FailedPreconditionError("directory " + path + " is nested more than " +
                                   std::to_string(kMaxDepth) + " levels deep");
  }
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, store.ListDir(path));
  for (const DirEntry& e : entries) {
    if (!e.is_directory) SP_RETURN_IF_ERROR(store.RemoveFile(JoinPath(path, e.name)));
  }
  for (const DirEntry& e : entries) {
    if (!e.is_directory) continue;
    const std::string sub = JoinPath(path, e.name);
    SP_RETURN_IF_ERROR(RemoveContents(store, sub, depth + 1));
    SP_RETURN_IF_ERROR(store.RemoveDir(sub));
  }
  return OkStatus();
}

}  // namespace

std::optional<int64_t> StepOfName(std::string_view name) {
  if (name.empty() || name.front() == '.') return std::nullopt;
  size_t begin = name.size();
  while (begin > 0 && name[begin - 1] >= '0' && name[begin - 1] <= '9') --begin;
  const std::string_view digits = name.substr(begin);
  if (digits.empty() || digits.size() > kMaxStepDigits) return std::nullopt;
  int64_t step = 0;
  for (char d : digits) step = step * 10 + (d - '0');
  return step;
}

Result<CheckpointListing> ListCheckpoints(std::string_view directory, Store* store) {
  std::unique_ptr<Store> owned;
  SP_ASSIGN_OR_RETURN(Store * opened, StoreFor(directory, store, &owned));
  Store& s = *opened;
  SP_ASSIGN_OR_RETURN(bool is_dir, s.IsDirectory(directory));
  if (!is_dir) {
    return FailedPreconditionError(std::string(directory) + " is not a directory");
  }
  SP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, s.ListDir(directory));
  CheckpointListing listing;
  listing.directory = std::string(directory);
  for (const DirEntry& e : entries) {
    if (!e.is_directory) continue;
    std::optional<int64_t> step = StepOfName(e.name);
    if (!step) continue;
    SP_ASSIGN_OR_RETURN(StepCheckpoint c, Examine(s, directory, e, *step));
    listing.checkpoints.push_back(std::move(c));
  }
  std::sort(listing.checkpoints.begin(), listing.checkpoints.end(),
            [](const StepCheckpoint& a, const StepCheckpoint& b) {
              return a.step != b.step ? a.step < b.step : a.name < b.name;
            });
  for (size_t i = 0; i < listing.checkpoints.size(); ++i) {
    if (listing.checkpoints[i].committed) listing.latest = i;
  }
  return listing;
}

size_t GcPlan::removals() const {
  return std::count_if(decisions.begin(), decisions.end(),
                       [](const GcDecision& d) { return d.remove; });
}

uint64_t GcPlan::bytes_to_remove() const {
  uint64_t total = 0;
  for (const GcDecision& d : decisions) total += d.remove ? d.checkpoint.bytes : 0;
  return total;
}

Result<GcPlan> PlanGc(const CheckpointListing& listing, const RetentionPolicy& policy) {
  if (policy.keep_last < 1) {
    return InvalidArgumentError("keep_last must be at least 1, got " +
                                std::to_string(policy.keep_last));
  }
  if (policy.keep_every < 0) {
    return InvalidArgumentError("keep_every must be 0 (off) or positive, got " +
                                std::to_string(policy.keep_every));
  }
  // Ranks of the committed checkpoints counted from the newest (0 = newest).
  std::vector<int64_t> from_newest(listing.checkpoints.size(), -1);
  int64_t seen = 0;
  for (size_t i = listing.checkpoints.size(); i-- > 0;) {
    if (listing.checkpoints[i].committed) from_newest[i] = seen++;
  }
  GcPlan plan;
  for (size_t i = 0; i < listing.checkpoints.size(); ++i) {
    const StepCheckpoint& c = listing.checkpoints[i];
    GcDecision d{c, false, ""};
    if (!c.committed) {
      d.reason = "uncommitted";
    } else if (listing.latest == i) {
      d.reason = "latest";
    } else if (from_newest[i] < policy.keep_last) {
      d.reason = "keep-last";
    } else if (policy.keep_every > 0 && c.step % policy.keep_every == 0) {
      d.reason = "keep-every";
    } else {
      d.reason = "expired";
      d.remove = true;
    }
    plan.decisions.push_back(std::move(d));
  }
  return plan;
}

Status DeleteCheckpoint(std::string_view path, Store* store) {
  std::unique_ptr<Store> owned;
  SP_ASSIGN_OR_RETURN(Store * opened, StoreFor(path, store, &owned));
  Store& s = *opened;
  const std::string dir(path);
  bool removed_commit_point = false;
  for (const char* name : {kMetadataFileName, kDcpMetadataFileName}) {
    const std::string file = JoinPath(dir, name);
    SP_ASSIGN_OR_RETURN(bool exists, s.Exists(file));
    if (!exists) continue;
    SP_RETURN_IF_ERROR(s.RemoveFile(file));
    removed_commit_point = true;
  }
  if (removed_commit_point) SP_RETURN_IF_ERROR(s.SyncDir(dir));
  SP_RETURN_IF_ERROR(s.DropUnfinishedWrites(dir).status());
  SP_RETURN_IF_ERROR(RemoveContents(s, dir, 0));
  SP_RETURN_IF_ERROR(s.RemoveDir(dir));
  const std::string parent = ParentPath(NormalizePath(dir));
  return s.SyncDir(parent.empty() ? "." : parent);
}

Result<std::vector<std::string>> ExecuteGc(const GcPlan& plan, Store* store) {
  std::vector<std::string> removed;
  std::unique_ptr<Store> owned;  // one store for the whole plan (its checkpoints share a directory)
  for (const GcDecision& d : plan.decisions) {
    if (!d.remove) continue;
    if (!d.checkpoint.committed) {
      return InternalError("gc plan marks uncommitted checkpoint " + d.checkpoint.path);
    }
    if (store == nullptr) {
      SP_ASSIGN_OR_RETURN(store, StoreFor(d.checkpoint.path, nullptr, &owned));
    }
    Status status = DeleteCheckpoint(d.checkpoint.path, store);
    if (!status.ok()) {
      return Status(status.code(), "deleting checkpoint " + d.checkpoint.path + " (step " +
                                       std::to_string(d.checkpoint.step) +
                                       "): " + std::string(status.message()));
    }
    removed.push_back(d.checkpoint.path);
  }
  return removed;
}

}  // namespace sp
