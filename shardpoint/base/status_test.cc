#include "shardpoint/base/status.h"

#include <cerrno>

#include <gtest/gtest.h>

#include "shardpoint/base/result.h"

namespace sp {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  SP_ASSIGN_OR_RETURN(int h, Half(x));
  SP_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckQuarter(int x) {
  SP_RETURN_IF_ERROR(Quarter(x).status());
  return OkStatus();
}

TEST(StatusTest, OkAndErrorsCarryCodeAndMessage) {
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_EQ(OkStatus().ToString(), "OK");
  Status s = NotFoundError("file /x/y missing");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: file /x/y missing");
  EXPECT_EQ(s.WithContext("load").message(), "load: file /x/y missing");
  EXPECT_TRUE(OkStatus().WithContext("x").ok());
}

TEST(StatusTest, ErrnoMapping) {
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open a").code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatus(ENOSPC, "write a").code(), StatusCode::kResourceExhausted);
  EXPECT_NE(ErrnoToStatus(ENOSPC, "write a").message().find("write a: "), std::string::npos);
}

TEST(ResultTest, PropagatesThroughMacros) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "odd: 3");
  EXPECT_EQ(CheckQuarter(2).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckQuarter(4).ok());
}

TEST(ResultTest, OkStatusWithoutValueBecomesInternal) {
  Result<int> r = OkStatus();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(ResultTest, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

}  // namespace
}  // namespace sp
