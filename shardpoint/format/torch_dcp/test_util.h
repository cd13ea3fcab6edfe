// Helpers shared by the torch_dcp tests (and those of torch_save/test_util.h).
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_save/test_util.h"
#include "shardpoint/store/store.h"

namespace sp::torch_dcp {

using torch_save::FloatTensorItem;
using torch_save::PushFloatTensor;

using torch_save::TestData;

// A DCP checkpoint at `dir` of `store`: one float32 tensor `fqn` of global `size` stored as one
// chunk (the whole tensor) in item `item` of __0_0.distcp, with the given stream transforms.
// .metadata is written by EncodeDcpMetadata, which checks structure but not sizes.
inline void WriteOneItemDcp(Store& store, const std::string& dir, const std::string& fqn,
                            const Shape& size, const std::string& item,
                            std::vector<std::string> transforms = {}) {
  DcpMetadata md;
  DcpEntry e;
  e.fqn = fqn;
  e.kind = DcpEntry::Kind::kTensor;
  e.properties.dtype = DType::kFloat32;
  e.size = size;
  e.chunks.push_back(Box(std::vector<int64_t>(size.size(), 0), size));
  md.state_dict_metadata.push_back(e);
  DcpStorageEntry s;
  s.fqn = fqn;
  s.chunk_offsets = std::vector<int64_t>(size.size(), 0);
  s.relative_path = "__0_0.distcp";
  s.offset = 0;
  s.length = item.size();
  s.transform_descriptors = std::move(transforms);
  md.storage_data.push_back(s);
  Result<std::string> encoded = EncodeDcpMetadata(md);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  ASSERT_TRUE(store.CreateDirs(dir).ok());
  for (const auto& [name, bytes] : {std::pair<std::string, std::string>{".metadata", *encoded},
                                    {"__0_0.distcp", item}}) {
    auto out = store.NewWritableFile(JoinPath(dir, name));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
    ASSERT_TRUE((*out)->Close().ok());
  }
}

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_
