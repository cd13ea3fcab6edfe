#include "shardpoint/engine/cleanup.h"

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "shardpoint/format/writer.h"

namespace sp {

void RemoveUnreferencedFiles(Store& store, std::string_view path,
                             const CheckpointMetadata& metadata) {
  Result<std::vector<DirEntry>> entries = store.ListDir(path);
  if (!entries.ok()) return;
  std::set<std::string> keep;
  for (const DataFile& f : metadata.files) keep.insert(f.name);
  const std::vector<std::unique_ptr<CheckpointWriter>> writers = AllCheckpointWriters();
  for (const DirEntry& e : *entries) {
    if (e.is_directory || keep.count(e.name)) continue;
    for (const std::unique_ptr<CheckpointWriter>& writer : writers) {
      if (writer->OwnsFile(e.name)) {
        store.RemoveFile(JoinPath(path, e.name)).IgnoreError();
        break;
      }
    }
  }
}

}  // namespace sp
