#include "shardpoint/format/torch_dcp/megatron.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <variant>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/megatron_emit.h"
#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp::torch_dcp {

using torch_save::BuildZip;
using torch_save::DecodePlainPickle;
using torch_save::EncodePlainObjectItem;
using torch_save::FindAttribute;
using torch_save::IsObjectOf;
using torch_save::MemoryRangeReader;
using torch_save::ParseTorchSaveObject;
using torch_save::ParseTorchSaveTensor;
using torch_save::PickleValue;
using torch_save::PickleWriter;
using torch_save::PlainValue;
using torch_save::ReadZipEntry;
using torch_save::TorchSaveTensorInfo;
using torch_save::ZipEntry;

namespace {

using P = PlainValue;

// A string literal with embedded NULs, without its terminator.
template <size_t N>
std::string Raw(const char (&s)[N]) {
  return std::string(s, N - 1);
}

// A torch.save-like archive under "common/" with `pickle` as data.pkl and `storages` as
// data/<key> records.
std::string Archive(std::string pickle, std::vector<std::pair<std::string, std::string>> storages = {}) {
  std::vector<std::pair<std::string, std::string>> records = {{"common/data.pkl", std::move(pickle)},
                                                              {"common/byteorder", "little"}};
  for (auto& [key, bytes] : storages) records.emplace_back("common/data/" + key, std::move(bytes));
  records.emplace_back("common/version", "3\n");
  Result<std::string> zip = BuildZip(records);
  EXPECT_TRUE(zip.ok()) << zip.status();
  return zip.ok() ? *zip : std::string();
}

// Pushes argparse.Namespace(lr=0.1) as CPython's protocol-2 pickler does.
void PushNamespace(PickleWriter& w) {
  w.Global("argparse", "Namespace");
  w.Tuple(0);
  w.NewObj();
  w.EmptyDict();
  w.String("lr");
  w.Float(0.1);
  w.SetItem();
  w.Build();
}

// A float32 tensor of 2 elements over storage key `key`.
void PushTensor(PickleWriter& w, std::string_view key) { PushFloatTensor(w, key, 2, {2}); }

// {"iteration": 7, "args": Namespace(lr=0.1), "nested": {"x": [1, 2], "s": "hi"},
//  "empty": {}, "t": tensor([1.0, 2.0])}
std::string CommonArchive() {
  PickleWriter w;
  w.EmptyDict();
  w.Mark();
  w.String("iteration");
  w.Int(7);
  w.String("args");
  PushNamespace(w);
  w.String("nested");
  w.EmptyDict();
  w.Mark();
  w.String("x");
  w.EmptyList();
  w.ListItems(2, [&](size_t i) { w.Int(static_cast<int64_t>(i) + 1); });
  w.String("s");
  w.String("hi");
  w.SetItems();
  w.String("empty");
  w.EmptyDict();
  w.String("t");
  PushTensor(w, "0");
  w.SetItems();
  const float data[2] = {1.0f, 2.0f};
  return Archive(w.Finish(), {{"0", std::string(reinterpret_cast<const char*>(data), 8)}});
}

// The value of a plain object (ObjectEncoding::kPlain) or of a plain-data torch.save archive.
Result<PlainValue> PlainOf(const ObjectEntry& o, std::string_view what) {
  if (o.encoding == ObjectEncoding::kPlain) return DecodePlainPickle(o.payload, what);
  return ParseTorchSaveObject(MemoryRangeReader(AsBytes(o.payload)), o.payload.size(), what);
}

// The torch.save archive Megatron's common.pt writer takes for an object.
std::string ArchiveOf(const ObjectEntry& o) {
  if (o.encoding != ObjectEncoding::kPlain) return o.payload;
  Result<PlainValue> v = DecodePlainPickle(o.payload, o.name);
  EXPECT_TRUE(v.ok()) << v.status();
  Result<std::string> archive = EncodePlainObjectItem(v.ok() ? *v : PlainValue());
  EXPECT_TRUE(archive.ok()) << archive.status();
  return archive.ok() ? *archive : std::string();
}

TEST(MegatronConfig, ParsesWhatMegatronWrites) {
  Result<MegatronConfig> c = ParseMegatronConfig(TestData("megatron/metadata.json"), "ck/metadata.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, MegatronConfig());
  Result<MegatronConfig> again = ParseMegatronConfig(EncodeMegatronConfig(), "x");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, MegatronConfig());
  EXPECT_EQ(EncodeMegatronConfig(), TestData("megatron/metadata.json"));
}

TEST(MegatronConfig, RefusesOtherBackendsAndDamage) {
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": "zarr"})", "ck/metadata.json").status(),
                  StatusCode::kUnimplemented,
                  "Megatron checkpoint ck/metadata.json: sharded_backend 'zarr' version 1 is not supported");
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": "torch_dist", "sharded_backend_version": 2})", "m")
                      .status(),
                  StatusCode::kUnimplemented, "version 2 is not supported");
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": "torch_dist", "common_backend": "zarr"})", "m")
                      .status(),
                  StatusCode::kUnimplemented, "common_backend 'zarr'");
  SP_EXPECT_ERROR(ParseMegatronConfig("[1]", "m").status(), StatusCode::kDataLoss, "is not a JSON object");
  SP_EXPECT_ERROR(ParseMegatronConfig("{}", "m").status(), StatusCode::kDataLoss, "has no sharded_backend");
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": 3})", "m").status(), StatusCode::kDataLoss,
                  "sharded_backend is not a string");
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": "torch_dist", "sharded_backend_version": -1})", "m")
                      .status(),
                  StatusCode::kDataLoss, "sharded_backend_version is not a non-negative integer");
  SP_EXPECT_ERROR(ParseMegatronConfig(R"({"sharded_backend": "torch_dist")", "m").status(),
                  StatusCode::kDataLoss, "Megatron config m");
  SP_EXPECT_ERROR(ParseMegatronConfig(std::string(kMaxMegatronConfigBytes + 1, ' '), "m").status(),
                  StatusCode::kDataLoss, "larger than the limit");
}

