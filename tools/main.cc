// shardpoint: inspect, verify and demonstrate checkpoints from the command line.
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace {

constexpr char kUsage[] =
    "usage: shardpoint <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo                 save a synthetic model from 4 ranks, load it into 3, check every byte\n"
    "  inspect PATH         list the tensors, objects and files of a checkpoint (--json)\n"
    "  verify PATH          check every checksum and the coverage of every tensor\n"
    "  list DIR             list the step checkpoints in a run directory (--json)\n"
    "  gc DIR               delete old step checkpoints (--keep-last K, --keep-every N)\n"
    "  prune PATH           remove the tensors and objects under key prefixes, in place\n"
    "  diff A B             compare two checkpoints key by key and value by value\n"
    "  consolidate SRC OUT  write whole tensors as Hugging Face safetensors (or torch) files\n"
    "  convert SRC DST      rewrite a checkpoint as native or PyTorch DCP (--to)\n"
    "\n"
    "Run 'shardpoint <command> --help' for the options of a command.\n";

// Runs the command `verb`; kExitUsage when there is none by that name.
int RunCommand(const std::string& verb, const std::vector<std::string>& args) {
  if (verb == "inspect") return sp::cli::InspectCommand(args);
  if (verb == "verify") return sp::cli::VerifyCommand(args);
  if (verb == "demo") return sp::cli::DemoCommand(args);
  if (verb == "list") return sp::cli::ListCommand(args);
  if (verb == "gc") return sp::cli::GcCommand(args);
  if (verb == "prune") return sp::cli::PruneCommand(args);
  if (verb == "diff") return sp::cli::DiffCommand(args);
  if (verb == "consolidate") return sp::cli::ConsolidateCommand(args);
  if (verb == "convert") return sp::cli::ConvertCommand(args);
  std::cerr << "shardpoint: unknown command '" << verb << "'\n\n" << kUsage;
  return sp::cli::kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kUsage;
    return sp::cli::kExitUsage;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << kUsage;
    return sp::cli::kExitOk;
  }
  const std::string verb = args[0];
  args.erase(args.begin());
  // An allocation that fails (a size read from a hostile file, a memory limit) ends the command
  // with a message and exit status 1, not with an abort.
  try {
    return RunCommand(verb, args);
  } catch (const std::bad_alloc&) {
    std::cerr << "shardpoint " << verb << ": out of memory: an allocation failed (std::bad_alloc)\n";
  } catch (const std::length_error& e) {
    std::cerr << "shardpoint " << verb << ": out of memory: a size is too large (" << e.what()
              << ")\n";
  }
  return sp::cli::kExitFailure;
}
