// Status: the outcome of an operation that can fail.
//
// Failure is routine in checkpoint I/O, so errors are values: they travel through thread pools and
// plan exchanges like any other data. A Status is either OK or carries a code (meanings follow
// absl::StatusCode) and a message that names the file, the tensor, and what was expected versus
// found. Status is a cheap value type; it is not thread-safe to mutate one instance concurrently.
#ifndef SHARDPOINT_BASE_STATUS_H_
#define SHARDPOINT_BASE_STATUS_H_

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace sp {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

// "INVALID_ARGUMENT", "NOT_FOUND", ...
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "NOT_FOUND: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message". OK stays OK.
  Status WithContext(std::string_view context) const;

  // Explicitly discards the status (for best-effort cleanup paths).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

inline Status OkStatus() { return Status(); }
Status CancelledError(std::string message);
Status UnknownError(std::string message);
Status InvalidArgumentError(std::string message);
Status DeadlineExceededError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status AbortedError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);

// Maps an errno value from a failed system call to a Status: "<what>: <strerror> (errno N)".
// ENOENT -> kNotFound, EEXIST -> kAlreadyExists, EACCES/EPERM -> kPermissionDenied,
// ENOSPC/EDQUOT -> kResourceExhausted, EIO -> kDataLoss, others -> kInternal / kInvalidArgument.
Status ErrnoToStatus(int error_number, std::string_view what);

}  // namespace sp

#define SP_STATUS_CONCAT_INNER_(a, b) a##b
#define SP_STATUS_CONCAT_(a, b) SP_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define SP_RETURN_IF_ERROR(expr)                                       \
  do {                                                                 \
    ::sp::Status sp_status_macro_ = (expr);                            \
    if (!sp_status_macro_.ok()) return sp_status_macro_;               \
  } while (0)

#endif  // SHARDPOINT_BASE_STATUS_H_
