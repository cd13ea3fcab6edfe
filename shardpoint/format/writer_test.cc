// Choosing a save's writer (writer.h): the one place formats are told apart on the write side.
#include "shardpoint/format/writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

namespace sp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CheckpointWriterTest, EachSaveFormatHasItsWriter) {
  Result<std::unique_ptr<CheckpointWriter>> native =
      MakeCheckpointWriter(CheckpointFormat::kNative, false);
  ASSERT_TRUE(native.ok());
  EXPECT_EQ((*native)->kind(), "native");
  Result<std::unique_ptr<CheckpointWriter>> dcp =
      MakeCheckpointWriter(CheckpointFormat::kTorchDcp, false);
  ASSERT_TRUE(dcp.ok());
  EXPECT_EQ((*dcp)->kind(), "torch-dcp");
  Result<std::unique_ptr<CheckpointWriter>> megatron =
      MakeCheckpointWriter(CheckpointFormat::kTorchDcp, true);
  ASSERT_TRUE(megatron.ok());
  EXPECT_EQ((*megatron)->kind(), "megatron");
  EXPECT_EQ((*megatron)->format(), CheckpointFormat::kTorchDcp);
}

TEST(CheckpointWriterTest, FormatsThatCannotBeSavedAreRefused) {
  Result<std::unique_ptr<CheckpointWriter>> st =
      MakeCheckpointWriter(CheckpointFormat::kSafetensors, false);
  EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.status().message(),
              HasSubstr("cannot save in the safetensors format (use consolidation)"));
  Result<std::unique_ptr<CheckpointWriter>> native_megatron =
      MakeCheckpointWriter(CheckpointFormat::kNative, true);
  EXPECT_EQ(native_megatron.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(native_megatron.status().message(),
              HasSubstr("a Megatron checkpoint is a torch-dcp checkpoint"));
}

// Every kind once, and no file is claimed by two kinds of different formats (the engine's
// cleanup asks each writer in turn).
TEST(CheckpointWriterTest, AllWritersAreDistinctKinds) {
  std::vector<std::string> kinds;
  std::set<std::string_view> metadata_names;
  for (const std::unique_ptr<CheckpointWriter>& w : AllCheckpointWriters()) {
    kinds.emplace_back(w->kind());
    metadata_names.insert(w->metadata_file_name());
    EXPECT_FALSE(w->OwnsFile(w->metadata_file_name())) << w->kind();
  }
  EXPECT_THAT(kinds, ElementsAre("native", "torch-dcp", "megatron"));
  EXPECT_EQ(metadata_names, (std::set<std::string_view>{"shardpoint.metadata", ".metadata"}));
  for (const char* name : {"d-s-r00000-f000.safetensors", "__0_0.distcp",
                           "shardpoint.metadata.tmp-s", ".metadata.tmp-s"}) {
    std::set<CheckpointFormat> claimed_by;
    for (const std::unique_ptr<CheckpointWriter>& w : AllCheckpointWriters()) {
      if (w->OwnsFile(name)) claimed_by.insert(w->format());
    }
    EXPECT_EQ(claimed_by.size(), 1u) << name;
  }
}

}  // namespace
}  // namespace sp
