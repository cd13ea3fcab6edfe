#include "python/_core/errors.h"

#include <nanobind/eval.h>

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

}  // namespace

void DefineStatusError(nb::module_& m) {
  nb::dict scope;
  scope["__builtins__"] = nb::module_::import_("builtins");
  scope["__name__"] = m.attr("__name__");
  nb::exec(nb::str(kStatusErrorSource), scope);
  nb::object type = scope["StatusError"];
  m.attr("StatusError") = type;
  g_status_error = type.ptr();
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
