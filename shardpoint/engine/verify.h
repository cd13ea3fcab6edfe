// Verify: checks a committed checkpoint of any format against its metadata (verify.cc).
//
// A checkpoint is a directory of data files plus one metadata file; it exists only once the
// metadata is committed. Every rank calls the same function with its own state; ranks exchange
// plans through a Communicator (null: one rank in this process). Errors: a Status or Result;
// inside a collective call, if any rank fails every rank returns the same error (docs/DESIGN.md
// decision 5). Thread-safety: one call per rank at a time.
#ifndef SHARDPOINT_ENGINE_VERIFY_H_
#define SHARDPOINT_ENGINE_VERIFY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

struct VerifyReport {
  std::vector<std::string> defects;  // empty when the checkpoint is sound
  // Remarks that are not defects: symbolic links that stay inside the checkpoint directory, and
  // links out of it when the store allows them (docs/FORMAT.md, "Symbolic links").
  std::vector<std::string> notes;
  uint64_t files_checked = 0;
  uint64_t chunks_checked = 0;
  uint64_t bytes_checked = 0;
  // False for formats that store no checksums (torch-dcp, safetensors): only the presence and
  // size of each file, the structure the driver parsed, and coverage were checked.
  bool has_checksums = true;
  bool ok() const { return defects.empty(); }
};

// Checks every file's presence, size and header (a native data file's entries and its
// "__metadata__" block), every checksum block, every chunk a driver must decode (compressed or
// strided DCP items, decoded exactly as a load decodes them), and the coverage of every tensor
// (counted with checked arithmetic), and reports every symbolic link below the checkpoint
// directory (a link out of it is a defect unless the store allows external links). Defects are
// reported, not returned as errors; an error means the checkpoint could not be examined at all
// (no metadata, unreadable metadata, or sizes past the limits every reader applies:
// format/metadata.h ValidateCheckpointSizes), which load refuses too.
Result<VerifyReport> Verify(std::string_view path, Store* store = nullptr, ThreadPool* pool = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_VERIFY_H_
