// shardpoint list DIR [--json]
#include <cstdio>
#include <iostream>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kListUsage[] =
    "usage: shardpoint list DIR [--json]\n"
    "\n"
    "Lists the step checkpoints in DIR: its subdirectories whose names end in a step number\n"
    "(step_000100, step-100, global_step100, iter_0000100: the trailing digits are the step).\n"
    "For each: the step, whether it is committed (a valid shardpoint.metadata, or a PyTorch DCP\n"
    ".metadata), its bytes on disk, and which committed one is the latest.\n"
    "  --json     print the same as one JSON document\n";

std::string CheckpointJson(const StepCheckpoint& c, bool latest) {
  std::string out = "{\"step\":" + std::to_string(c.step) + ",\"name\":" + JsonQuote(c.name) +
                    ",\"path\":" + JsonQuote(c.path) + ",\"bytes\":" + std::to_string(c.bytes) +
                    ",\"committed\":" + (c.committed ? "true" : "false") +
                    ",\"format\":" + (c.format.empty() ? "null" : JsonQuote(c.format)) +
                    ",\"latest\":" + (latest ? "true" : "false");
  if (!c.problem.empty()) out += ",\"problem\":" + JsonQuote(c.problem);
  return out + "}";
}

void PrintJson(const CheckpointListing& listing) {
  std::cout << "{\"directory\":" << JsonQuote(listing.directory) << ",\"latest\":";
  const StepCheckpoint* latest = listing.latest_checkpoint();
  std::cout << (latest ? CheckpointJson(*latest, true) : "null") << ",\"checkpoints\":[";
  for (size_t i = 0; i < listing.checkpoints.size(); ++i) {
    std::cout << (i ? "," : "") << CheckpointJson(listing.checkpoints[i], listing.latest == i);
  }
  std::cout << "]}\n";
}

void PrintTable(const CheckpointListing& listing) {
  std::printf("%14s  %-11s  %10s  %s\n", "step", "state", "size", "name");
  uint64_t total = 0;
  for (size_t i = 0; i < listing.checkpoints.size(); ++i) {
    const StepCheckpoint& c = listing.checkpoints[i];
    total += c.bytes;
    std::printf("%14lld  %-11s  %10s  %s%s\n", static_cast<long long>(c.step),
                c.committed ? "committed" : "uncommitted", HumanBytes(c.bytes).c_str(),
                c.name.c_str(), listing.latest == i ? "  (latest)" : "");
  }
  const StepCheckpoint* latest = listing.latest_checkpoint();
  std::printf(
      "%zu checkpoint(s), %s; latest committed: %s\n", listing.checkpoints.size(),
      HumanBytes(total).c_str(),
      latest ? (latest->name + " (step " + std::to_string(latest->step) + ")").c_str() : "none");
}

}  // namespace

int ListCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help"}, {});
  if (!args.ok()) return UsageError("list", args.status().message(), kListUsage);
  if (args->Has("help")) {
    std::cout << kListUsage;
    return kExitOk;
  }
  if (args->positional.size() != 1) {
    return UsageError("list", "expected exactly one DIR", kListUsage);
  }
  Result<CheckpointListing> listing = ListCheckpoints(args->positional[0]);
  if (!listing.ok()) return Fail("list", listing.status());
  if (args->Has("json")) {
    PrintJson(*listing);
  } else {
    PrintTable(*listing);
  }
  return kExitOk;
}

}  // namespace sp::cli
