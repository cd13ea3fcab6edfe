#include "shardpoint/manage/consolidate_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "shardpoint/manage/consolidate_select.h"
#include "shardpoint/base/json.h"
#include "shardpoint/format/safetensors/safetensors.h"

namespace sp {
namespace {

bool IsConvertibleFloat(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

bool KeySelects(std::string_view key, std::string_view name) {
  return name == key || (name.size() > key.size() && name.starts_with(key) &&
                         name[key.size()] == '.');
}

std::string Renamed(const std::string& name,
                    const std::vector<std::pair<std::string, std::string>>& rename) {
  for (const auto& [from, to] : rename) {
    if (name.starts_with(from)) return to + name.substr(from.size());
  }
  return name;
}

// Every key and prefix must select at least one tensor.
Status CheckSelectionUsed(const ConsolidateOptions& options, const std::set<std::string>& used) {
  for (const std::string& key : options.keys) {
    if (!used.count("k" + key)) {
      return NotFoundError("key '" + key + "' selects no tensor of the checkpoint");
    }
  }
  for (const std::string& prefix : options.prefixes) {
    if (!used.count("p" + prefix)) {
      return NotFoundError("prefix '" + prefix + "' selects no tensor of the checkpoint");
    }
  }
  return OkStatus();
}

// True when `name` is selected; records in `used` which keys ("k...") and prefixes ("p...")
// selected it.
bool Selected(const ConsolidateOptions& options, const std::string& name,
              std::set<std::string>& used) {
  if (options.keys.empty() && options.prefixes.empty()) return true;
  bool selected = false;
  for (const std::string& key : options.keys) {
    if (!KeySelects(key, name)) continue;
    used.insert("k" + key);
    selected = true;
  }
  for (const std::string& prefix : options.prefixes) {
    if (!name.starts_with(prefix)) continue;
    used.insert("p" + prefix);
    selected = true;
  }
  return selected;
}

std::string Padded5(size_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%05zu", v);
  return buf;
}

// Fills head, offsets and size of a safetensors output file.
void LayOutSafetensorsFile(OutputFile& file) {
  std::vector<SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (const OutputTensor& t : file.tensors) {
    entries.push_back({t.name, t.dtype, t.source->shape, offset, offset + t.bytes});
    offset += t.bytes;
  }
  file.head = EncodeSafetensorsHeader(entries, {{"format", "pt"}});
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    file.tensors[i].file_offset = file.head.size() + entries[i].begin;
  }
  file.size = file.head.size() + offset;
}

// Fills head, offsets, size and the archive layout of a torch output file.
Status LayOutTorchFile(OutputFile& file) {
  std::vector<torch_save::TorchSaveTensorSpec> specs;
  for (const OutputTensor& t : file.tensors) specs.push_back({t.name, t.dtype, t.source->shape});
  SP_ASSIGN_OR_RETURN(torch_save::TorchSaveLayout layout,
                      torch_save::TorchSaveLayout::ForStateDict(std::move(specs)));
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    if (layout.data_bytes(i) != file.tensors[i].bytes) {
      return InternalError("torch archive layout of " + file.name + " gives tensor '" +
                           file.tensors[i].name + "' " + std::to_string(layout.data_bytes(i)) +
                           " bytes, expected " + std::to_string(file.tensors[i].bytes));
    }
    file.tensors[i].file_offset = layout.data_offset(i);
  }
  file.head = layout.Head();
  file.size = layout.total_size();
  file.torch = std::make_shared<const torch_save::TorchSaveLayout>(std::move(layout));
  return OkStatus();
}

}  // namespace

std::string SingleFileName(ConsolidateFormat format) {
  return format == ConsolidateFormat::kTorch ? "pytorch_model.bin" : "model.safetensors";
}

std::string IndexFileName(ConsolidateFormat format) {
  return SingleFileName(format) + ".index.json";
}

std::string ShardFileName(ConsolidateFormat format, size_t k, size_t n) {
  const bool torch = format == ConsolidateFormat::kTorch;
  return std::string(torch ? "pytorch_model-" : "model-") + Padded5(k) + "-of-" + Padded5(n) +
         (torch ? ".bin" : ".safetensors");
}

