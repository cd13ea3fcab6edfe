#include "shardpoint/format/torch_dcp/megatron.h"

#include <algorithm>
#include <map>
#include <memory>
#include <variant>

#include "shardpoint/base/json.h"
#include "shardpoint/format/torch_dcp/dcp_checkpoint.h"
#include "shardpoint/format/torch_dcp/megatron_emit.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::DescribePickleValue;
using torch_save::EncodePlainPickle;
using torch_save::IsObjectOf;
using torch_save::PickleValue;
using torch_save::PickleWriter;
using torch_save::PlainValue;
using torch_save::ToPlainValue;

using torch_save::kMaxPickleWalkDepth;

using Kind = PickleValue::Kind;
using PathStep = std::variant<std::string, int64_t>;

namespace {

// metadata.json ------------------------------------------------------------------------------

Result<const JsonValue*> Field(const JsonValue& root, std::string_view key) {
  for (size_t i = 0; i < root.keys.size(); ++i) {
    if (root.keys[i] == key) return &root.values[i];
  }
  return static_cast<const JsonValue*>(nullptr);
}

Status ReadConfigString(const JsonValue& root, std::string_view key, std::string_view path,
                        std::string* out) {
  SP_ASSIGN_OR_RETURN(const JsonValue* v, Field(root, key));
  if (v == nullptr) return OkStatus();
  if (!v->is_string()) {
    return DataLossError("Megatron config " + std::string(path) + ": " + std::string(key) +
                         " is not a string");
  }
  *out = v->string;
  return OkStatus();
}

Status ReadConfigVersion(const JsonValue& root, std::string_view key, std::string_view path,
                         int64_t* out) {
  SP_ASSIGN_OR_RETURN(const JsonValue* v, Field(root, key));
  if (v == nullptr) return OkStatus();
  if (!v->is_number() || v->number > (uint64_t{1} << 31)) {
    return DataLossError("Megatron config " + std::string(path) + ": " + std::string(key) +
                         " is not a non-negative integer");
  }
  *out = static_cast<int64_t>(v->number);
  return OkStatus();
}

// common.pt -> objects -----------------------------------------------------------------------

bool IsTensor(const PickleValue& v) {
  return IsObjectOf(v, "torch._utils", "_rebuild_tensor_v2") ||
         IsObjectOf(v, "torch._utils", "_rebuild_tensor_v3") ||
         IsObjectOf(v, "torch._utils", "_rebuild_parameter");
}

// A dict, or an OrderedDict object whose pairs came from SETITEMS.
bool IsMapping(const PickleValue& v) {
  return v.is(Kind::kDict) || (IsObjectOf(v, "collections", "OrderedDict") && v.state == nullptr &&
                               v.args->items.empty());
}

// Whether every key of mapping `v` is a str: only such dicts are walked into nested keys, as
// Python's flattening does; a dict with other keys (ints, tuples) is one object.
bool HasStrKeys(const PickleValue& v) {
  for (size_t i = 0; i < v.pair_count(); ++i) {
    if (!v.key(i).is(Kind::kString)) return false;
  }
  return true;
}

// As _flatten._is_plain_sequence: no tensor and no mapping at any depth.
bool IsPlainSequence(const PickleValue& v, int depth) {
  if (depth > kMaxPickleWalkDepth) return false;
  for (const PickleValue* item : v.items) {
    if (IsTensor(*item) || IsMapping(*item)) return false;
    if ((item->is(Kind::kList) || item->is(Kind::kTuple)) && !IsPlainSequence(*item, depth + 1)) {
      return false;
    }
  }
  return true;
}

// Counts the values of `v` as a walk would meet them (a shared subtree once per use), stopping
// past `budget`: true when within it. Keeps the later walks (ToPlainValue, the emitter) bounded.
bool WithinValueBudget(const PickleValue& v, uint64_t* budget, int depth) {
  if (depth > kMaxPickleWalkDepth || *budget == 0) return false;
  --*budget;
  for (const PickleValue* child : {v.callable, v.args, v.kwargs, v.state}) {
    if (child != nullptr && !WithinValueBudget(*child, budget, depth + 1)) return false;
  }
  for (const PickleValue* item : v.items) {
    if (!WithinValueBudget(*item, budget, depth + 1)) return false;
  }
  return true;
}

// What the keys of a common.pt of `archive_bytes` may take (kCommonKeyBytesBase).
uint64_t CommonKeyCap(uint64_t archive_bytes) {
  return kCommonKeyBytesBase + kCommonKeyBytesPerByte * archive_bytes;
}

// The bytes an object's key takes: its dotted name as the object's name and the path's fqn, and
// the path itself.
uint64_t KeyCost(const std::vector<PathStep>& at, size_t dotted_size) {
  uint64_t cost = 2 * uint64_t{dotted_size};
  for (const PathStep& s : at) {
    cost += 32 + (std::holds_alternative<std::string>(s) ? std::get<std::string>(s).size() : 0);
  }
  return cost;
}

class CommonDecoder {
 public:
  // kCountKeys walks as the decoder does, checking only the keys against `key_cap` (what
  // CommonEncoder checks its output with); kDecode also re-emits each object.
  enum class Mode { kDecode, kCountKeys };
  CommonDecoder(const SourceArchive& source, std::string_view path, uint64_t payload_cap,
                uint64_t key_cap, Mode mode = Mode::kDecode)
      : source_(source), path_(path), payload_cap_(payload_cap), key_cap_(key_cap), mode_(mode) {}

