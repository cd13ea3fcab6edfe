// Translation of shardpoint's Status into Python exceptions: the one place the binding does it.
//
// Every non-OK Status raised to Python becomes shardpoint._core.StatusError, whose `code` is the
// status code's name ("NOT_FOUND", "DATA_LOSS", ...) and whose `message` (and str()) is the
// status message. Malformed arguments from Python (wrong types, arrays whose size does not match
// the piece they describe) are ValueError / TypeError raised by the argument parsers, not
// StatusError. All functions here must be called with the GIL held.
#ifndef SHARDPOINT_PYTHON_CORE_ERRORS_H_
#define SHARDPOINT_PYTHON_CORE_ERRORS_H_

#include <nanobind/nanobind.h>

#include <string>

#include "shardpoint/base/result.h"
#include "shardpoint/base/status.h"

namespace sp::python {

// Defines StatusError in module `m` and registers the translation of std::bad_alloc and
// std::length_error escaping a binding into StatusError(RESOURCE_EXHAUSTED). Called once, from
// the module initializer.
void DefineStatusError(nanobind::module_& m);

// Raises StatusError for `status` (which must not be OK) as a C++ nanobind::python_error.
[[noreturn]] void RaiseStatus(const Status& status);

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) RaiseStatus(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) RaiseStatus(result.status());
  return std::move(result).value();
}

// "ValueError: message" text of the Python exception held by `error` ("RuntimeError" when the
// exception has an empty message). For error messages that cross back into C++.
std::string DescribePythonError(const nanobind::python_error& error);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_ERRORS_H_