// The .metadata megatron-core 0.16.1 wrote (all_local_plans with SavePlan / WriteItem /
// WriteItemType / TensorWriteData) decodes; the plans are only checked.
TEST(MegatronMetadata, AllLocalPlansDecodeAsData) {
  Result<DcpMetadata> md = DecodeDcpMetadata(AsBytes(TestData("megatron/.metadata")), "ck/.metadata");
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->state_dict_metadata.size(), 2u);
  EXPECT_EQ(md->state_dict_metadata[0].fqn, "model.w");
  EXPECT_EQ(md->state_dict_metadata[0].size, (Shape{8, 6}));
  EXPECT_EQ(md->state_dict_metadata[0].chunks.size(), 2u);
  EXPECT_FALSE(md->planner_data.has_value());
  // A renamed class in the plans is refused by the allowlist, not run.
  std::string bytes = TestData("megatron/.metadata");
  size_t at = bytes.find("WriteItemType");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 13, "WriteItemTypX");
  SP_EXPECT_ERROR(DecodeDcpMetadata(AsBytes(bytes), "ck/.metadata").status(), StatusCode::kDataLoss,
                  "global 'torch.distributed.checkpoint.planner.WriteItemTypX' is not in the DCP metadata "
                  "allowlist");
  // A plan that is not a SavePlan is refused naming it.
  bytes = TestData("megatron/.metadata");
  at = bytes.find("\x8c\x08SavePlan");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at + 2, 8, "Metadata");  // planner.Metadata is not allowed either
  SP_EXPECT_ERROR(DecodeDcpMetadata(AsBytes(bytes), "ck/.metadata").status(), StatusCode::kDataLoss,
                  "torch.distributed.checkpoint.planner.Metadata");
}

