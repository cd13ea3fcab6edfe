#include "python/_core/errors.h"

#include <nanobind/eval.h>

#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace nb = nanobind;

namespace sp::python {
namespace {

// The exception type, owned by the module (kept alive by the module's dict).
PyObject* g_status_error = nullptr;

constexpr const char* kStatusErrorSource = R"(
class StatusError(Exception):
    """A shardpoint operation failed.

    Attributes:
        code: the status code's name, e.g. "NOT_FOUND", "DATA_LOSS", "ALREADY_EXISTS".
        message: what failed; names the file, the tensor, and what was expected versus found.
    """

    def __init__(self, message: str, code: str = "UNKNOWN"):
        super().__init__(message)
        self.message = message
        self.code = code

    def __reduce__(self):
        return (type(self), (self.message, self.code))
)";

// Sets StatusError(RESOURCE_EXHAUSTED) as the pending Python error (an exception translator must
// not throw a python_error).
void RaiseOutOfMemory(const char* what) {
  const std::string message =
      std::string("out of memory: an allocation failed (") + what + ")";
  const std::string_view code = StatusCodeName(StatusCode::kResourceExhausted);
  nb::object error = nb::borrow(g_status_error)(nb::str(message.data(), message.size()),
                                                nb::str(code.data(), code.size()));
  PyErr_SetObject(g_status_error, error.ptr());
}

}  // namespace

void DefineStatusError(nb::module_& m) {
  nb::dict scope;
  scope["__builtins__"] = nb::module_::import_("builtins");
  scope["__name__"] = m.attr("__name__");
  nb::exec(nb::str(kStatusErrorSource), scope);
  nb::object type = scope["StatusError"];
  m.attr("StatusError") = type;
  g_status_error = type.ptr();
  // A size read from a hostile checkpoint can make an allocation fail in a path that has no
  // Status to return (a decoder sizing a buffer); the caller sees a checkpoint error
  // (RESOURCE_EXHAUSTED), like the CLI's "out of memory" exit, not a bare MemoryError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::bad_alloc& e) {
      RaiseOutOfMemory(e.what());
    } catch (const std::length_error& e) {
      RaiseOutOfMemory(e.what());
    }
  });
}

void RaiseStatus(const Status& status) {
  const std::string_view code = StatusCodeName(status.code());
  nb::object error = nb::borrow(g_status_error)(
      nb::str(status.message().data(), status.message().size()),
      nb::str(code.data(), code.size()));
  PyErr_SetObject(g_status_error, error.ptr());
  throw nb::python_error();
}

std::string DescribePythonError(const nb::python_error& error) {
  nb::handle value = error.value();
  std::string type_name = nb::type_name(value.type()).c_str();
  const size_t dot = type_name.rfind('.');
  if (dot != std::string::npos) type_name = type_name.substr(dot + 1);
  nb::str text = nb::str(value);
  std::string message = text.c_str();
  return message.empty() ? type_name : type_name + ": " + message;
}

}  // namespace sp::python
