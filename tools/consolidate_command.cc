// shardpoint consolidate SRC OUT [--max-shard-size 5GB] [--dtype bf16] [--keys k1,k2]
//     [--prefix p] [--all] [--rename old=new] [--format safetensors|torch] [--overwrite] [--threads N]
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kConsolidateUsage[] =
    "usage: shardpoint consolidate SRC OUT [options]\n"
    "\n"
    "Writes the tensors of the checkpoint at SRC (native, PyTorch DCP or Hugging Face safetensors,\n"
    "any number of ranks) as whole tensors into the directory OUT, the way Hugging Face's\n"
    "save_pretrained does: model.safetensors, or model-0000K-of-0000N.safetensors shards plus\n"
    "model.safetensors.index.json. Memory stays within the budget whatever the checkpoint size;\n"
    "files appear under their final names only once complete.\n"
    "  --max-shard-size S   largest shard: bytes, or KB/MB/GB/TB, KiB/MiB/GiB/TiB (default 5GB)\n"
    "  --dtype D            convert floating-point tensors to D (bf16, fp16, fp32, ...)\n"
    "  --keys K1,K2         only these tensors and the tensors under them (K1.*)\n"
    "  --prefix P           only tensors whose name starts with P (repeatable)\n"
    "  --all                every tensor (default without --keys/--prefix: the model weights\n"
    "                       when the checkpoint separates them from optimizer and training state)\n"
    "  --rename OLD=NEW     replace the name prefix OLD with NEW (repeatable; first match wins)\n"
    "  --format F           safetensors (default) or torch (pytorch_model*.bin)\n"
    "  --overwrite          replace existing outputs of that format in OUT\n"
    "  --threads N          I/O threads (default: max(4, cores))\n"
    "  --memory-budget S    memory for tensor data in flight (default 256MiB)\n"
    "  --json               print the result as one JSON document\n"
    "  --allow-external-links  read files that symbolic links lead outside the checkpoint\n";

// ParseArgs keeps the last value of a repeated option, so repeated ones are collected here.
std::vector<std::string> Repeated(const std::vector<std::string>& argv, const std::string& name) {
  std::vector<std::string> values;
  const std::string flag = "--" + name;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == flag && i + 1 < argv.size()) values.push_back(argv[++i]);
    if (argv[i].starts_with(flag + "=")) values.push_back(argv[i].substr(flag.size() + 1));
  }
  return values;
}

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (;;) {
    const size_t comma = text.find(',', begin);
    std::string part = text.substr(begin, comma == std::string::npos ? comma : comma - begin);
    if (!part.empty()) parts.push_back(std::move(part));
    if (comma == std::string::npos) return parts;
    begin = comma + 1;
  }
}

Status ParseSelection(const std::vector<std::string>& argv, const Args& args,
                      ConsolidateOptions* options) {
  if (args.Has("keys")) {
    options->keys = SplitCommas(args.Get("keys", ""));
    if (options->keys.empty()) return InvalidArgumentError("--keys needs at least one key");
  }
  options->prefixes = Repeated(argv, "prefix");
  for (const std::string& pair : Repeated(argv, "rename")) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos || eq == 0) {
      return InvalidArgumentError("--rename expects OLD=NEW with a non-empty OLD, not '" + pair +
                                  "'");
    }
    options->rename.emplace_back(pair.substr(0, eq), pair.substr(eq + 1));
  }
  return OkStatus();
}