  Status Visit(const PickleValue& v, std::vector<PathStep>& at, int depth);
  MegatronCommon& result() { return result_; }

 private:
  Status Leaf(const PickleValue& v, const std::vector<PathStep>& at);
  // A key past 256 characters is shortened to its first and last 120 (hostile paths are long).
  Status Err(const std::vector<PathStep>& at, const std::string& problem) const {
    std::string key = Dotted(at);
    if (key.size() > 256) key = key.substr(0, 120) + "..." + key.substr(key.size() - 120);
    return DataLossError("Megatron common state " + path_ + ": key '" + key + "': " + problem);
  }
  static std::string Dotted(const std::vector<PathStep>& at) {
    std::string out;
    for (const PathStep& s : at) {
      if (!out.empty()) out += ".";
      out += std::holds_alternative<int64_t>(s) ? std::to_string(std::get<int64_t>(s))
                                                : std::get<std::string>(s);
    }
    return out;
  }

  const SourceArchive& source_;
  std::string path_;
  uint64_t payload_cap_;
  uint64_t payload_bytes_ = 0;
  uint64_t key_cap_;
  uint64_t key_bytes_ = 0;
  Mode mode_;
  MegatronCommon result_;
};

Status CommonDecoder::Visit(const PickleValue& v, std::vector<PathStep>& at, int depth) {
  if (depth > kMaxPickleWalkDepth) {
    return Err(at, "nested deeper than " + std::to_string(kMaxPickleWalkDepth));
  }
  const bool mapping = IsMapping(v);
  if (at.empty() && !mapping) {
    return DataLossError("Megatron common state " + path_ + ": the root is " +
                         DescribePickleValue(v) + ", expected a dict");
  }
  const bool sequence = (v.is(Kind::kList) || v.is(Kind::kTuple)) && !IsPlainSequence(v, 0);
  const bool walk = at.empty() || (mapping && v.pair_count() > 0 && HasStrKeys(v)) || sequence;
  if (!walk) return Leaf(v, at);
  if (mapping) {
    for (size_t i = 0; i < v.pair_count(); ++i) {
      if (!v.key(i).is(Kind::kString)) {
        return Err(at, "dict key is " + DescribePickleValue(v.key(i)) + ", expected a str");
      }
      at.push_back(v.key(i).text);
      SP_RETURN_IF_ERROR(Visit(v.value(i), at, depth + 1));
      at.pop_back();
    }
    return OkStatus();
  }
  if (sequence) {
    for (size_t i = 0; i < v.items.size(); ++i) {
      at.push_back(static_cast<int64_t>(i));
      SP_RETURN_IF_ERROR(Visit(*v.items[i], at, depth + 1));
      at.pop_back();
    }
  }
  return OkStatus();
}

// Plain data becomes an exact plain object (read without pickle); anything else the re-emitted
// value as a torch.save archive.
Status CommonDecoder::Leaf(const PickleValue& v, const std::vector<PathStep>& at) {
  std::string key = Dotted(at);
  key_bytes_ += KeyCost(at, key.size());
  if (key_bytes_ > key_cap_) {
    return Err(at, "the keys of the objects so far take more than " + std::to_string(key_cap_) +
                       " bytes (a long path shared by many objects?)");
  }
  if (mode_ == Mode::kCountKeys) return OkStatus();
  std::string archive;
  ObjectEncoding encoding = ObjectEncoding::kTorchSave;
  // The whole archive is within kMaxReemittedValues (WithinValueBudget in DecodeMegatronCommon).
  Result<PlainValue> plain = ToPlainValue(v, key, kMaxReemittedValues);
  if (plain.ok()) {
    SP_ASSIGN_OR_RETURN(archive, EncodePlainPickle(*plain));
    encoding = ObjectEncoding::kPlain;
  } else {
    ArchiveEmitter emitter(path_ + " key '" + key + "'");
    SP_RETURN_IF_ERROR(emitter.Emit(v, source_));
    SP_ASSIGN_OR_RETURN(archive, emitter.Finish("archive/"));
  }
  payload_bytes_ += archive.size();
  if (payload_bytes_ > payload_cap_) {
    return Err(at, "the objects re-emitted so far exceed " + std::to_string(payload_cap_) +
                       " bytes (storages shared by many keys?)");
  }
  result_.objects.push_back(ObjectEntry{key, encoding, std::move(archive)});
  result_.paths.push_back(DcpPlannerPath{key, at});
  return OkStatus();
}

// objects -> common.pt -----------------------------------------------------------------------

struct TreeNode {
  bool is_list = false;
  int leaf = -1;                                     // index into the objects, or -1
  std::vector<std::pair<PathStep, size_t>> children;  // insertion order
};

class CommonEncoder {
 public:
  explicit CommonEncoder(const std::vector<MegatronObjectArchive>& objects) : objects_(objects) {}

