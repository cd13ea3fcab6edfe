#include "shardpoint/manage/consolidate.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "shardpoint/manage/consolidate_plan.h"
#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/base/json.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/geometry/convert.h"
#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using testing::Iota;
using testing::MakeTensor;
using testing::SaveWhole;
using testing::WholeTensor;

TEST(ParseByteSizeTest, HuggingFaceSizes) {
  EXPECT_EQ(*ParseByteSize("5GB"), 5'000'000'000u);
  EXPECT_EQ(*ParseByteSize("500MB"), 500'000'000u);
  EXPECT_EQ(*ParseByteSize("2GiB"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseByteSize("10kb"), 10'000u);
  EXPECT_EQ(*ParseByteSize("1.5 GB"), 1'500'000'000u);
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("64KiB"), 65536u);
  for (std::string_view bad : {"", "GB", "5XB", "-5GB", "0", "0GB", "1..5GB", ".5GB", "5.GB",
                               "99999999999999999999", "20000000TB"}) {
    Result<uint64_t> r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("invalid size '" + std::string(bad) + "'"),
              std::string::npos)
        << r.status();
  }
}

TEST(ParseConsolidateDTypeTest, ShortAndLongNames) {
  EXPECT_EQ(*ParseConsolidateDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseConsolidateDType("BF16"), DType::kBFloat16);
  EXPECT_EQ(*ParseConsolidateDType("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseConsolidateDType("fp16"), DType::kFloat16);
  EXPECT_EQ(*ParseConsolidateDType("float32"), DType::kFloat32);
  EXPECT_EQ(ParseConsolidateDType("fp12").status().code(), StatusCode::kInvalidArgument);
}

CheckpointMetadata SampleMetadata(const std::vector<std::pair<std::string, Shape>>& tensors,
                                  DType dtype = DType::kFloat32) {
  CheckpointMetadata md;
  for (const auto& [name, shape] : tensors) md.tensors.push_back({name, dtype, shape, {}});
  std::sort(md.tensors.begin(), md.tensors.end(),
            [](const TensorMetadata& a, const TensorMetadata& b) { return a.name < b.name; });
  return md;
}

TEST(ConsolidatePlanTest, ShardsBySizeLikeHuggingFace) {
  // 400, 400, 1200 and 40 bytes with a 1000-byte limit: [a b] [c] [d].
  CheckpointMetadata md =
      SampleMetadata({{"a", {100}}, {"b", {100}}, {"c", {300}}, {"d", {10}}});
  ConsolidateOptions options;
  options.max_shard_bytes = 1000;
  Result<ConsolidationPlan> plan = PlanConsolidation(md, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->files.size(), 3u);
  EXPECT_EQ(plan->files[0].name, "model-00001-of-00003.safetensors");
  EXPECT_EQ(plan->files[2].name, "model-00003-of-00003.safetensors");
  EXPECT_EQ(plan->files[0].tensors.size(), 2u);
  EXPECT_EQ(plan->files[1].tensors[0].name, "c");
  EXPECT_EQ(plan->total_bytes, 2040u);
  EXPECT_EQ(plan->index_name, "model.safetensors.index.json");
  EXPECT_EQ(plan->index_json,
            "{\n  \"metadata\": {\n    \"total_size\": 2040\n  },\n  \"weight_map\": {\n"
            "    \"a\": \"model-00001-of-00003.safetensors\",\n"
            "    \"b\": \"model-00001-of-00003.safetensors\",\n"
            "    \"c\": \"model-00002-of-00003.safetensors\",\n"
            "    \"d\": \"model-00003-of-00003.safetensors\"\n  }\n}\n");
  // The header is a valid safetensors header of the planned size, with {"format": "pt"}.
  const OutputFile& f = plan->files[0];
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(f.head, f.size, f.name);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->metadata.at("format"), "pt");
  EXPECT_EQ(f.tensors[1].file_offset, header->data_start + 400);
  options.max_shard_bytes = 5000;
  plan = PlanConsolidation(md, options);
  ASSERT_EQ(plan->files.size(), 1u);
  EXPECT_EQ(plan->files[0].name, "model.safetensors");
  EXPECT_TRUE(plan->index_name.empty());
}

TEST(ConsolidatePlanTest, KeysPrefixesRenamesAndDtypes) {
  CheckpointMetadata md = SampleMetadata(
      {{"model.layers.0.w", {2}}, {"model.layers.0.b", {2}}, {"model.layers.10.w", {2}},
       {"model.embed", {4}}, {"lm_head", {4}}});
  md.tensors.push_back({"step", DType::kInt64, {}, {}});
  ConsolidateOptions options;
  options.keys = {"model.layers.1", "model.layers.0", "step"};  // .1 selects nothing
  EXPECT_EQ(SelectOutputTensors(md, options).status().message(),
            "key 'model.layers.1' selects no tensor of the checkpoint");
  options.keys = {"model.layers.0", "step"};
  options.prefixes = {"model.layers.1"};
  options.rename = {{"model.layers.", "layers."}, {"model.", ""}};
  options.dtype = DType::kBFloat16;
  Result<std::vector<OutputTensor>> out = SelectOutputTensors(md, options);
  ASSERT_TRUE(out.ok()) << out.status();
  std::map<std::string, std::pair<std::string, DType>> got;
  for (const OutputTensor& t : *out) got[t.name] = {t.source->name, t.dtype};
  EXPECT_EQ(got, (std::map<std::string, std::pair<std::string, DType>>{
                     {"layers.0.b", {"model.layers.0.b", DType::kBFloat16}},
                     {"layers.0.w", {"model.layers.0.w", DType::kBFloat16}},
                     {"layers.10.w", {"model.layers.10.w", DType::kBFloat16}},
                     {"step", {"step", DType::kInt64}}}));
  EXPECT_EQ((*out)[0].bytes, 4u);
  options = {};
  options.rename = {{"model.embed", "lm_head"}};
  EXPECT_EQ(SelectOutputTensors(md, options).status().message(),
            "tensors 'lm_head' and 'model.embed' would both be written as 'lm_head'");
  options.rename = {{"lm_head", "__metadata__"}};
  EXPECT_EQ(SelectOutputTensors(md, options).status().code(), StatusCode::kInvalidArgument);
}

std::vector<std::string> OutputNames(const CheckpointMetadata& md, const ConsolidateOptions& options,
                                     std::string* selection = nullptr) {
  Result<std::vector<OutputTensor>> out = SelectOutputTensors(md, options, selection);
  EXPECT_TRUE(out.ok()) << out.status();
  std::vector<std::string> names;
  for (const OutputTensor& t : out.ok() ? *out : std::vector<OutputTensor>{}) names.push_back(t.name);
  return names;
}

TEST(ConsolidatePlanTest, TrainingCheckpointUnderModelExportsTheModelWeightsWithoutThePrefix) {
  CheckpointMetadata md = SampleMetadata({{"model.embed.weight", {4}}, {"model.lm_head.weight", {4}},
                                          {"optimizer.state.embed.weight.exp_avg", {4}},
                                          {"optimizer.state.embed.weight.step", {1}},
                                          {"lr_scheduler.last_epoch", {1}}});
  std::string selection;
  EXPECT_EQ(OutputNames(md, {}, &selection), (std::vector<std::string>{"embed.weight", "lm_head.weight"}));
  EXPECT_EQ(selection,
            "exported the model weights: 2 tensors under 'model.' (the prefix removed); left out "
            "the training state: lr_scheduler (1 tensor), optimizer (2 tensors); pass keys or "
            "prefixes (or all tensors) to choose otherwise");
  ConsolidateOptions all;
  all.all_tensors = true;
  EXPECT_EQ(OutputNames(md, all, &selection).size(), 5u);
  EXPECT_EQ(selection, "exported every tensor");
  ConsolidateOptions keys;  // the caller's keys win over the default, with no prefix removed
  keys.keys = {"optimizer"};
  EXPECT_EQ(OutputNames(md, keys).size(), 2u);
  ConsolidateOptions renamed;  // renames apply to the names the default gives
  renamed.rename = {{"embed.", "tok."}};
  EXPECT_EQ(OutputNames(md, renamed), (std::vector<std::string>{"lm_head.weight", "tok.weight"}));
}

TEST(ConsolidatePlanTest, TopLevelModelNamesKeepTheirNamesAndLeaveTheTrainingStateOut) {
  // torchtitan's layout: the model's names at the top level beside optimizer and train_state.
  CheckpointMetadata md = SampleMetadata({{"tok_embeddings.weight", {4}}, {"model.norm.weight", {4}},
                                          {"optimizer.state.tok_embeddings.weight.exp_avg", {4}},
                                          {"train_state.step", {1}}});
  std::string selection;
  EXPECT_EQ(OutputNames(md, {}, &selection),
            (std::vector<std::string>{"model.norm.weight", "tok_embeddings.weight"}));
  EXPECT_EQ(selection.substr(0, 68), "exported the model weights: 2 tensors outside the training state; le");
}

TEST(ConsolidatePlanTest, CheckpointsWithoutTrainingStateExportEveryTensor) {
  std::string selection;
  CheckpointMetadata weights = SampleMetadata({{"model.embed.weight", {4}}, {"lm_head.weight", {4}}});
  EXPECT_EQ(OutputNames(weights, {}, &selection).size(), 2u);
  EXPECT_EQ(selection, "exported every tensor (2 tensors; no training state to leave out)");
  CheckpointMetadata only_state = SampleMetadata({{"optim.m", {4}}});
  EXPECT_EQ(OutputNames(only_state, {}, &selection), (std::vector<std::string>{"optim.m"}));
  EXPECT_EQ(selection, "exported every tensor (1 tensor; the checkpoint holds training state only)");
  // "optimizer_extra" is not the component "optimizer": a model may name a module that way.
  CheckpointMetadata lookalike = SampleMetadata({{"optimizer_extra.w", {4}}, {"w", {4}}});
  EXPECT_EQ(OutputNames(lookalike, {}).size(), 2u);
}

TEST(ConsolidatePlanTest, OutputNames) {
  EXPECT_EQ(ShardFileName(ConsolidateFormat::kTorch, 2, 7), "pytorch_model-00002-of-00007.bin");
  EXPECT_TRUE(IsOutputFileName(ConsolidateFormat::kSafetensors, "model-00002-of-00007.safetensors"));
  EXPECT_TRUE(IsOutputFileName(ConsolidateFormat::kSafetensors, "model.safetensors.index.json"));
  EXPECT_FALSE(IsOutputFileName(ConsolidateFormat::kSafetensors, "model-x-of-2.safetensors"));
  EXPECT_FALSE(IsOutputFileName(ConsolidateFormat::kSafetensors, "pytorch_model.bin"));
  EXPECT_FALSE(IsOutputFileName(ConsolidateFormat::kSafetensors, "config.json"));
  EXPECT_TRUE(IsOutputFileName(ConsolidateFormat::kTorch, "pytorch_model.bin.index.json"));
}

// Consolidation end to end on an in-memory store.
class ConsolidateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = {Iota("model.embed", {37, 24}), Iota("model.w3d", {3, 2, 40000}, 7),
                Iota("model.bias", {5}, -2), Iota("empty", {0, 4}),
                MakeTensor<int64_t>("step", DType::kInt64, {}, {42}, 0),
                MakeTensor<uint16_t>("half", DType::kFloat16, {4}, {0x3c00, 0x4000, 0x7bff, 0})};
    ASSERT_TRUE(SaveWhole(&store_, "/ckpt", tensors_, {}, /*ranks=*/3).ok());
    options_.store = &store_;
    options_.threads = 3;
  }

  const WholeTensor& Source(const std::string& name) const {
    for (const WholeTensor& t : tensors_) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << name;
    return tensors_[0];
  }

  // Every output file, parsed: tensor name -> (dtype, shape, bytes).
  std::map<std::string, std::tuple<DType, Shape, std::string>> ReadOutputs(
      const ConsolidateResult& result, const std::string& dir = "/out") {
    std::map<std::string, std::tuple<DType, Shape, std::string>> out;
    for (const std::string& name : result.files) {
      std::string bytes = *store_.ReadFile(JoinPath(dir, name));
      Result<SafetensorsHeader> h = ParseSafetensorsHeader(bytes, bytes.size(), name);
      EXPECT_TRUE(h.ok()) << h.status();
      if (!h.ok()) continue;
      for (const SafetensorsEntry& e : h->entries) {
        out[e.name] = {e.dtype, e.shape, bytes.substr(h->data_start + e.begin, e.end - e.begin)};
      }
    }
    return out;
  }

  std::vector<std::string> DirNames(const std::string& dir = "/out") {
    std::vector<std::string> names;
    Result<std::vector<DirEntry>> entries = store_.ListDir(dir);
    EXPECT_TRUE(entries.ok()) << entries.status();
    for (const DirEntry& e : *entries) names.push_back(e.name);
    return names;
  }

  MemoryStore store_;
  std::vector<WholeTensor> tensors_;
  ConsolidateOptions options_;
};

TEST_F(ConsolidateTest, ShardedSaveBecomesBitExactWholeTensorsWithAnIndex) {
  options_.max_shard_bytes = 300'000;
  options_.memory_budget_bytes = 1;  // the smallest slabs: every tensor is cut many times
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  options_.progress = [&](uint64_t done, uint64_t total) { progress.push_back({done, total}); };
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->files.size(), 3u);  // 480,000 bytes of w3d alone; the rest in two shards
  EXPECT_EQ(result->index_file, "model.safetensors.index.json");
  EXPECT_EQ(result->tensors, 6u);
  EXPECT_EQ(result->total_bytes, 37 * 24 * 4 + 240000 * 4 + 5 * 4 + 8 + 8u);
  auto outputs = ReadOutputs(*result);
  ASSERT_EQ(outputs.size(), 6u);
  for (const WholeTensor& t : tensors_) {
    const auto& [dtype, shape, bytes] = outputs.at(t.name);
    EXPECT_EQ(dtype, t.dtype) << t.name;
    EXPECT_EQ(shape, t.shape) << t.name;
    EXPECT_TRUE(bytes == std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size()))
        << t.name;
  }
  Result<JsonValue> index = ParseJson(*store_.ReadFile("/out/model.safetensors.index.json"), "idx");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->values[0].values[0].number, result->total_bytes);
  EXPECT_EQ(index->values[1].keys.size(), 6u);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back(), std::make_pair(result->total_bytes, result->total_bytes));
  for (const std::string& name : DirNames()) EXPECT_NE(name.front(), '.') << name;
}

