// shardpoint verify PATH [--json]
#include <iostream>

#include "shardpoint/checkpoint.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {
constexpr char kVerifyUsage[] =
    "usage: shardpoint verify PATH [--json] [--allow-external-links]\n"
    "\n"
    "Checks the committed checkpoint at PATH: every data file's presence, size and header, every\n"
    "checksum block of every chunk, and that the chunks of every tensor cover it exactly once.\n"
    "Every symbolic link below PATH is reported: one that stays inside as a note, one that leads\n"
    "out as a defect unless --allow-external-links is given.\n"
    "Exits 0 when sound, 1 naming each defect otherwise.\n"
    "\n"
    "options:\n"
    "  --json                  print the report as one JSON document\n";
}  // namespace

int VerifyCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help", kLinksFlag}, {});
  const std::string usage = std::string(kVerifyUsage) + kLinksUsage;
  if (!args.ok()) return UsageError("verify", args.status().message(), usage);
  if (args->Has("help")) {
    std::cout << usage;
    return kExitOk;
  }
  if (args->positional.size() != 1) {
    return UsageError("verify", "expected exactly one PATH", usage);
  }
  const std::string& path = args->positional[0];
  Result<std::unique_ptr<Store>> store = StoreFor(*args, path);
  if (!store.ok()) return Fail("verify", store.status());
  Result<VerifyReport> report = Verify(path, store->get());
  if (!report.ok()) return Fail("verify", report.status());
  if (args->Has("json")) {
    std::cout << "{\"path\":" << JsonQuote(path) << ",\"ok\":" << (report->ok() ? "true" : "false")
              << ",\"files_checked\":" << report->files_checked
              << ",\"chunks_checked\":" << report->chunks_checked
              << ",\"bytes_checked\":" << report->bytes_checked
              << ",\"checksums\":" << (report->has_checksums ? "true" : "false")
              << ",\"defects\":[";
    for (size_t i = 0; i < report->defects.size(); ++i) {
      std::cout << (i ? "," : "") << JsonQuote(report->defects[i]);
    }
    std::cout << "],\"notes\":[";
    for (size_t i = 0; i < report->notes.size(); ++i) {
      std::cout << (i ? "," : "") << JsonQuote(report->notes[i]);
    }
    std::cout << "]}\n";
  } else {
    for (const std::string& n : report->notes) std::cout << "NOTE: " << n << "\n";
    for (const std::string& d : report->defects) std::cout << "DEFECT: " << d << "\n";
    std::cout << (report->ok() ? "OK" : "FAILED") << ": " << path << ": "
              << report->files_checked << " files, " << report->chunks_checked << " chunks, "
              << HumanBytes(report->bytes_checked) << " checked, " << report->defects.size()
              << " defect(s)"
              << (report->has_checksums ? "" : " (this format has no checksums: file sizes, "
                                               "item structure and coverage were checked)")
              << "\n";
  }
  return report->ok() ? kExitOk : kExitFailure;
}

}  // namespace sp::cli