  Status Add(size_t object, const std::vector<PathStep>& path);
  Result<std::string> Finish();

 private:
  Status EmitNode(size_t node, int depth);
  Status Conflict(size_t object) const {
    return InvalidArgumentError("object '" + objects_[object].name +
                                "': its path conflicts with another object's for common.pt");
  }

  const std::vector<MegatronObjectArchive>& objects_;
  std::vector<TreeNode> nodes_ = std::vector<TreeNode>(1);  // node 0: the root dict
  ArchiveEmitter emitter_{"common.pt"};
  uint64_t padding_left_ = kCommonPaddingBase;  // grows by kCommonPaddingPerStep per path step
};

Status CommonEncoder::Add(size_t object, const std::vector<PathStep>& path) {
  if (path.empty() || path.size() > static_cast<size_t>(kMaxPickleWalkDepth)) {
    return Conflict(object);
  }
  padding_left_ += kCommonPaddingPerStep * path.size();
  size_t node = 0;
  for (size_t i = 0; i < path.size(); ++i) {
    const bool int_step = std::holds_alternative<int64_t>(path[i]);
    if (nodes_[node].leaf >= 0 || nodes_[node].is_list != int_step) return Conflict(object);
    if (int_step && (std::get<int64_t>(path[i]) < 0 || std::get<int64_t>(path[i]) >= (1 << 20))) {
      return Conflict(object);
    }
    size_t child = SIZE_MAX;
    for (const auto& [step, index] : nodes_[node].children) {
      if (step == path[i]) child = index;
    }
    if (child == SIZE_MAX) {
      child = nodes_.size();
      nodes_.emplace_back();
      if (i + 1 < path.size()) nodes_.back().is_list = std::holds_alternative<int64_t>(path[i + 1]);
      nodes_[node].children.emplace_back(path[i], child);
    }
    node = child;
  }
  if (nodes_[node].leaf >= 0 || !nodes_[node].children.empty()) return Conflict(object);
  nodes_[node].leaf = static_cast<int>(object);
  return OkStatus();
}

// The containers around the objects count against the readers' limits as the objects' own
// values do (DecodeMegatronCommon walks common.pt from its root): an object nested near the limit
// is refused here, naming it, rather than written into a common.pt that no reader accepts
// (found by fuzz/objects_fuzz.cc).
Status CommonEncoder::EmitNode(size_t node, int depth) {
  const TreeNode& n = nodes_[node];
  PickleWriter& w = emitter_.writer();
  if (n.leaf >= 0) {
    const MegatronObjectArchive& o = objects_[n.leaf];
    const std::string what = "object '" + o.name + "'";
    Result<SourceArchive> source = OpenSourceArchive(AsBytes(o.archive), what);
    if (!source.ok()) return InvalidArgumentError(source.status().message());
    Status emitted = emitter_.Emit(source->pickle.root(), *source, depth);
    if (!emitted.ok()) {
      return InvalidArgumentError(what + " cannot be written to common.pt at depth " +
                                  std::to_string(depth) + ": " + std::string(emitted.message()));
    }
    return OkStatus();
  }
  SP_RETURN_IF_ERROR(emitter_.Count(depth));
  Status status;
  if (!n.is_list) {
    w.EmptyDict();
    w.DictItems(n.children.size(), [&](size_t i) {
      w.String(std::get<std::string>(n.children[i].first));
      if (status.ok()) status = emitter_.Count(depth + 1);  // the key
      if (status.ok()) status = EmitNode(n.children[i].second, depth + 1);
    });
    return status;
  }
  std::map<int64_t, size_t> by_index;  // list positions without an object are None, as in Python
  for (const auto& [step, index] : n.children) by_index[std::get<int64_t>(step)] = index;
  const size_t length = by_index.empty() ? 0 : static_cast<size_t>(by_index.rbegin()->first) + 1;
  const uint64_t padding = length - by_index.size();
  if (padding > padding_left_) {
    return InvalidArgumentError(
        "common.pt: the objects' paths leave " + std::to_string(padding) +
        " positions of a list empty (None); more than the " + std::to_string(padding_left_) +
        " their paths allow (list positions too large for the few objects that fill them)");
  }
  padding_left_ -= padding;
  w.EmptyList();
  w.ListItems(length, [&](size_t i) {
    auto it = by_index.find(static_cast<int64_t>(i));
    if (it == by_index.end()) {
      w.None();
      if (status.ok()) status = emitter_.Count(depth + 1);
    } else if (status.ok()) {
      status = EmitNode(it->second, depth + 1);
    }
  });
  return status;
}

// What is written reads back: the keys the readers would make of the archive are within their
// limit (kCommonKeyBytesBase), checked by walking the archive as they do.
Result<std::string> CommonEncoder::Finish() {
  SP_RETURN_IF_ERROR(EmitNode(0, 0));
  SP_ASSIGN_OR_RETURN(std::string archive, emitter_.Finish("common/"));
  Result<SourceArchive> source = OpenSourceArchive(AsBytes(archive), "common.pt");
  if (!source.ok()) return InvalidArgumentError(source.status().message());
  CommonDecoder keys(*source, "common.pt", UINT64_MAX, CommonKeyCap(archive.size()),
                     CommonDecoder::Mode::kCountKeys);
  std::vector<PathStep> at;
  Status walked = keys.Visit(source->pickle.root(), at, 0);
  if (!walked.ok()) return InvalidArgumentError(walked.message());
  return archive;
}

}  // namespace