TEST_F(ConsolidateTest, Bf16ConversionRoundsLikeTorchAndKeepsIntegers) {
  options_.dtype = DType::kBFloat16;
  options_.keys = {"model", "step"};
  options_.rename = {{"model.", "m."}};
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->files, std::vector<std::string>{"model.safetensors"});
  auto outputs = ReadOutputs(*result);
  ASSERT_EQ(outputs.size(), 4u);  // no "empty" nor "half"
  for (const char* name : {"model.embed", "model.w3d", "model.bias"}) {
    const WholeTensor& t = Source(name);
    const auto& [dtype, shape, bytes] = outputs.at(std::string("m.") + (name + 6));
    EXPECT_EQ(dtype, DType::kBFloat16);
    std::string expected(t.bytes.size() / 2, '\0');
    ASSERT_TRUE(ConvertElements(DType::kFloat32, t.bytes.data(), DType::kBFloat16,
                                expected.data(), ShapeVolume(t.shape))
                    .ok());
    EXPECT_TRUE(bytes == expected) << name;
  }
  EXPECT_EQ(std::get<0>(outputs.at("step")), DType::kInt64);
}

TEST_F(ConsolidateTest, TorchFilesAreTorchSaveArchivesOfTheWholeTensors) {
  options_.format = ConsolidateFormat::kTorch;
  options_.max_shard_bytes = 300'000;
  options_.memory_budget_bytes = 1;  // many slabs per tensor: their CRC-32s are combined
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->files, (std::vector<std::string>{"pytorch_model-00001-of-00003.bin",
                                                     "pytorch_model-00002-of-00003.bin",
                                                     "pytorch_model-00003-of-00003.bin"}));
  EXPECT_EQ(result->index_file, "pytorch_model.bin.index.json");
  std::map<std::string, std::string> found;
  for (const std::string& name : result->files) {
    const std::string bytes = *store_.ReadFile(JoinPath("/out", name));
    auto parsed = torch_save::ParseTorchSaveStateDict(torch_save::MemoryRangeReader(AsBytes(bytes)),
                                                     bytes.size(), name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    for (const torch_save::TorchSaveNamedTensor& t : *parsed) {
      ASSERT_TRUE(t.info.IsDenseRowMajor()) << t.name;
      found[t.name] = bytes.substr(t.info.data_offset, t.info.storage_bytes);
      // The ZIP directory's CRC-32 of the entry is the CRC-32 of the tensor's bytes.
      auto dir = torch_save::ReadZipDirectory(torch_save::MemoryRangeReader(AsBytes(bytes)),
                                             bytes.size(), name);
      ASSERT_TRUE(dir.ok()) << dir.status();
      const torch_save::ZipEntry* entry = dir->Find(t.info.record);
      ASSERT_NE(entry, nullptr) << t.info.record;
      EXPECT_EQ(entry->crc32, Crc32(0, found[t.name].data(), found[t.name].size()))
          << t.name;
    }
  }
  ASSERT_EQ(found.size(), tensors_.size());
  for (const WholeTensor& t : tensors_) {
    EXPECT_TRUE(found.at(t.name) ==
                std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size()))
        << t.name;
  }
  EXPECT_NE(store_.ReadFile("/out/pytorch_model.bin.index.json")->find(
                "\"model.w3d\": \"pytorch_model-00002-of-00003.bin\""),
            std::string::npos);
}