Result<ConsolidateOptions> ParseOptions(const std::vector<std::string>& argv, const Args& args) {
  ConsolidateOptions options;
  const std::string format = args.Get("format", "safetensors");
  if (format == "torch") {
    options.format = ConsolidateFormat::kTorch;
  } else if (format != "safetensors") {
    return InvalidArgumentError("--format expects safetensors or torch, not '" + format + "'");
  }
  if (args.Has("max-shard-size")) {
    SP_ASSIGN_OR_RETURN(options.max_shard_bytes, ParseByteSize(args.Get("max-shard-size", "")));
  }
  if (args.Has("memory-budget")) {
    SP_ASSIGN_OR_RETURN(options.memory_budget_bytes, ParseByteSize(args.Get("memory-budget", "")));
  }
  if (args.Has("dtype")) {
    SP_ASSIGN_OR_RETURN(options.dtype, ParseConsolidateDType(args.Get("dtype", "")));
  }
  if (args.Has("threads")) {
    SP_ASSIGN_OR_RETURN(int64_t threads, ParseInt("threads", args.Get("threads", ""), 1, 1024));
    options.threads = static_cast<int>(threads);
  }
  options.overwrite = args.Has("overwrite");
  options.all_tensors = args.Has("all");
  SP_RETURN_IF_ERROR(ParseSelection(argv, args, &options));
  return options;
}

bool progress_drawn = false;  // a bar is on the terminal without its closing newline

// A bar on stderr, redrawn in place.
void DrawProgress(uint64_t done, uint64_t total) {
  progress_drawn = done != total;
  constexpr int kWidth = 30;
  const int filled = total == 0 ? kWidth : static_cast<int>(kWidth * done / total);
  std::fprintf(stderr, "\rconsolidate [%s%s] %s / %s", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), HumanBytes(done).c_str(),
               HumanBytes(total).c_str());
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

void PrintResult(const ConsolidateResult& r, const std::string& source, const std::string& out,
                 bool json) {
  if (json) {
    std::cout << "{\"source\":" << JsonQuote(source) << ",\"output\":" << JsonQuote(out)
              << ",\"tensors\":" << r.tensors << ",\"total_bytes\":" << r.total_bytes
              << ",\"bytes_read\":" << r.bytes_read << ",\"selection\":" << JsonQuote(r.selection)
              << ",\"files\":[";
    for (size_t i = 0; i < r.files.size(); ++i) std::cout << (i ? "," : "") << JsonQuote(r.files[i]);
    std::cout << "],\"index\":" << (r.index_file.empty() ? "null" : JsonQuote(r.index_file))
              << "}\n";
    return;
  }
  std::cout << r.selection << "\n";
  for (const std::string& f : r.files) std::cout << "wrote " << f << "\n";
  if (!r.index_file.empty()) std::cout << "wrote " << r.index_file << "\n";
  std::cout << "consolidated " << source << " into " << out << ": " << r.tensors << " tensor(s), "
            << HumanBytes(r.total_bytes) << " in " << r.files.size() << " file(s)\n";
}

}  // namespace

int ConsolidateCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"help", "overwrite", "json", "all", kLinksFlag},
                                {"max-shard-size", "dtype", "keys", "prefix", "rename", "format",
                                 "threads", "memory-budget"});
  if (!args.ok()) return UsageError("consolidate", args.status().message(), kConsolidateUsage);
  if (args->Has("help")) {
    std::cout << kConsolidateUsage;
    return kExitOk;
  }
  if (args->positional.size() != 2) {
    return UsageError("consolidate", "expected SRC and OUT", kConsolidateUsage);
  }
  Result<ConsolidateOptions> options = ParseOptions(argv, *args);
  if (!options.ok()) {
    return UsageError("consolidate", options.status().message(), kConsolidateUsage);
  }
  if (isatty(STDERR_FILENO) && !args->Has("json")) options->progress = DrawProgress;
  const std::string& source = args->positional[0];
  const std::string& out = args->positional[1];
  Result<std::unique_ptr<Store>> store = StoreFor(*args, source);
  if (!store.ok()) return Fail("consolidate", store.status());
  options->store = store->get();
  Result<ConsolidateResult> result = Consolidate(source, out, *options);
  if (!result.ok()) {
    if (progress_drawn) std::fprintf(stderr, "\n");
    return Fail("consolidate", result.status());
  }
  PrintResult(*result, source, out, args->Has("json"));
  return kExitOk;
}

}  // namespace sp::cli
