// Helpers shared by the tests of the torch.save, pickle and ZIP code and of the DCP driver.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_TEST_UTIL_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/status.h"
#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp::torch_save {

// A file of shardpoint/format/torch_dcp/testdata (written by testdata/make_testdata.py), where
// the torch.save archives torch wrote live beside the DCP checkpoints.
inline std::string TestData(std::string_view relative) {
  std::string path = std::string(SP_TORCH_DCP_TESTDATA) + "/" + std::string(relative);
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing fixture " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Pushes a row-major float32 tensor as torch.save pickles one
// (torch._utils._rebuild_tensor_v2): `numel` elements of storage `key` (a `storage_module`
// FloatStorage), viewed with `shape` from element `offset`.
// `strides` empty: row-major.
inline void PushFloatTensor(PickleWriter& w, std::string_view key, int64_t numel,
                            const std::vector<int64_t>& shape, int64_t offset = 0,
                            std::string_view storage_module = "torch",
                            std::vector<int64_t> strides = {}) {
  w.Global("torch._utils", "_rebuild_tensor_v2");
  w.Mark();  // the 6 arguments
  w.Mark();  // the 5 parts of the storage id
  w.String("storage");
  w.Global(storage_module, "FloatStorage");
  w.String(key);
  w.String("cpu");
  w.Int(numel);
  w.Tuple(5);
  w.BinPersId();
  w.Int(offset);
  for (int64_t d : shape) w.Int(d);
  w.Tuple(shape.size());
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  }
  for (int64_t s : strides) w.Int(s);
  w.Tuple(strides.size());
  w.Bool(false);
  w.Global("collections", "OrderedDict");
  w.Tuple(0);
  w.Reduce();
  w.Tuple(6);
  w.Reduce();
}

// A DCP tensor item: a torch.save archive of a float32 view (`shape`, `strides`, empty:
// row-major) of a storage of `numel` elements whose bytes are 0, 1, 2, ... as floats.
inline std::string FloatTensorItem(int64_t numel, const std::vector<int64_t>& shape,
                                   std::vector<int64_t> strides = {}) {
  PickleWriter w;
  PushFloatTensor(w, "0", numel, shape, 0, "torch", std::move(strides));
  std::string storage(static_cast<size_t>(numel) * 4, '\0');
  for (int64_t i = 0; i < numel; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(storage.data() + i * 4, &v, 4);
  }
  return BuildZip({{"archive/data.pkl", w.Finish()}, {"archive/version", "3\n"},
                   {"archive/data/0", storage}})
      .value();
}

// Expects `status` to fail with `code` and a message containing `fragment`.
#define SP_EXPECT_ERROR(expr, want_code, fragment)                                          \
  do {                                                                                 \
    ::sp::Status sp_s_ = (expr);                                                       \
    EXPECT_FALSE(sp_s_.ok()) << "expected an error containing: " << (fragment);        \
    EXPECT_EQ(sp_s_.code(), (want_code)) << sp_s_;                                          \
    EXPECT_NE(sp_s_.message().find(fragment), std::string::npos) << sp_s_;             \
  } while (0)

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_TEST_UTIL_H_