TEST_F(ConsolidateTest, RefusesToOverwriteUnlessAskedAndThenRemovesStaleShards) {
  options_.max_shard_bytes = 300'000;
  ASSERT_TRUE(Consolidate("/ckpt", "/out", options_).ok());
  ASSERT_TRUE(store_.NewWritableFile("/out/config.json").ok());
  options_.max_shard_bytes = kDefaultMaxShardBytes;
  Result<ConsolidateResult> again = Consolidate("/ckpt", "/out", options_);
  ASSERT_EQ(again.status().code(), StatusCode::kAlreadyExists) << again.status();
  EXPECT_NE(again.status().message().find("/out already holds model-00001-of-00003.safetensors "
                                          "and 3 more output file(s)"),
            std::string::npos)
      << again.status();
  options_.overwrite = true;
  again = Consolidate("/ckpt", "/out", options_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(DirNames(), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(Consolidate("/ckpt", "/ckpt/", options_).status().code(),
            StatusCode::kInvalidArgument);
  options_.keys = {"nothing"};
  EXPECT_EQ(Consolidate("/ckpt", "/out2", options_).status().code(), StatusCode::kNotFound);
}

TEST_F(ConsolidateTest, AFailedReadLeavesNoOutputThatLooksFinished) {
  CheckpointMetadata md = *ReadCheckpointMetadata("/ckpt", &store_);
  const DataFile& victim = md.files[md.FindTensor("model.w3d")->chunks[1].file];
  {  // flip one byte inside the chunk: its checksum fails
    std::string bytes = *store_.ReadFile(JoinPath("/ckpt", victim.name));
    bytes[victim.data_start + md.FindTensor("model.w3d")->chunks[1].data_offset + 5] ^= 1;
    auto out = store_.NewWritableFile(JoinPath("/ckpt", victim.name));
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
  }
  options_.max_shard_bytes = 300'000;
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_EQ(result.status().code(), StatusCode::kDataLoss) << result.status();
  EXPECT_NE(result.status().message().find("checksum mismatch in tensor 'model.w3d'"),
            std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("consolidating tensor 'model.w3d'"), std::string::npos);
  EXPECT_FALSE(*store_.Exists("/out"));  // created by the call, removed when it failed
}

TEST_F(ConsolidateTest, AWriteErrorLeavesNoOutputAndNamesTheFile) {
  ASSERT_TRUE(store_.CreateDirs("/out").ok());
  ASSERT_TRUE(store_.NewWritableFile("/out/config.json").ok());
  FaultStore faulty(&store_);
  faulty.FailMatching(FaultStore::Op::kWrite, "model-00002",
                      ResourceExhaustedError("No space left on device"));
  options_.store = &faulty;
  options_.max_shard_bytes = 300'000;
  Result<ConsolidateResult> result = Consolidate("/ckpt", "/out", options_);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("model-00002-of-00003.safetensors"), std::string::npos)
      << result.status();
  EXPECT_EQ(DirNames(), std::vector<std::string>{"config.json"});  // temporaries removed
}

// A Hugging Face directory on an in-memory store: safetensors files written here.
class HfSourceTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(store_.CreateDirs("/hf").ok()); }

  // Writes `tensors` (with their DCP offsets when `offsets` is given) as one safetensors file.
  void WriteFile(const std::string& name, const std::vector<WholeTensor>& tensors,
                 const std::map<std::string, std::string>& metadata = {}) {
    std::vector<SafetensorsEntry> entries;
    std::string data;
    for (const WholeTensor& t : tensors) {
      entries.push_back({t.name, t.dtype, t.shape, data.size(), data.size() + t.bytes.size()});
      data.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    }
    auto out = store_.NewWritableFile(JoinPath("/hf", name));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(EncodeSafetensorsHeader(entries, metadata) + data)).ok());
  }

  // Rows [begin, end) of a 2-D float tensor, as its own tensor.
  static WholeTensor Rows(const WholeTensor& t, int64_t begin, int64_t end) {
    const size_t row = t.bytes.size() / t.shape[0];
    WholeTensor part{t.name, t.dtype, {end - begin, t.shape[1]}, {}, -1};
    part.bytes.assign(t.bytes.begin() + begin * row, t.bytes.begin() + end * row);
    return part;
  }

  std::string Bytes(const WholeTensor& t) {
    return std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }

  MemoryStore store_;
};

