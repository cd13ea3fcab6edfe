// shardpoint convert SRC DST --to native|torch-dcp|megatron [--overwrite] [--threads N] [--files N]
//                    [--memory-budget-mib M] [--json]
#include <unistd.h>

#include <iostream>
#include <mutex>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {
constexpr char kConvertUsage[] =
    "usage: shardpoint convert SRC DST --to native|torch-dcp|megatron [--overwrite] [--threads N]\n"
    "                          [--files N] [--memory-budget-mib M] [--json]\n"
    "                          [--allow-external-links]\n"
    "\n"
    "Rewrites the checkpoint at SRC (native, PyTorch DCP, or a Hugging Face safetensors\n"
    "directory) as a checkpoint of the format given by --to at DST: 'native' (shardpoint's\n"
    "format, checksummed), 'torch-dcp' (what torch.distributed.checkpoint.load reads) or\n"
    "'megatron' (torch-dcp plus Megatron-Core's metadata.json and common.pt, which holds the\n"
    "objects; what megatron.core.dist_checkpointing.load reads). Tensors keep their chunks;\n"
    "objects and the nested state-dict paths are carried over (plain data is decoded by a\n"
    "restricted reader that runs no code; other pickled objects are copied as they are, never\n"
    "unpickled). Streams chunk by chunk: at most the larger of\n"
    "the memory budget (default 256 MiB) and the largest chunk is held at once. The output is\n"
    "committed atomically; an existing checkpoint at DST is replaced only with --overwrite.\n"
    "--files: data files to write (default 1). A progress bar is drawn on a terminal.\n";

std::mutex progress_mu;
uint64_t progress_shown = 0;

void ShowProgress(uint64_t done, uint64_t total) {
  std::lock_guard<std::mutex> lock(progress_mu);
  if (done < progress_shown) return;  // reports from I/O threads may arrive out of order
  progress_shown = done;
  DrawProgressBar("convert", done, total);
}
}  // namespace

int ConvertCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help", "overwrite", kLinksFlag},
                                {"to", "threads", "files", "memory-budget-mib"});
  if (!args.ok()) return UsageError("convert", args.status().message(), kConvertUsage);
  if (args->Has("help")) {
    std::cout << kConvertUsage;
    return kExitOk;
  }
  if (args->positional.size() != 2) {
    return UsageError("convert", "expected SRC and DST", kConvertUsage);
  }
  if (!args->Has("to")) return UsageError("convert", "--to is required", kConvertUsage);
  ConvertOptions options;
  options.megatron = args->Get("to", "") == "megatron";
  Result<CheckpointFormat> format =
      ParseCheckpointFormat(options.megatron ? "torch-dcp" : args->Get("to", ""));
  if (!format.ok() || *format == CheckpointFormat::kSafetensors) {
    return UsageError("convert", "--to must be native, torch-dcp or megatron (for safetensors "
                      "use 'shardpoint consolidate')", kConvertUsage);
  }
  options.format = *format;
  options.overwrite = args->Has("overwrite");
  Result<int64_t> threads = ParseInt("--threads", args->Get("threads", "0"), 0, 1024);
  Result<int64_t> files = ParseInt("--files", args->Get("files", "1"), 1, 4096);
  Result<int64_t> budget = ParseInt("--memory-budget-mib", args->Get("memory-budget-mib", "256"),
                                    1, int64_t{1} << 30);
  for (const Result<int64_t>* r : {&threads, &files, &budget}) {
    if (!r->ok()) return UsageError("convert", r->status().message(), kConvertUsage);
  }
  options.threads = static_cast<int>(*threads);
  options.files = static_cast<int>(*files);
  options.memory_budget_bytes = static_cast<uint64_t>(*budget) << 20;
  const bool json = args->Has("json");
  if (!json && isatty(STDERR_FILENO)) options.progress = ShowProgress;
  const std::string& source = args->positional[0];
  const std::string& destination = args->positional[1];
  Result<std::unique_ptr<Store>> store = StoreFor(*args, source);
  if (!store.ok()) return Fail("convert", store.status());
  options.source_store = store->get();
  Result<ConvertReport> report = Convert(source, destination, options);
  if (!report.ok()) return Fail("convert", report.status());
  const std::string from(CheckpointFormatName(report->source_format));
  const std::string to(CheckpointFormatName(options.format));
  if (json) {
    std::cout << "{\"source\":" << JsonQuote(source) << ",\"destination\":" << JsonQuote(destination)
              << ",\"from\":" << JsonQuote(from) << ",\"to\":" << JsonQuote(to)
              << ",\"tensors\":" << report->tensors << ",\"chunks\":" << report->chunks
              << ",\"objects\":" << report->objects << ",\"bytes\":" << report->bytes << "}\n";
  } else {
    std::cout << "converted " << source << " (" << from << ") to " << destination << " (" << to
              << "): " << report->tensors << " tensors in " << report->chunks << " chunks, "
              << report->objects << " objects, " << HumanBytes(report->bytes) << "\n";
  }
  return kExitOk;
}

}  // namespace sp::cli
