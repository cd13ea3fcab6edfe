// shardpoint prune PATH --prefix P [--prefix P2 ...] [--dry-run] [--json]
#include <iostream>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kPruneUsage[] =
    "usage: shardpoint prune PATH --prefix P [--prefix P2 ...] [--dry-run] [--json]\n"
    "\n"
    "Removes every tensor and object whose key starts with one of the prefixes from the native\n"
    "checkpoint at PATH, in place. Data files holding no removed chunk are left untouched; files\n"
    "holding removed chunks are rewritten under new names without them (the other chunks copied\n"
    "with their checksums verified); the new metadata is committed atomically, and only then are\n"
    "the old files removed. A crash at any point leaves the old or the new checkpoint.\n"
    "A prefix is a plain string prefix: end it with '.' to take one subtree.\n"
    "  --prefix P   a key prefix (repeatable; each must match a tensor or an object)\n"
    "  --dry-run    print what would be removed and rewritten; change nothing\n"
    "  --json       print the report as one JSON document\n";

std::string JsonList(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? "," : "") + JsonQuote(items[i]);
  return out + "]";
}

void PrintJson(const std::string& path, const PruneReport& r, bool dry_run) {
  std::cout << "{\"path\":" << JsonQuote(path) << ",\"dry_run\":" << (dry_run ? "true" : "false")
            << ",\"tensors_removed\":" << JsonList(r.tensors_removed)
            << ",\"objects_removed\":" << JsonList(r.objects_removed)
            << ",\"tensor_bytes_removed\":" << r.tensor_bytes_removed
            << ",\"files_untouched\":" << JsonList(r.files_untouched)
            << ",\"files_dropped\":" << JsonList(r.files_dropped)
            << ",\"files_rewritten\":" << JsonList(r.files_rewritten)
            << ",\"files_written\":" << JsonList(r.files_written)
            << ",\"bytes_copied\":" << r.bytes_copied << "}\n";
}

void PrintText(const std::string& path, const PruneReport& r, bool dry_run) {
  const char* verb = dry_run ? "would remove" : "removed";
  for (const std::string& t : r.tensors_removed) std::cout << verb << " tensor " << t << "\n";
  for (const std::string& o : r.objects_removed) std::cout << verb << " object " << o << "\n";
  for (size_t i = 0; i < r.files_rewritten.size(); ++i) {
    std::cout << (dry_run ? "would rewrite " : "rewrote ") << r.files_rewritten[i]
              << (dry_run ? "" : " as " + r.files_written[i]) << "\n";
  }
  for (const std::string& f : r.files_dropped) {
    std::cout << (dry_run ? "would delete " : "deleted ") << f << "\n";
  }
  std::cout << (dry_run ? "dry run: " : "pruned ") << path << ": " << r.tensors_removed.size()
            << " tensor(s) (" << HumanBytes(r.tensor_bytes_removed) << ") and "
            << r.objects_removed.size() << " object(s); " << r.files_untouched.size()
            << " file(s) untouched, " << r.files_rewritten.size() << " rewritten ("
            << HumanBytes(r.bytes_copied) << " copied), " << r.files_dropped.size() << " deleted\n";
}

// ParseArgs keeps the last value of a repeated option, so the prefixes are collected here.
std::vector<std::string> Prefixes(const std::vector<std::string>& argv) {
  std::vector<std::string> prefixes;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--prefix" && i + 1 < argv.size()) prefixes.push_back(argv[++i]);
    if (argv[i].starts_with("--prefix=")) prefixes.push_back(argv[i].substr(9));
  }
  return prefixes;
}

}  // namespace

int PruneCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help", "dry-run"}, {"prefix"});
  if (!args.ok()) return UsageError("prune", args.status().message(), kPruneUsage);
  if (args->Has("help")) {
    std::cout << kPruneUsage;
    return kExitOk;
  }
  if (args->positional.size() != 1) {
    return UsageError("prune", "expected exactly one PATH", kPruneUsage);
  }
  const std::vector<std::string> prefixes = Prefixes(argv);
  if (prefixes.empty())
    return UsageError("prune", "at least one --prefix is required", kPruneUsage);
  for (const std::string& p : prefixes) {
    if (p.empty()) return UsageError("prune", "--prefix must not be empty", kPruneUsage);
  }
  const std::string& path = args->positional[0];
  PruneOptions options;
  options.dry_run = args->Has("dry-run");
  Result<PruneReport> report = Prune(path, prefixes, options);
  if (!report.ok()) return Fail("prune", report.status());
  if (args->Has("json")) {
    PrintJson(path, *report, options.dry_run);
  } else {
    PrintText(path, *report, options.dry_run);
  }
  return kExitOk;
}

}  // namespace sp::cli