TEST_F(HfSourceTest, LoadingIntoAShardedLayoutReadsOnlyEachRanksRows) {
  const WholeTensor w = Iota("model.w", {64, 1024});  // 256 KiB
  const WholeTensor b = Iota("model.b", {1024}, 5);
  WriteFile("model-00001-of-00002.safetensors", {w});
  WriteFile("model-00002-of-00002.safetensors", {b});
  std::vector<std::vector<float>> got(2, std::vector<float>(32 * 1024));
  std::vector<uint64_t> bytes_read(2);
  std::vector<Status> statuses = RunRanks(2, [&](Communicator& comm) -> Status {
    const int r = comm.rank();
    LoadState state;
    state.tensors.push_back({"model.w", DType::kFloat32, {64, 1024},
                             {{Box({32 * r, 0}, {32, 1024}),
                               reinterpret_cast<std::byte*>(got[r].data())}}});
    LoadOptions options;
    options.comm = &comm;
    options.store = &store_;
    options.strict = false;
    SP_ASSIGN_OR_RETURN(LoadResult result, Load(state, "/hf", options));
    bytes_read[r] = result.bytes_read;
    if (result.unexpected_keys != std::vector<std::string>{"model.b"}) {
      return InternalError("unexpected keys wrong");
    }
    return OkStatus();
  });
  for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(bytes_read[r], 128u << 10) << "rank " << r;  // its half, nothing else
    EXPECT_EQ(std::memcmp(got[r].data(), w.bytes.data() + r * (128 << 10), 128 << 10), 0);
  }
}