TEST(MegatronCommon, RealCommonPtFlattens) {
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(TestData("megatron/common.pt")), "ck/common.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->objects.size(), 4u);
  EXPECT_EQ(c->objects[0].name, "iteration");
  EXPECT_EQ(c->objects[1].name, "args");
  EXPECT_EQ(c->objects[2].name, "nested.x");
  EXPECT_EQ(c->objects[3].name, "nested.s");
  EXPECT_EQ(c->paths[2].path, (std::vector<std::variant<std::string, int64_t>>{"nested", "x"}));
  // Plain entries are exact plain objects (read without pickle); the Namespace stays an archive.
  EXPECT_EQ(c->objects[0].encoding, ObjectEncoding::kPlain);
  EXPECT_EQ(c->objects[1].encoding, ObjectEncoding::kTorchSave);
  Result<PlainValue> x = PlainOf(c->objects[2], "x");
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(*x, P::List({P::Int(1), P::Int(2)}));
  // The Namespace is re-emitted as data, never built: its archive holds the global and the state.
  SP_EXPECT_ERROR(PlainOf(c->objects[1], "args").status(), StatusCode::kDataLoss, "argparse.Namespace");
  Result<SourceArchive> args = OpenSourceArchive(AsBytes(c->objects[1].payload), "args");
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_TRUE(IsObjectOf(args->pickle.root(), "argparse", "Namespace"));
  const PickleValue* lr = FindAttribute(args->pickle.root(), "lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ(lr->float_value, 0.1);
}

TEST(MegatronCommon, TensorsSetsAndEmptyDictsRoundTrip) {
  const std::string archive = CommonArchive();
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(archive), "common.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::string> names;
  for (const ObjectEntry& o : c->objects) names.push_back(o.name);
  EXPECT_EQ(names, (std::vector<std::string>{"iteration", "args", "nested.x", "nested.s", "empty", "t"}));
  const std::string& t = c->objects[5].payload;
  Result<TorchSaveTensorInfo> info = ParseTorchSaveTensor(MemoryRangeReader(AsBytes(t)), t.size(), "t");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shape, (Shape{2}));
  float back[2];
  std::memcpy(back, t.data() + info->data_offset, 8);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 2.0f);
  // Objects -> common.pt -> objects gives the same values at the same paths.
  std::vector<MegatronObjectArchive> in;
  for (const ObjectEntry& o : c->objects) in.push_back({o.name, ArchiveOf(o)});
  Result<std::string> encoded = EncodeMegatronCommon(in, c->paths);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  Result<MegatronCommon> again = DecodeMegatronCommon(AsBytes(*encoded), "again");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->objects.size(), c->objects.size());
  for (size_t i = 0; i < again->objects.size(); ++i) {
    EXPECT_EQ(again->objects[i].name, c->objects[i].name);
    EXPECT_EQ(again->paths[i], c->paths[i]);
  }
  EXPECT_EQ(again->objects[2].payload, c->objects[2].payload);
  Result<PlainValue> empty = PlainOf(again->objects[4], "empty");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(*empty, P::Dict({}));
}

// A dict whose keys are not all str is one object, as Python's flattening keeps it: an object
// {1: 249} (a scheduler's per-group state) written to common.pt reads back as that object (it
// was refused as "dict key is int 1, expected a str"; found by fuzz/objects_fuzz.cc).
TEST(MegatronCommon, DictsWithNonStrKeysAreOneObject) {
  const P int_keys = P::Dict({{P::Int(1), P::Int(249)}, {P::Int(2), P::String("x")}});
  const P tuple_key = P::Dict({{P::Tuple({P::Int(1), P::Int(2)}), P::Int(3)}});
  Result<std::string> a = EncodePlainObjectItem(int_keys);
  Result<std::string> b = EncodePlainObjectItem(tuple_key);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<MegatronObjectArchive> in = {{"o", *a}, {"nested.t", *b}};
  std::vector<DcpPlannerPath> paths = {{"o", {"o"}}, {"nested.t", {"nested", "t"}}};
  Result<std::string> encoded = EncodeMegatronCommon(in, paths);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(*encoded), "common.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->objects.size(), 2u);
  EXPECT_EQ(c->objects[0].name, "o");
  EXPECT_EQ(c->objects[1].name, "nested.t");
  Result<PlainValue> o = PlainOf(c->objects[0], "o");
  Result<PlainValue> t = PlainOf(c->objects[1], "nested.t");
  ASSERT_TRUE(o.ok() && t.ok());
  EXPECT_EQ(*o, int_keys);
  EXPECT_EQ(*t, tuple_key);
  // The root must still be a dict of str keys.
  Result<std::string> root = EncodePlainObjectItem(int_keys);
  ASSERT_TRUE(root.ok());
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(*root), "common.pt").status(), StatusCode::kDataLoss,
                  "dict key is int 1, expected a str");
}

