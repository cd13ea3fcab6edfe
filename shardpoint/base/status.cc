#include "shardpoint/base/status.h"

#include <cerrno>
#include <cstring>

namespace sp {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string message)
    : code_(code), message_(code == StatusCode::kOk ? std::string() : std::move(message)) {}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string message(context);
  message += ": ";
  message += message_;
  return Status(code_, std::move(message));
}

std::ostream& operator<<(std::ostream& os, const Status& status) {
  return os << status.ToString();
}

#define SP_DEFINE_ERROR_(Name, Code) \
  Status Name(std::string message) { return Status(StatusCode::Code, std::move(message)); }
SP_DEFINE_ERROR_(CancelledError, kCancelled)
SP_DEFINE_ERROR_(UnknownError, kUnknown)
SP_DEFINE_ERROR_(InvalidArgumentError, kInvalidArgument)
SP_DEFINE_ERROR_(DeadlineExceededError, kDeadlineExceeded)
SP_DEFINE_ERROR_(NotFoundError, kNotFound)
SP_DEFINE_ERROR_(AlreadyExistsError, kAlreadyExists)
SP_DEFINE_ERROR_(PermissionDeniedError, kPermissionDenied)
SP_DEFINE_ERROR_(ResourceExhaustedError, kResourceExhausted)
SP_DEFINE_ERROR_(FailedPreconditionError, kFailedPrecondition)
SP_DEFINE_ERROR_(AbortedError, kAborted)
SP_DEFINE_ERROR_(OutOfRangeError, kOutOfRange)
SP_DEFINE_ERROR_(UnimplementedError, kUnimplemented)
SP_DEFINE_ERROR_(InternalError, kInternal)
SP_DEFINE_ERROR_(UnavailableError, kUnavailable)
SP_DEFINE_ERROR_(DataLossError, kDataLoss)
#undef SP_DEFINE_ERROR_

Status ErrnoToStatus(int error_number, std::string_view what) {
  std::string message(what);
  message += ": ";
  message += std::strerror(error_number);
  message += " (errno " + std::to_string(error_number) + ")";
  StatusCode code = StatusCode::kInternal;
  switch (error_number) {
    case ENOENT: case ENOTDIR: code = StatusCode::kNotFound; break;
    case EEXIST: case ENOTEMPTY: code = StatusCode::kAlreadyExists; break;
    case EACCES: case EPERM: case EROFS: code = StatusCode::kPermissionDenied; break;
    case ENOSPC: case EDQUOT: case EMFILE: case ENFILE: case ENOMEM:
      code = StatusCode::kResourceExhausted; break;
    case EIO: code = StatusCode::kDataLoss; break;
    case EINVAL: case EISDIR: case ENAMETOOLONG: code = StatusCode::kInvalidArgument; break;
    case EAGAIN: case EINTR: case EBUSY: code = StatusCode::kUnavailable; break;
    default: break;
  }
  return Status(code, std::move(message));
}

}  // namespace sp
