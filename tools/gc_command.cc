// shardpoint gc DIR --keep-last K [--keep-every N] [--dry-run] [--json]
#include <iostream>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kGcUsage[] =
    "usage: shardpoint gc DIR --keep-last K [--keep-every N] [--dry-run] [--json]\n"
    "\n"
    "Deletes old step checkpoints in DIR (see 'shardpoint list'), keeping the K committed ones\n"
    "with the highest steps and every committed one whose step is a multiple of N. Whatever the\n"
    "options say, the newest committed checkpoint is never deleted, and neither is an uncommitted\n"
    "one (it may be a save in progress). A checkpoint's metadata is deleted first, so one whose\n"
    "deletion is interrupted is left uncommitted, never committed with data missing.\n"
    "  --keep-last K    committed checkpoints to keep, newest first (K >= 1; required)\n"
    "  --keep-every N   also keep the committed checkpoints whose step is a multiple of N\n"
    "  --dry-run        print what would be deleted; delete nothing\n"
    "  --json           print the decisions as one JSON document\n";

void PrintJson(const GcPlan& plan, bool dry_run, const std::vector<std::string>& removed) {
  std::cout << "{\"dry_run\":" << (dry_run ? "true" : "false") << ",\"checkpoints\":[";
  for (size_t i = 0; i < plan.decisions.size(); ++i) {
    const GcDecision& d = plan.decisions[i];
    std::cout << (i ? "," : "") << "{\"step\":" << d.checkpoint.step
              << ",\"name\":" << JsonQuote(d.checkpoint.name)
              << ",\"path\":" << JsonQuote(d.checkpoint.path) << ",\"bytes\":" << d.checkpoint.bytes
              << ",\"committed\":" << (d.checkpoint.committed ? "true" : "false")
              << ",\"action\":\"" << (d.remove ? "delete" : "keep") << "\",\"reason\":\""
              << d.reason << "\"}";
  }
  std::cout << "],\"deleted\":[";
  for (size_t i = 0; i < removed.size(); ++i) std::cout << (i ? "," : "") << JsonQuote(removed[i]);
  std::cout << "],\"bytes_freed\":" << (dry_run ? 0 : plan.bytes_to_remove())
            << ",\"bytes_to_free\":" << plan.bytes_to_remove() << "}\n";
}

void PrintText(const GcPlan& plan, bool dry_run) {
  for (const GcDecision& d : plan.decisions) {
    const char* action = d.remove ? (dry_run ? "would delete" : "deleted") : "keep";
    std::cout << action << "  step " << d.checkpoint.step << "  " << d.checkpoint.path << "  "
              << HumanBytes(d.checkpoint.bytes) << "  (" << d.reason << ")\n";
  }
  std::cout << (dry_run ? "dry run: would delete " : "deleted ") << plan.removals()
            << " checkpoint(s), " << HumanBytes(plan.bytes_to_remove()) << "\n";
}

}  // namespace

int GcCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help", "dry-run"}, {"keep-last", "keep-every"});
  if (!args.ok()) return UsageError("gc", args.status().message(), kGcUsage);
  if (args->Has("help")) {
    std::cout << kGcUsage;
    return kExitOk;
  }
  if (args->positional.size() != 1) return UsageError("gc", "expected exactly one DIR", kGcUsage);
  if (!args->Has("keep-last")) return UsageError("gc", "--keep-last is required", kGcUsage);
  RetentionPolicy policy;
  Result<int64_t> keep_last =
      ParseInt("keep-last", args->Get("keep-last", ""), 1, int64_t{1} << 40);
  if (!keep_last.ok()) return UsageError("gc", keep_last.status().message(), kGcUsage);
  policy.keep_last = *keep_last;
  if (args->Has("keep-every")) {
    Result<int64_t> every =
        ParseInt("keep-every", args->Get("keep-every", ""), 1, int64_t{1} << 62);
    if (!every.ok()) return UsageError("gc", every.status().message(), kGcUsage);
    policy.keep_every = *every;
  }
  const bool dry_run = args->Has("dry-run");
  Result<CheckpointListing> listing = ListCheckpoints(args->positional[0]);
  if (!listing.ok()) return Fail("gc", listing.status());
  Result<GcPlan> plan = PlanGc(*listing, policy);
  if (!plan.ok()) return Fail("gc", plan.status());
  std::vector<std::string> removed;
  if (!dry_run) {
    Result<std::vector<std::string>> done = ExecuteGc(*plan, nullptr);
    if (!done.ok()) return Fail("gc", done.status());
    removed = std::move(*done);
  }
  if (args->Has("json")) {
    PrintJson(*plan, dry_run, removed);
  } else {
    PrintText(*plan, dry_run);
  }
  return kExitOk;
}

}  // namespace sp::cli