Result<MegatronConfig> ParseMegatronConfig(std::string_view text, std::string_view path) {
  if (text.size() > kMaxMegatronConfigBytes) {
    return DataLossError("Megatron config " + std::string(path) + ": " +
                         std::to_string(text.size()) + " bytes is larger than the limit");
  }
  const std::string what = "Megatron config " + std::string(path);
  SP_ASSIGN_OR_RETURN(JsonValue root, ParseJson(text, what, JsonSyntax::kFull));
  if (!root.is_object()) return DataLossError(what + " is not a JSON object");
  SP_ASSIGN_OR_RETURN(const JsonValue* backend, Field(root, "sharded_backend"));
  if (backend == nullptr) {
    return DataLossError("Megatron config " + std::string(path) + " has no sharded_backend");
  }
  MegatronConfig c;
  SP_RETURN_IF_ERROR(ReadConfigString(root, "sharded_backend", path, &c.sharded_backend));
  SP_RETURN_IF_ERROR(
      ReadConfigVersion(root, "sharded_backend_version", path, &c.sharded_backend_version));
  SP_RETURN_IF_ERROR(ReadConfigString(root, "common_backend", path, &c.common_backend));
  SP_RETURN_IF_ERROR(
      ReadConfigVersion(root, "common_backend_version", path, &c.common_backend_version));
  if (c.sharded_backend != "torch_dist" || c.sharded_backend_version != 1) {
    return UnimplementedError("Megatron checkpoint " + std::string(path) + ": sharded_backend '" +
                              c.sharded_backend + "' version " +
                              std::to_string(c.sharded_backend_version) +
                              " is not supported (only torch_dist version 1)");
  }
  if (c.common_backend != "torch" || c.common_backend_version != 1) {
    return UnimplementedError("Megatron checkpoint " + std::string(path) + ": common_backend '" +
                              c.common_backend + "' version " +
                              std::to_string(c.common_backend_version) +
                              " is not supported (only torch version 1)");
  }
  return c;
}

