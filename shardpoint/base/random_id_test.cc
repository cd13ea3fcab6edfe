#include "shardpoint/base/random_id.h"

#include <set>
#include <string>

#include <gtest/gtest.h>

namespace sp {
namespace {

TEST(RandomHexId, HasTheDigitsAskedForAndDoesNotRepeat) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = RandomHexId(12);
    ASSERT_EQ(id.size(), 12u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(RandomHexId(6).size(), 6u);
  EXPECT_EQ(RandomHexId(40).size(), 16u);  // 64 bits of randomness at most
}

}  // namespace
}  // namespace sp