bool IsOutputFileName(ConsolidateFormat format, std::string_view name) {
  if (name == SingleFileName(format) || name == IndexFileName(format)) return true;
  const bool torch = format == ConsolidateFormat::kTorch;
  const std::string_view stem = torch ? "pytorch_model-" : "model-";
  const std::string_view suffix = torch ? ".bin" : ".safetensors";
  if (!name.starts_with(stem) || !name.ends_with(suffix)) return false;
  std::string_view middle = name.substr(stem.size(), name.size() - stem.size() - suffix.size());
  const size_t of = middle.find("-of-");
  if (of == std::string_view::npos || of == 0 || of + 4 == middle.size()) return false;
  auto digits = [](std::string_view s) {
    return std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return digits(middle.substr(0, of)) && digits(middle.substr(of + 4));
}

namespace {

// The default selection when the caller names no tensors (every tensor with `all_tensors`), and
// the sentence that says what the caller's keys and prefixes selected otherwise.
DefaultSelection SelectionFor(const CheckpointMetadata& metadata, const ConsolidateOptions& options) {
  if (options.keys.empty() && options.prefixes.empty() && !options.all_tensors) {
    return SelectModelWeights(metadata);
  }
  DefaultSelection s;
  s.description = options.all_tensors && options.keys.empty() && options.prefixes.empty()
                      ? "exported every tensor"
                      : "exported the tensors the given keys and prefixes select";
  return s;
}

}  // namespace

Result<std::vector<OutputTensor>> SelectOutputTensors(const CheckpointMetadata& metadata,
                                                      const ConsolidateOptions& options,
                                                      std::string* selection) {
  const DefaultSelection chosen = SelectionFor(metadata, options);
  if (selection != nullptr) *selection = chosen.description;
  std::vector<OutputTensor> out;
  std::set<std::string> used;
  std::map<std::string, std::string> sources;  // output name -> source name
  for (const TensorMetadata& t : metadata.tensors) {
    if (!chosen.Selects(t.name) || !Selected(options, t.name, used)) continue;
    OutputTensor o;
    o.name = Renamed(chosen.OutputName(t.name), options.rename);
    o.source = &t;
    o.dtype = options.dtype && IsConvertibleFloat(t.dtype) ? *options.dtype : t.dtype;
    o.bytes = static_cast<uint64_t>(ShapeVolume(t.shape)) * DTypeSize(o.dtype);
    if (o.name.empty() || o.name == "__metadata__") {
      return InvalidArgumentError("tensor '" + t.name + "' would be written as '" + o.name +
                                  "', which is not a valid tensor name");
    }
    auto [it, fresh] = sources.emplace(o.name, t.name);
    if (!fresh) {
      return InvalidArgumentError("tensors '" + it->second + "' and '" + t.name +
                                  "' would both be written as '" + o.name + "'");
    }
    out.push_back(std::move(o));
  }
  SP_RETURN_IF_ERROR(CheckSelectionUsed(options, used));
  std::sort(out.begin(), out.end(),
            [](const OutputTensor& a, const OutputTensor& b) { return a.name < b.name; });
  return out;
}

std::vector<std::vector<OutputTensor>> SplitIntoShards(std::vector<OutputTensor> tensors,
                                                       uint64_t max_shard_bytes) {
  std::vector<std::vector<OutputTensor>> shards;
  uint64_t current = 0;
  for (OutputTensor& t : tensors) {
    if (shards.empty() || (!shards.back().empty() && current + t.bytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    current += t.bytes;
    shards.back().push_back(std::move(t));
  }
  if (shards.empty()) shards.emplace_back();  // an empty checkpoint gives one empty file
  return shards;
}

Result<ConsolidationPlan> PlanConsolidation(const CheckpointMetadata& metadata,
                                            const ConsolidateOptions& options) {
  if (options.max_shard_bytes == 0) return InvalidArgumentError("max shard size must be positive");
  ConsolidationPlan plan;
  SP_ASSIGN_OR_RETURN(std::vector<OutputTensor> tensors,
                      SelectOutputTensors(metadata, options, &plan.selection));
  plan.tensors = tensors.size();
  std::vector<std::vector<OutputTensor>> shards =
      SplitIntoShards(std::move(tensors), options.max_shard_bytes);
  for (size_t k = 0; k < shards.size(); ++k) {
    OutputFile& file = plan.files.emplace_back();
    file.name = shards.size() == 1 ? SingleFileName(options.format)
                                   : ShardFileName(options.format, k + 1, shards.size());
    file.tensors = std::move(shards[k]);
    for (const OutputTensor& t : file.tensors) plan.total_bytes += t.bytes;
    if (options.format == ConsolidateFormat::kTorch) {
      SP_RETURN_IF_ERROR(LayOutTorchFile(file).WithContext("laying out " + file.name));
    } else {
      LayOutSafetensorsFile(file);
    }
  }
  if (plan.files.size() > 1) {
    plan.index_name = IndexFileName(options.format);
    plan.index_json = BuildIndexJson(plan.files, plan.total_bytes);
  }
  return plan;
}

std::string BuildIndexJson(const std::vector<OutputFile>& files, uint64_t total_bytes) {
  std::map<std::string_view, std::string_view> weight_map;
  for (const OutputFile& f : files) {
    for (const OutputTensor& t : f.tensors) weight_map.emplace(t.name, f.name);
  }
  std::string json = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total_bytes) +
                     "\n  },\n  \"weight_map\": {";
  bool first = true;
  for (const auto& [tensor, file] : weight_map) {
    json += first ? "\n    " : ",\n    ";
    first = false;
    AppendJsonString(&json, tensor);
    json += ": ";
    AppendJsonString(&json, file);
  }
  json += first ? "}\n}\n" : "\n  }\n}\n";
  return json;
}

Result<uint64_t> ParseByteSize(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError("invalid size '" + std::string(text) + "': " + std::string(why) +
                                " (expected bytes, or a number with KB, MB, GB, TB, KiB, MiB, "
                                "GiB or TiB, like \"5GB\")");
  };
  size_t pos = 0;
  while (pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) ||
                               text[pos] == '.')) {
    ++pos;
  }
  std::string number(text.substr(0, pos));
  std::string unit;
  for (char c : text.substr(pos)) {
    if (c != ' ') unit.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  }
  if (number.empty() || number.front() == '.' || number.back() == '.' ||
      std::count(number.begin(), number.end(), '.') > 1 || number.size() > 40) {
    return bad("not a number");
  }
  static const std::map<std::string, double> kUnits = {
      {"", 1},        {"B", 1},           {"KB", 1e3},         {"MB", 1e6},
      {"GB", 1e9},    {"TB", 1e12},       {"KIB", 1024.0},     {"MIB", 1048576.0},
      {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto unit_it = kUnits.find(unit);
  if (unit_it == kUnits.end()) return bad("unknown unit");
  if (number.find('.') == std::string::npos && unit_it->second == 1) {
    if (number.size() > 19) return bad("too large");
    const uint64_t value = std::stoull(number);
    if (value == 0) return bad("must be positive");
    if (value > uint64_t{1} << 63) return bad("too large");
    return value;
  }
  const double value = std::stod(number) * unit_it->second;
  if (!(value >= 1)) return bad("must be at least one byte");
  if (value > 9.2e18) return bad("too large");
  return static_cast<uint64_t>(std::llround(value));
}

Result<DType> ParseConsolidateDType(std::string_view text) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  static const std::map<std::string, DType> kShort = {
      {"fp16", DType::kFloat16}, {"f16", DType::kFloat16},   {"bf16", DType::kBFloat16},
      {"fp32", DType::kFloat32}, {"f32", DType::kFloat32},   {"fp64", DType::kFloat64},
      {"f64", DType::kFloat64}};
  if (auto it = kShort.find(lower); it != kShort.end()) return it->second;
  Result<DType> parsed = ParseDType(text);
  if (parsed.ok()) return parsed;
  return InvalidArgumentError("unknown dtype '" + std::string(text) +
                              "' (expected e.g. bf16, fp16, fp32, bfloat16, float16, float32)");
}

}  // namespace sp
