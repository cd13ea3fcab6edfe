// RemoveUnreferencedFiles (cleanup.h): what the writers claim and the metadata does not name goes;
// everything else stays.
#include "shardpoint/engine/cleanup.h"

#include <gtest/gtest.h>

#include <set>

#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

std::set<std::string> Names(Store& store, std::string_view dir) {
  std::set<std::string> out;
  Result<std::vector<DirEntry>> entries = store.ListDir(dir);
  EXPECT_TRUE(entries.ok());
  for (const DirEntry& e : *entries) out.insert(e.name);
  return out;
}

TEST(RemoveUnreferencedFilesTest, RemovesOnlyLeftoversOfSaves) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c/sub").ok());
  const std::vector<std::string> names = {
      // named by the new metadata
      "d-new-r00000-f000.safetensors", "__0_0-new.distcp",
      // left by an earlier checkpoint or a failed save, of either format
      "d-old-r00000-f000.safetensors", "d-old-r00001-f000.safetensors.tmp",
      "shardpoint.metadata.tmp-old", "__0_0.distcp", "__1_0.distcp.tmp", ".metadata.tmp-old",
      // not a save's files
      "shardpoint.metadata", ".metadata", "notes.txt", "d-notes.txt", "__init__.py",
      "model.safetensors", "common.pt", "metadata.json"};
  for (const std::string& name : names) {
    ASSERT_TRUE(WriteFileDurably(store, "c", name, name + "~", "x").ok());
  }
  CheckpointMetadata md;
  md.files = {{"d-new-r00000-f000.safetensors", 0, 1, 0}, {"__0_0-new.distcp", 0, 1, 0}};
  RemoveUnreferencedFiles(store, "c", md);
  EXPECT_EQ(Names(store, "c"),
            (std::set<std::string>{"d-new-r00000-f000.safetensors", "__0_0-new.distcp",
                                   "shardpoint.metadata", ".metadata", "notes.txt", "d-notes.txt",
                                   "__init__.py", "model.safetensors", "common.pt",
                                   "metadata.json", "sub"}));
}

TEST(RemoveUnreferencedFilesTest, AMissingDirectoryIsNotAnError) {
  MemoryStore store;
  RemoveUnreferencedFiles(store, "absent", CheckpointMetadata());
  EXPECT_FALSE(*store.Exists("absent"));
}

}  // namespace
}  // namespace sp