TEST_F(HfSourceTest, DcpShardedSafetensorsConsolidateIntoWholeTensors) {
  const WholeTensor w = Iota("w", {10, 6});
  const WholeTensor v = Iota("v", {4, 3}, 100);
  WriteFile("shard-00001-model-00001-of-00001.safetensors", {Rows(w, 0, 4), Rows(v, 0, 2)},
            {{"DCP_SHARDING_INFO",
              R"({"w": {"saved_offsets": [0, 0]}, "v": {"saved_offsets": [0, 0]}})"}});
  WriteFile("shard-00002-model-00001-of-00001.safetensors", {Rows(w, 4, 10), Rows(v, 2, 4)},
            {{"DCP_SHARDING_INFO",
              R"({"w": {"saved_offsets": [4, 0]}, "v": {"saved_offsets": [2, 0]}})"}});
  ConsolidateOptions options;
  options.store = &store_;
  Result<ConsolidateResult> result = Consolidate("/hf", "/out", options);
  ASSERT_TRUE(result.ok()) << result.status();
  std::string file = *store_.ReadFile("/out/model.safetensors");
  Result<SafetensorsHeader> h = ParseSafetensorsHeader(file, file.size(), "out");
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->entries.size(), 2u);
  EXPECT_EQ(h->entries[0].name, "v");
  EXPECT_EQ(h->entries[1].shape, (Shape{10, 6}));
  EXPECT_EQ(file.substr(h->data_start), Bytes(v) + Bytes(w));
  // A consolidated single file is itself a checkpoint that consolidates to the same bytes.
  ASSERT_TRUE(Consolidate("/out/model.safetensors", "/again", options).ok());
  EXPECT_EQ(*store_.ReadFile("/again/model.safetensors"), file);
}

TEST_F(HfSourceTest, VerifyChecksCoverageAndSaysThereAreNoChecksums) {
  const WholeTensor w = Iota("w", {10, 6});
  WriteFile("a.safetensors", {Rows(w, 0, 4)},
            {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [0, 0]}})"}});
  WriteFile("b.safetensors", {Rows(w, 7, 10)},
            {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [7, 0]}})"}});
  Result<VerifyReport> report = Verify("/hf", &store_);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->has_checksums);
  EXPECT_EQ(report->files_checked, 2u);
  ASSERT_EQ(report->defects.size(), 1u);
  EXPECT_EQ(report->defects[0], "tensor 'w': chunks cover 42 of 60 elements");
  ConsolidateOptions options;
  options.store = &store_;
  Result<ConsolidateResult> result = Consolidate("/hf", "/out", options);
  ASSERT_EQ(result.status().code(), StatusCode::kDataLoss) << result.status();
  EXPECT_NE(result.status().message().find("18 elements are missing"), std::string::npos)
      << result.status();
  EXPECT_FALSE(*store_.Exists("/out"));  // the plan failed before any output
}

}  // namespace
}  // namespace sp