// The readers' depth limit counts from the root of common.pt, the containers of an object's path
// included: an object that fits the limit alone but not at its path is refused when writing,
// naming it, instead of producing a common.pt that DecodeMegatronCommon refuses (found by
// fuzz/objects_fuzz.cc: a pickle of nested tuples 127 levels deep).
TEST(MegatronCommon, EncodeCountsTheDepthOfThePathAsTheReaderDoes) {
  auto nested = [](int levels) {
    P v = P::Int(7);
    for (int i = 0; i < levels; ++i) v = P::Tuple({v});
    return v;
  };
  // At path ["a", "b"] the object's root is at depth 2: 126 levels of tuples reach depth 128.
  for (int levels : {126, 127}) {
    Result<std::string> item = EncodePlainObjectItem(nested(levels));
    ASSERT_TRUE(item.ok()) << item.status();
    std::vector<MegatronObjectArchive> in = {{"a.b", *item}};
    std::vector<DcpPlannerPath> paths = {{"a.b", {"a", "b"}}};
    Result<std::string> encoded = EncodeMegatronCommon(in, paths);
    if (levels == 126) {
      ASSERT_TRUE(encoded.ok()) << encoded.status();
      Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(*encoded), "common.pt");
      ASSERT_TRUE(c.ok()) << c.status();
      Result<PlainValue> back = PlainOf(c->objects[0], "a.b");
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(*back, nested(levels));
    } else {
      SP_EXPECT_ERROR(encoded.status(), StatusCode::kInvalidArgument,
                      "object 'a.b' cannot be written to common.pt at depth 2: torch.save archive "
                      "common.pt: values nested deeper than 128");
    }
  }
}

// List positions that no object fills are padded with None, within a budget of 2^16 plus 16 per
// path step: a 420-byte paths attribute asking for lists of 444,645 entries took 1 GB and 5 s
// (found by fuzz/objects_fuzz.cc).
TEST(MegatronCommon, EncodeBoundsThePaddingOfLists) {
  Result<std::string> one = EncodePlainObjectItem(P::Int(1));
  ASSERT_TRUE(one.ok());
  const std::vector<MegatronObjectArchive> in = {{"x", *one}};
  const int64_t budget = int64_t{1} << 16 | 2 * 16;  // two steps
  Result<std::string> at_budget =
      EncodeMegatronCommon(in, {{"x", {std::string("a"), int64_t{budget}}}});
  ASSERT_TRUE(at_budget.ok()) << at_budget.status();
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(*at_budget), "common.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->objects.size(), 1u);
  SP_EXPECT_ERROR(EncodeMegatronCommon(in, {{"x", {std::string("a"), int64_t{budget + 1}}}})
                      .status(),
                  StatusCode::kInvalidArgument,
                  "common.pt: the objects' paths leave 65569 positions of a list empty (None); "
                  "more than the 65568 their paths allow");
  // The fuzzer's input: lists nested in lists, each padded up to its position.
  const std::vector<DcpPlannerPath> nested = {
      {"x", {std::string("m"), int64_t{0}, int64_t{44}, int64_t{4}, int64_t{444644},
             int64_t{444}, int64_t{4}, std::string("w")}}};
  SP_EXPECT_ERROR(EncodeMegatronCommon(in, nested).status(), StatusCode::kInvalidArgument,
                  "common.pt: the objects' paths leave 444644 positions of a list empty");
}

