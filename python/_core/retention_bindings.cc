// list_checkpoints, plan_gc, gc and delete_checkpoint over the retention library
// (shardpoint/manage/retention.h). Each runs with the GIL released and raises StatusError on
// failure.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/manage.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

nb::dict CheckpointToPython(const StepCheckpoint& c) {
  nb::dict d;
  d["step"] = c.step;
  d["name"] = c.name;
  d["path"] = c.path;
  d["bytes"] = c.bytes;
  d["committed"] = c.committed;
  d["format"] = c.format;
  d["problem"] = c.problem;
  return d;
}

nb::dict ListingToPython(const CheckpointListing& listing) {
  nb::list checkpoints;
  for (const StepCheckpoint& c : listing.checkpoints) checkpoints.append(CheckpointToPython(c));
  nb::dict out;
  out["directory"] = listing.directory;
  out["checkpoints"] = checkpoints;
  out["latest"] = listing.latest ? nb::cast(*listing.latest) : nb::none();
  return out;
}

nb::list PlanToPython(const GcPlan& plan) {
  nb::list decisions;
  for (const GcDecision& d : plan.decisions) {
    nb::dict item = CheckpointToPython(d.checkpoint);
    item["remove"] = d.remove;
    item["reason"] = d.reason;
    decisions.append(item);
  }
  return decisions;
}

CheckpointListing ListReleased(const std::string& directory) {
  Result<CheckpointListing> listing = InternalError("list_checkpoints did not run");
  {
    nb::gil_scoped_release release;
    listing = ListCheckpoints(directory);
  }
  return ValueOrThrow(std::move(listing));
}

// Lists and plans; with `execute`, also deletes. Returns (decisions, removed paths).
nb::tuple Gc(const std::string& directory, int64_t keep_last, int64_t keep_every, bool execute) {
  Result<GcPlan> plan = InternalError("gc did not run");
  Result<std::vector<std::string>> removed = std::vector<std::string>();
  {
    nb::gil_scoped_release release;
    Result<CheckpointListing> listing = ListCheckpoints(directory);
    plan = listing.ok() ? PlanGc(*listing, RetentionPolicy{keep_last, keep_every})
                        : Result<GcPlan>(listing.status());
    if (plan.ok() && execute) removed = ExecuteGc(*plan, nullptr);
  }
  GcPlan p = ValueOrThrow(std::move(plan));
  return nb::make_tuple(PlanToPython(p), nb::cast(ValueOrThrow(std::move(removed))));
}

void DeleteOne(const std::string& path) {
  Status status;
  {
    nb::gil_scoped_release release;
    status = DeleteCheckpoint(path);
  }
  ThrowIfError(status);
}

}  // namespace

void DefineRetentionFunctions(nb::module_& m) {
  m.def(
      "list_checkpoints", [](const std::string& d) { return ListingToPython(ListReleased(d)); },
      "directory"_a,
      "The step checkpoints in `directory` as {directory, checkpoints: [{step, name, path,\n"
      "bytes, committed, format, problem}], latest: index of the newest committed or None}.");
  m.def(
      "plan_gc",
      [](const std::string& d, int64_t keep_last, int64_t keep_every) {
        return Gc(d, keep_last, keep_every, false)[0];
      },
      "directory"_a, nb::kw_only(), "keep_last"_a, "keep_every"_a = 0,
      "What gc would do: one dict per checkpoint with `remove` and `reason`.");
  m.def("gc", &Gc, "directory"_a, nb::kw_only(), "keep_last"_a, "keep_every"_a = 0,
        "execute"_a = true,
        "Deletes the expired step checkpoints (never the newest committed one, never an\n"
        "uncommitted one). Returns (decisions, removed paths).");
  m.def("delete_checkpoint", &DeleteOne, "path"_a,
        "Deletes one checkpoint directory, its metadata first.");
}

}  // namespace sp::python