std::string EncodeMegatronConfig(const MegatronConfig& config) {
  std::string out = "{\"sharded_backend\": ";
  AppendJsonString(&out, config.sharded_backend);
  out += ", \"sharded_backend_version\": " + std::to_string(config.sharded_backend_version) +
         ", \"common_backend\": ";
  AppendJsonString(&out, config.common_backend);
  return out + ", \"common_backend_version\": " + std::to_string(config.common_backend_version) +
         "}";
}

void AddMegatronConfigAttributes(const MegatronConfig& config, CheckpointMetadata* md) {
  const std::string p = kMegatronAttributePrefix;
  md->attributes[p + "sharded_backend"] = config.sharded_backend;
  md->attributes[p + "sharded_backend_version"] = std::to_string(config.sharded_backend_version);
  md->attributes[p + "common_backend"] = config.common_backend;
  md->attributes[p + "common_backend_version"] = std::to_string(config.common_backend_version);
}

Result<MegatronCommon> DecodeMegatronCommon(ByteView archive, std::string_view path) {
  if (archive.size() > kMaxMegatronCommonBytes) {
    return DataLossError("Megatron common state " + std::string(path) + ": " +
                         std::to_string(archive.size()) + " bytes is larger than the limit");
  }
  SP_ASSIGN_OR_RETURN(SourceArchive source, OpenSourceArchive(archive, path));
  uint64_t budget = kMaxReemittedValues;
  if (!WithinValueBudget(source.pickle.root(), &budget, 0)) {
    return DataLossError("Megatron common state " + std::string(path) + ": more than " +
                         std::to_string(kMaxReemittedValues) + " values or nesting deeper than " +
                         std::to_string(kMaxPickleWalkDepth));
  }
  // Each leaf's archive holds its own copy of the storages it uses: allow some sharing, but not
  // a blow-up from one storage named by many keys.
  CommonDecoder decoder(source, path, 4 * archive.size() + (uint64_t{1} << 20),
                        CommonKeyCap(archive.size()));
  std::vector<PathStep> at;
  SP_RETURN_IF_ERROR(decoder.Visit(source.pickle.root(), at, 0));
  return std::move(decoder.result());
}

