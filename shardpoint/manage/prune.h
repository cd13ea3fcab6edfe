// Prune: removes every tensor and object under given key prefixes from a native checkpoint, in
// place, rewriting only what must change.
//
// A prefix is a plain string prefix of the key ("optim." removes "optim.state.w.exp_avg" and
// "optim.step"; "model.layers.1" would also remove "model.layers.10.w": end the prefix with '.'
// to take one subtree). Every prefix must match at least one tensor or object.
//
// What is rewritten. A data file that holds no chunk of a pruned tensor stays as it is (same name,
// same bytes). A data file that holds pruned chunks and nothing else is dropped. A data file that
// holds pruned chunks and others is rewritten under a new name
// (`d-<save_id>.p<tag>-r<rank>-f<k>.safetensors`, a fresh random tag per prune) with only the
// remaining chunks, copied in bounded pieces and verified against their block checksums while
// they are copied (a mismatch is kDataLoss naming the tensor, the chunk and the file, and
// nothing is committed). The chunks' checksums carry over unchanged: they cover chunk bytes,
// not file offsets.
//
// Commit protocol (docs/FORMAT.md §4). New data files are written under `<name>.tmp`, fsynced,
// closed and renamed; the directory is fsynced; the new metadata goes to
// `shardpoint.metadata.tmp-<save_id>`, is fsynced, renamed over `shardpoint.metadata` and the
// directory is fsynced. Only then are the dropped and rewritten old files removed (best effort:
// leftovers are garbage by the format's rules and the next save or prune removes them). A crash
// at any point leaves either the old or the new checkpoint committed and loadable; a failure
// before the commit removes the new files it wrote. The new metadata is written as version 1.0
// with the same save_id, world size, checksum block size and attributes.
//
// Thread-safety: one call per checkpoint at a time; nothing else may write the checkpoint while
// it runs (a concurrent loader sees the old or the new checkpoint, but a reader that opened the
// old metadata may find old data files gone after the commit).
#ifndef SHARDPOINT_MANAGE_PRUNE_H_
#define SHARDPOINT_MANAGE_PRUNE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/store/store.h"

namespace sp {

struct PruneOptions {
  Store* store = nullptr;                           // null: the POSIX file system
  bool dry_run = false;                             // plan and report; change nothing
  uint64_t copy_buffer_bytes = uint64_t{16} << 20;  // bounded memory for copying chunks
};

struct PruneReport {
  std::vector<std::string> tensors_removed;  // sorted
  std::vector<std::string> objects_removed;  // sorted
  uint64_t tensor_bytes_removed = 0;         // logical bytes of the removed tensors
  std::vector<std::string> files_untouched;  // data files kept as they are
  std::vector<std::string> files_dropped;    // old data files that held only pruned chunks
  std::vector<std::string> files_rewritten;  // old data files replaced by a new one
  std::vector<std::string> files_written;    // the new data files (same order as rewritten)
  uint64_t bytes_copied = 0;                 // chunk bytes copied into the new files
};

// Prunes the checkpoint at `path`. Errors:
//   kInvalidArgument   no prefix, or an empty one;
//   kNotFound          no committed checkpoint at `path`, or a prefix that matches nothing (the
//                      message names the prefix);
//   kFailedPrecondition the checkpoint is not in the native format;
//   kDataLoss          a chunk to copy fails its checksum;
//   storage errors name the file. On any error before the commit the checkpoint is unchanged.
Result<PruneReport> Prune(std::string_view path, const std::vector<std::string>& prefixes,
                          const PruneOptions& options = {});

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_PRUNE_H_