// The None padding at the end of a long path spells the path out in each of its keys: the keys
// the readers would make are checked against kCommonKeyBytesBase when common.pt is written (found
// by fuzz/objects_fuzz.cc: 2 KB of paths made 15,376 keys of 1 KB, 0.4 GB).
TEST(MegatronCommon, EncodeBoundsTheKeysThatPaddingMakes) {
  Result<std::string> one = EncodePlainObjectItem(P::Int(1));
  ASSERT_TRUE(one.ok());
  const std::vector<MegatronObjectArchive> in = {{"x", *one}};
  auto path = [](int64_t position) {
    std::vector<std::variant<std::string, int64_t>> p;
    for (int i = 0; i < 20; ++i) p.emplace_back(std::string(100, static_cast<char>('a' + i)));
    p.emplace_back(position);
    p.emplace_back(std::string("y"));  // a dict in the list: the list is walked, not one value
    return p;
  };
  Result<std::string> within = EncodeMegatronCommon(in, {{"x", path(2000)}});
  ASSERT_TRUE(within.ok()) << within.status();
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(*within), "common.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->objects.size(), 2001u);  // 2000 Nones and the object
  Result<std::string> past = EncodeMegatronCommon(in, {{"x", path(20000)}});
  SP_EXPECT_ERROR(past.status(), StatusCode::kInvalidArgument,
                  "Megatron common state common.pt: key '" + std::string(100, 'a') + "." +
                      std::string(19, 'b') + "...");
  SP_EXPECT_ERROR(past.status(), StatusCode::kInvalidArgument,
                  "': the keys of the objects so far take more than");
  EXPECT_LT(past.status().message().size(), 500u);
}

// A key string shared through the pickle memo by 60 nested dicts: each of the 20 leaves below
// them has a 3.9 MB key, from a 70 KB archive. Refused at the limit, not after 0.7 GB.
TEST(MegatronCommon, DecodeBoundsTheKeys) {
  const std::string k(65536, 'k');
  auto archive_of = [&](int levels) {
    PickleWriter w(/*dedupe_strings=*/true);
    std::function<void(int)> nest = [&](int n) {
      w.EmptyDict();
      if (n == 0) {
        w.DictItems(20, [&](size_t i) {
          w.String("leaf" + std::to_string(i));
          w.None();
        });
        return;
      }
      w.DictItems(1, [&](size_t) {
        w.String(k);
        nest(n - 1);
      });
    };
    nest(levels);
    return Archive(w.Finish());
  };
  const std::string shallow = archive_of(4);
  Result<MegatronCommon> c = DecodeMegatronCommon(AsBytes(shallow), "c.pt");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->objects.size(), 20u);
  const std::string deep = archive_of(60);
  ASSERT_LT(deep.size(), 80000u);
  Result<MegatronCommon> refused = DecodeMegatronCommon(AsBytes(deep), "c.pt");
  SP_EXPECT_ERROR(refused.status(), StatusCode::kDataLoss,
                  "Megatron common state c.pt: key '" + std::string(120, 'k') + "...");
  SP_EXPECT_ERROR(refused.status(), StatusCode::kDataLoss,
                  "': the keys of the objects so far take more than " +
                      std::to_string(kCommonKeyBytesBase + kCommonKeyBytesPerByte * deep.size()) +
                      " bytes");
}

TEST(MegatronCommon, EncodeRefusesConflictingPaths) {
  Result<std::string> one = EncodePlainObjectItem(P::Int(1));
  ASSERT_TRUE(one.ok());
  std::vector<MegatronObjectArchive> objects = {{"a", *one}, {"a.b", *one}};
  std::vector<DcpPlannerPath> paths = {{"a", {"a"}}, {"a.b", {"a", "b"}}};
  SP_EXPECT_ERROR(EncodeMegatronCommon(objects, paths).status(), StatusCode::kInvalidArgument,
                  "object 'a.b': its path conflicts");
  objects = {{"bad", "not an archive"}};
  EXPECT_FALSE(EncodeMegatronCommon(objects, {}).ok());
}

