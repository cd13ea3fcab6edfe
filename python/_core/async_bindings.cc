// shardpoint._core.AsyncSaver: AsyncSaver with Python arguments.
//
// start() parses its arguments with the GIL held, then releases it for the copy into staging and
// returns; the background save runs without the GIL, taking it only inside the Python
// communicator's collectives. The communicator object of the running save is kept referenced until
// that save is over (the next start, or the saver's end). At interpreter exit, every save still
// running is waited for (an atexit hook), so that no background thread needs the GIL after
// Python has started shutting down.
#include <nanobind/stl/string.h>

#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/checkpoint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

class PyAsyncSaver;

// The savers alive in this process, for the exit hook.
std::mutex g_live_mu;
std::set<PyAsyncSaver*>* g_live = new std::set<PyAsyncSaver*>();

class PyAsyncSaver {
 public:
  explicit PyAsyncSaver(uint64_t staging_budget_bytes)
      : saver_(std::make_unique<AsyncSaver>(staging_budget_bytes)) {
    std::lock_guard<std::mutex> lock(g_live_mu);
    g_live->insert(this);
  }

  ~PyAsyncSaver() {
    {
      std::lock_guard<std::mutex> lock(g_live_mu);
      g_live->erase(this);
    }
    {
      nb::gil_scoped_release release;
      saver_.reset();  // waits for a running save
    }
    comm_.reset();  // with the GIL: it holds a Python reference
    fill_.reset();
    plan_cache_.reset();
  }

  PyAsyncSaver(const PyAsyncSaver&) = delete;
  PyAsyncSaver& operator=(const PyAsyncSaver&) = delete;

  void Start(const std::string& path, nb::handle tensors, nb::handle objects,
             const PySaveOptions& options, bool borrow) {
    std::unique_ptr<PreparedSave> prepared = PrepareSave(tensors, objects, options);
    Status status;
    {
      nb::gil_scoped_release release;
      status = saver_->Start(prepared->state, path, prepared->options,
                             borrow ? AsyncStaging::kBorrow : AsyncStaging::kCopy);
    }
    // Start waited for the previous save, so its communicator and fill are no longer in use; a
    // failed Start may still be taking part in its peers' save with them.
    comm_ = std::move(prepared->comm);
    fill_ = options.fill;
    plan_cache_ = options.plan_cache;
    ThrowIfError(status);
  }

  // This rank failed before it could stage its state: joins the peers' save with the failure
  // (code name, message) in the background, and raises it here.
  void StartFailed(const std::string& path, const std::string& code, const std::string& message,
                   const PySaveOptions& options) {
    StatusCode status_code = StatusCode::kInternal;
    for (int c = 1; c <= static_cast<int>(StatusCode::kDataLoss); ++c) {
      if (StatusCodeName(static_cast<StatusCode>(c)) == code) status_code = static_cast<StatusCode>(c);
    }
    std::unique_ptr<PreparedSave> prepared = PrepareSave(nb::list(), nb::list(), options);
    Status status;
    {
      nb::gil_scoped_release release;
      status = saver_->StartFailed(Status(status_code, message), path, prepared->options);
    }
    comm_ = std::move(prepared->comm);  // the background save may still be using it
    fill_.reset();
    plan_cache_ = options.plan_cache;
    ThrowIfError(status);
  }

  void Wait() {
    Status status;
    {
      nb::gil_scoped_release release;
      status = saver_->Wait();
    }
    if (!pending_.ok()) status = std::exchange(pending_, OkStatus());
    ThrowIfError(status);
  }

  bool Done() const { return saver_->Done(); }

  uint64_t staging_bytes() const { return saver_->staging_capacity_bytes(); }

  // Blocks until the running save (if any) is over, leaving its result for Wait. GIL released.
  void Drain() {
    Status result = saver_->Wait();
    if (pending_.ok()) pending_ = std::move(result);
  }

 private:
  std::unique_ptr<AsyncSaver> saver_;
  std::unique_ptr<PyCommunicator> comm_;
  nb::object fill_;  // the running save's SaveOptions.fill (its I/O threads call it)
  nb::object plan_cache_;  // the running save's SaveOptions.plan_cache
  Status pending_;  // a result taken by Drain, for the next Wait
};

// Waits for every running save; called by the atexit hook with the GIL held.
void WaitForAllSaves() {
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(g_live_mu);
  for (PyAsyncSaver* saver : *g_live) saver->Drain();
}

}  // namespace

void DefineAsyncSaver(nb::module_& m) {
  nb::class_<PyAsyncSaver>(m, "AsyncSaver",
                           "Saves in the background after copying the state into host staging "
                           "memory (reused across saves, bounded by staging_budget_bytes; 0: no "
                           "limit). One save at a time.")
      .def(nb::init<uint64_t>(), "staging_budget_bytes"_a = 0)
      .def("start", &PyAsyncSaver::Start, "path"_a, "tensors"_a, "objects"_a,
           "options"_a = PySaveOptions(), nb::kw_only(), "borrow"_a = false,
           "Waits for the previous save, copies the state into staging and starts the save (a\n"
           "SaveOptions says how); returns once the caller may modify its arrays. Makes no\n"
           "collective call: a rank that cannot stage raises here, and its peers' wait() raises\n"
           "the same error. borrow: the arrays are already the caller's own copy, left unchanged\n"
           "until the save is over (the next start or wait): written from as they are, nothing\n"
           "is staged. Pieces given as None are filled by options.fill in the background.")
      .def("start_failed", &PyAsyncSaver::StartFailed, "path"_a, "code"_a, "message"_a,
           "options"_a = PySaveOptions(),
           "For a rank that failed before start(): joins its peers' save with the error (status\n"
           "code name, message) so that their wait() raises it, and raises it here.")
      .def("wait", &PyAsyncSaver::Wait, "Waits for the save; raises StatusError if it failed.")
      .def("done", &PyAsyncSaver::Done, "True when no save is running.")
      .def_prop_ro("staging_bytes", &PyAsyncSaver::staging_bytes,
                   "Bytes of staging memory held for reuse.");
  m.def("_wait_for_all_async_saves", &WaitForAllSaves);
  nb::module_::import_("atexit").attr("register")(m.attr("_wait_for_all_async_saves"));
}

}  // namespace sp::python
