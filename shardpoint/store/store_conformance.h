// The conformance suite every Store implementation runs (like tensorstore's kvstore/test_util).
//
// A store's test binary links the `sp_store_conformance` target and instantiates the suite with a
// factory that makes a fresh store rooted in a fresh, empty directory:
//
//   INSTANTIATE_TEST_SUITE_P(Memory, StoreConformanceTest,
//                            ::testing::Values(StoreConformanceParam{"Memory", MakeMemoryEnv}),
//                            StoreConformanceParamName);
//
// The suite covers every Store method, the error codes and messages the Store contract promises,
// concurrent WriteAt / ReadAt on disjoint ranges, and (where the store supports sparse files)
// offsets beyond 4 GiB.
#ifndef SHARDPOINT_STORE_STORE_CONFORMANCE_H_
#define SHARDPOINT_STORE_STORE_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/base/result.h"
#include "shardpoint/store/store.h"

namespace sp {

// One store under test. Destroyed in reverse order: `cleanup` runs after `store` and `base` are
// gone (for example to remove a temporary directory).
struct StoreTestEnv {
  std::function<void()> cleanup;   // may be empty
  std::unique_ptr<Store> base;     // a store that `store` wraps, or null
  std::unique_ptr<Store> store;    // the store under test
  std::string root;                // an existing, empty directory of `store`

  StoreTestEnv() = default;
  StoreTestEnv(StoreTestEnv&& other) noexcept;
  StoreTestEnv& operator=(StoreTestEnv&& other) noexcept;
  ~StoreTestEnv();

 private:
  void Release();
};

struct StoreConformanceParam {
  std::string name;                            // test name suffix: letters, digits, '_'
  std::function<Result<StoreTestEnv>()> make;  // a fresh store and root for each test
  bool large_sparse_files = false;             // run the test that writes beyond 4 GiB
  // Whether a file open for writing keeps writing to it across a rename of it (POSIX handles do;
  // an object store's file exists only once closed).
  bool handles_follow_renames = true;
  // When set and it returns a reason, every test skips with it (a store whose server is absent).
  std::function<std::optional<std::string>()> unavailable;
};

// Prints the name, for readable test output.
void PrintTo(const StoreConformanceParam& param, std::ostream* os);

std::string StoreConformanceParamName(
    const ::testing::TestParamInfo<StoreConformanceParam>& info);

class StoreConformanceTest : public ::testing::TestWithParam<StoreConformanceParam> {
 protected:
  void SetUp() override;
  void TearDown() override;

  Store& store() { return *env_.store; }
  // `name` under the root directory.
  std::string Path(std::string_view name) const { return JoinPath(env_.root, name); }
  // Creates `path` holding `content` (written in one WriteAt, synced, closed).
  Status WriteWholeFile(std::string_view path, std::string_view content);

  StoreTestEnv env_;
};

}  // namespace sp

#endif  // SHARDPOINT_STORE_STORE_CONFORMANCE_H_