TEST(MegatronCommon, HostileArchivesAreRefused) {
  PickleWriter list_root;
  list_root.EmptyList();
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(list_root.Finish())), "c.pt").status(),
                  StatusCode::kDataLoss, "Megatron common state c.pt: the root is list of 0, expected a dict");
  PickleWriter int_key;
  int_key.EmptyDict();
  int_key.Int(3);
  int_key.Int(4);
  int_key.SetItem();
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(int_key.Finish())), "c.pt").status(),
                  StatusCode::kDataLoss, "dict key is int 3, expected a str");
  for (const char* key : {"../x", "1/2", ""}) {
    PickleWriter w;
    w.EmptyDict();
    w.String("t");
    PushTensor(w, key);
    w.SetItem();
    SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(w.Finish())), "c.pt").status(),
                    StatusCode::kDataLoss, "is not a plain name");
  }
  PickleWriter missing;
  missing.EmptyDict();
  missing.String("t");
  PushTensor(missing, "7");
  missing.SetItem();
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(missing.Finish())), "c.pt").status(),
                  StatusCode::kDataLoss, "no record 'common/data/7'");
  // Nesting deeper than the walk allows.
  PickleWriter deep;
  deep.EmptyDict();
  deep.String("k");
  std::function<void(int)> nest = [&](int n) {
    deep.EmptyList();
    if (n > 0) deep.ListItems(1, [&](size_t) { nest(n - 1); });
  };
  nest(200);
  deep.SetItem();
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(deep.Finish())), "c.pt").status(),
                  StatusCode::kDataLoss, "nesting deeper than 128");
  // A memo bomb: 40 levels of [x, x] is 2^40 values when walked; refused before any walk.
  std::string bomb = Raw("\x80\x02}q\x00X\x01\x00\x00\x00kq\x01K\x00");
  for (int i = 0; i < 40; ++i) bomb += "q\x02" "0" "h\x02h\x02\x86";
  bomb += "s.";
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(Archive(bomb)), "c.pt").status(), StatusCode::kDataLoss,
                  "more than 4194304 values");
  SP_EXPECT_ERROR(DecodeMegatronCommon(AsBytes(std::string("PK\x05\x06 truncated")), "c.pt").status(),
                  StatusCode::kDataLoss, "c.pt");
  std::string big_endian = Archive(Raw("\x80\x02}q\x00."));
  size_t at = big_endian.find("little");
  big_endian.replace(at, 6, "bigxxx");
  EXPECT_FALSE(DecodeMegatronCommon(AsBytes(big_endian), "c.pt").ok());
}

// Random byte changes to the pickles of a real and a hand-built common.pt (archives rebuilt so the
// CRCs match): every result is a value or a clean error, and what decodes re-emits again.
TEST(MegatronCommon, MutatedPicklesDecodeOrFailCleanly) {
  std::vector<std::string> pickles;
  for (const std::string& archive : {TestData("megatron/common.pt"), CommonArchive()}) {
    Result<SourceArchive> source = OpenSourceArchive(AsBytes(archive), "seed");
    ASSERT_TRUE(source.ok()) << source.status();
    const ZipEntry* pkl = source->dir.Find(source->prefix + "data.pkl");
    ASSERT_NE(pkl, nullptr);
    Result<std::string> bytes = ReadZipEntry(MemoryRangeReader(AsBytes(archive)), source->dir, *pkl, "seed", 1 << 20);
    ASSERT_TRUE(bytes.ok());
    pickles.push_back(*bytes);
  }
  const float data[2] = {1.0f, 2.0f};
  std::mt19937 rng(12);
  int decoded = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string p = pickles[i % 2];
    for (int k = 0; k < 1 + i % 3; ++k) p[rng() % p.size()] = static_cast<char>(rng() % 256);
    Result<MegatronCommon> c = DecodeMegatronCommon(
        AsBytes(Archive(p, {{"0", std::string(reinterpret_cast<const char*>(data), 8)}})), "m.pt");
    if (!c.ok()) {
      EXPECT_TRUE(c.status().code() == StatusCode::kDataLoss || c.status().code() == StatusCode::kUnimplemented)
          << c.status();
      continue;
    }
    ++decoded;
    for (const ObjectEntry& o : c->objects) {
      if (o.encoding == ObjectEncoding::kPlain) {
        EXPECT_TRUE(DecodePlainPickle(o.payload, o.name).ok()) << o.name;
      } else {
        EXPECT_TRUE(ReemitTorchSaveArchive(AsBytes(o.payload), o.name).ok()) << o.name;
      }
    }
  }
  EXPECT_GT(decoded, 0);
}

}  // namespace
}  // namespace sp::torch_dcp
