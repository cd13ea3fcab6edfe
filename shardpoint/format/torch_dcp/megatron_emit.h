// Re-emitting inert pickle trees as protocol-2 pickles inside new torch.save archives (used by
// megatron.cc to cut common.pt into one archive per object and to build common.pt from objects).
//
// A source archive is opened with every global allowed and persistent ids accepted: its data.pkl
// becomes a PickleTree (torch_save/pickle.h), which is data only. ArchiveEmitter writes values of
// such trees back through a PickleWriter (objects as GLOBAL + REDUCE / NEWOBJ, SETITEMS and BUILD,
// as the source had them; NEWOBJ_EX as copyreg.__newobj_ex__; sets as builtins.set(list)) and
// copies the storage records that persistent ids name, under fresh keys. Shared subtrees are
// written once per use; recursion is capped at kMaxPickleWalkDepth and the number of values written
// at kMaxReemittedValues, so hostile cycles and blow-ups end in kDataLoss. Not thread-safe; one
// emitter per archive.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_EMIT_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_EMIT_H_

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/torch_save/pickle.h"
#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp::torch_dcp {

// A torch.save archive opened for re-emission; `bytes` must outlive it.
struct SourceArchive {
  ByteView bytes;
  torch_save::ZipDirectory dir;
  std::string prefix;  // the archive's folder, e.g. "common/"
  torch_save::PickleTree pickle;
};

// Opens a torch.save archive: directory, little-endian byteorder (big-endian is
// kUnimplemented), data.pkl of at most kMaxDataPklBytes unpickled inertly. kDataLoss naming
// `what` otherwise.
Result<SourceArchive> OpenSourceArchive(ByteView bytes, std::string_view what);

class ArchiveEmitter {
 public:
  explicit ArchiveEmitter(std::string_view what) : what_(what) {}

  // The writer, for callers that push containers around emitted values.
  torch_save::PickleWriter& writer() { return writer_; }
  // Pushes `v` (a value of `source`'s tree), copying the storages it refers to. `depth`: how
  // deep `v` sits in the archive being written; the limits (kMaxPickleWalkDepth levels,
  // kMaxReemittedValues values) count from that archive's root, as its readers count.
  Status Emit(const torch_save::PickleValue& v, const SourceArchive& source, int depth = 0);
  // Counts one value the caller pushes itself at `depth` (a container around emitted values, a
  // key, a placeholder) against the same limits.
  Status Count(int depth);
  // Writes STOP and returns the archive (records under `folder`, e.g. "archive/"). The emitter
  // must not be used afterwards.
  Result<std::string> Finish(std::string_view folder);

 private:
  Status EmitAt(const torch_save::PickleValue& v, const SourceArchive& source, int depth);
  Status EmitObject(const torch_save::PickleValue& v, const SourceArchive& source, int depth);
  Status EmitItems(const std::vector<const torch_save::PickleValue*>& items,
                   const SourceArchive& source, int depth);
  Status EmitStorage(const torch_save::PickleValue& id, const SourceArchive& source, int depth);
  Status Err(const std::string& problem) const;

  std::string what_;
  torch_save::PickleWriter writer_;
  std::vector<std::pair<std::string, std::string>> storages_;  // new key, bytes
  std::map<std::string, std::string> keys_;                    // source key -> new key (this Emit)
  uint64_t values_ = 0;
};

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_MEGATRON_EMIT_H_