Result<std::string> EncodeMegatronCommon(const std::vector<MegatronObjectArchive>& objects,
                                         const std::vector<DcpPlannerPath>& paths) {
  std::map<std::string_view, const std::vector<PathStep>*> path_of;
  for (const DcpPlannerPath& p : paths) path_of[p.fqn] = &p.path;
  CommonEncoder encoder(objects);
  for (size_t i = 0; i < objects.size(); ++i) {
    auto it = path_of.find(objects[i].name);
    const std::vector<PathStep> own = {objects[i].name};
    SP_RETURN_IF_ERROR(encoder.Add(i, it == path_of.end() ? own : *it->second));
  }
  return encoder.Finish();
}

namespace {

// Appends [key, [step, ...]] entries to the JSON list in the paths attribute.
void AppendPaths(const std::vector<DcpPlannerPath>& paths, std::string* attribute) {
  std::string out;
  for (const DcpPlannerPath& p : paths) {
    out += out.empty() ? "[" : ", [";
    AppendJsonString(&out, p.fqn);
    out += ", [";
    for (size_t i = 0; i < p.path.size(); ++i) {
      if (i) out += ", ";
      if (std::holds_alternative<int64_t>(p.path[i])) {
        out += std::to_string(std::get<int64_t>(p.path[i]));
      } else {
        AppendJsonString(&out, std::get<std::string>(p.path[i]));
      }
    }
    out += "]]";
  }
  if (out.empty()) return;
  if (attribute->size() < 2 || attribute->back() != ']') {
    *attribute = "[" + out + "]";
  } else if (*attribute == "[]") {
    *attribute = "[" + out + "]";
  } else {
    attribute->pop_back();
    *attribute += ", " + out + "]";
  }
}

}  // namespace

Status AddMegatronFiles(Store& store, std::string_view path, CheckpointMetadata* md) {
  const std::string config_path = JoinPath(path, kMegatronConfigFileName);
  SP_ASSIGN_OR_RETURN(bool megatron, store.Exists(config_path));
  if (!megatron) return OkStatus();
  SP_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(store, config_path, kMaxMegatronConfigBytes));
  SP_ASSIGN_OR_RETURN(MegatronConfig config, ParseMegatronConfig(text, config_path));
  AddMegatronConfigAttributes(config, md);
  const std::string common_path = JoinPath(path, kMegatronCommonFileName);
  SP_ASSIGN_OR_RETURN(bool has_common, store.Exists(common_path));
  if (!has_common) {
    return DataLossError(common_path + " is missing (" + config_path +
                         " says this is a Megatron checkpoint; megatron-core writes both)");
  }
  SP_ASSIGN_OR_RETURN(std::string archive,
                      ReadSmallFile(store, common_path, kMaxMegatronCommonBytes));
  SP_ASSIGN_OR_RETURN(MegatronCommon common, DecodeMegatronCommon(AsBytes(archive), common_path));
  for (const ObjectEntry& o : common.objects) {
    if (md->FindObject(o.name) != nullptr || md->FindTensor(o.name) != nullptr) {
      return DataLossError(common_path + ": key '" + o.name + "' is also stored in " +
                           JoinPath(path, kDcpMetadataFileName));
    }
  }
  AppendPaths(common.paths, &md->attributes[kStateDictPathsAttribute]);
  for (ObjectEntry& o : common.objects) md->objects.push_back(std::move(o));
  std::sort(md->objects.begin(), md->objects.end(),
            [](const ObjectEntry& a, const ObjectEntry& b) { return a.name < b.name; });
  return OkStatus();
}

Result<std::string> ReemitTorchSaveArchive(ByteView archive, std::string_view what) {
  SP_ASSIGN_OR_RETURN(SourceArchive source, OpenSourceArchive(archive, what));
  ArchiveEmitter emitter(what);
  SP_RETURN_IF_ERROR(emitter.Emit(source.pickle.root(), source));
  return emitter.Finish("archive/");
}

}  // namespace sp::torch_dcp
