// Shared pieces of the shardpoint command-line tool: argument parsing and the one place where a
// Status becomes a message and an exit code.
//
// Exit codes: 0 success; 1 the operation failed or found defects; 2 the command line is wrong.
#ifndef SHARDPOINT_TOOLS_CLI_H_
#define SHARDPOINT_TOOLS_CLI_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/store/store.h"

namespace sp::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Parsed arguments: positionals in order; "--name value" and "--flag" options.
struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;  // flags map to ""
  bool Has(const std::string& name) const { return options.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback) const;
};

// `flags` lists options that take no value; every other "--x" consumes the next argument.
// kInvalidArgument for an unknown option or a missing value.
Result<Args> ParseArgs(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
                       const std::vector<std::string>& valued);

// The flag of the commands that read checkpoints, and its line for their usage texts. Files that
// symbolic links lead out of a checkpoint directory are refused without it (docs/FORMAT.md,
// "Symbolic links").
inline constexpr char kLinksFlag[] = "allow-external-links";
inline constexpr char kLinksUsage[] =
    "  --allow-external-links  read files that symbolic links lead outside the checkpoint\n";

// The store a command reads `path` with: the store of its URL, allowing links out of the
// checkpoint when --allow-external-links was given. Errors as OpenStore.
Result<std::unique_ptr<Store>> StoreFor(const Args& args, std::string_view path);

// Prints "shardpoint <verb>: <message>" on stderr and returns kExitFailure.
int Fail(std::string_view verb, const Status& status);
// Prints "shardpoint <verb>: <message>" and the verb's usage on stderr; returns kExitUsage.
int UsageError(std::string_view verb, std::string_view message, std::string_view usage);

// Parses a whole decimal integer in [min, max]; kInvalidArgument naming the option otherwise.
Result<int64_t> ParseInt(std::string_view option, std::string_view text, int64_t min, int64_t max);

// JSON string literal with escapes.
std::string JsonQuote(std::string_view s);

// Draws "<label> [#####.....] done / total" on stderr, redrawn in place; ends the line when
// done == total. For terminals only (callers check isatty); not thread-safe.
void DrawProgressBar(std::string_view label, uint64_t done, uint64_t total);

int InspectCommand(const std::vector<std::string>& argv);
int VerifyCommand(const std::vector<std::string>& argv);
int DemoCommand(const std::vector<std::string>& argv);
int ListCommand(const std::vector<std::string>& argv);
int GcCommand(const std::vector<std::string>& argv);
int PruneCommand(const std::vector<std::string>& argv);
int DiffCommand(const std::vector<std::string>& argv);
int ConsolidateCommand(const std::vector<std::string>& argv);
int ConvertCommand(const std::vector<std::string>& argv);

}  // namespace sp::cli

#endif  // SHARDPOINT_TOOLS_CLI_H_
