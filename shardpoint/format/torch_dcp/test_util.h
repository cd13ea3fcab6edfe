// Helpers shared by the torch_dcp tests.
#ifndef SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_
#define SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "shardpoint/base/status.h"

namespace sp::torch_dcp {

// A file of shardpoint/format/torch_dcp/testdata (written by testdata/make_testdata.py).
inline std::string TestData(std::string_view relative) {
  std::string path = std::string(SP_TORCH_DCP_TESTDATA) + "/" + std::string(relative);
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing fixture " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Expects `status` to fail with `code` and a message containing `fragment`.
#define SP_EXPECT_ERROR(expr, want_code, fragment)                                          \
  do {                                                                                 \
    ::sp::Status sp_s_ = (expr);                                                       \
    EXPECT_FALSE(sp_s_.ok()) << "expected an error containing: " << (fragment);        \
    EXPECT_EQ(sp_s_.code(), (want_code)) << sp_s_;                                          \
    EXPECT_NE(sp_s_.message().find(fragment), std::string::npos) << sp_s_;             \
  } while (0)

}  // namespace sp::torch_dcp

#endif  // SHARDPOINT_FORMAT_TORCH_DCP_TEST_UTIL_H_
