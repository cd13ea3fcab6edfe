// Result<T>: a value of type T, or the Status that explains why there is none.
//
// Like tensorstore's Result and absl::StatusOr. A Result built from an OK Status is a programming
// error and is turned into kInternal. Access value() only after checking ok().
#ifndef SHARDPOINT_BASE_RESULT_H_
#define SHARDPOINT_BASE_RESULT_H_

#include <cassert>
#include <optional>
#include <type_traits>
#include <utility>

#include "shardpoint/base/status.h"

namespace sp {

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(const T& value) : value_(value) {}             // NOLINT: implicit by design
  Result(T&& value) : value_(std::move(value)) {}       // NOLINT
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = InternalError("Result constructed from an OK status without value");
  }
  template <typename U,
            typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                        !std::is_same_v<std::decay_t<U>, T> &&
                                        !std::is_same_v<std::decay_t<U>, Status> &&
                                        !std::is_same_v<std::decay_t<U>, Result<T>>>>
  Result(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  const Status& status() const& {
    static const Status* const kOk = new Status();
    return ok() ? *kOk : status_;
  }
  Status status() && { return ok() ? Status() : std::move(status_); }

  T& value() & { assert(ok()); return *value_; }
  const T& value() const& { assert(ok()); return *value_; }
  T&& value() && { assert(ok()); return std::move(*value_); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace sp

// SP_ASSIGN_OR_RETURN(lhs, expr): evaluates expr (a Result); on error returns its Status,
// otherwise assigns the value to lhs (which may be a declaration: `auto x`).
#define SP_ASSIGN_OR_RETURN(lhs, expr) \
  SP_ASSIGN_OR_RETURN_IMPL_(SP_STATUS_CONCAT_(sp_result_, __LINE__), lhs, expr)
#define SP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

#endif  // SHARDPOINT_BASE_RESULT_H_
