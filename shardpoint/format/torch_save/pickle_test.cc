#include "shardpoint/format/torch_save/pickle.h"

#include <gtest/gtest.h>

#include <random>

#include "shardpoint/format/torch_save/pickle_writer.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/format/torch_save/test_util.h"

namespace sp::torch_save {
namespace {

using Kind = PickleValue::Kind;

// A string literal with embedded NULs, without its terminator.
template <size_t N>
std::string Raw(const char (&s)[N]) {
  return std::string(s, N - 1);
}

Result<PickleTree> Load(std::string_view bytes,
                        std::span<const PickleGlobalName> globals = PlainDataGlobals(),
                        bool persistent = false) {
  UnpickleOptions options;
  options.what = "test.pkl";
  options.allowed_globals = globals;
  options.allowlist_name = "test";
  options.allow_persistent_id = persistent;
  return Unpickle(AsBytes(bytes), options);
}

Result<PlainValue> LoadPlain(std::string_view bytes) {
  SP_ASSIGN_OR_RETURN(PickleTree tree, Load(bytes));
  return ToPlainValue(tree.root(), "test.pkl", PlainValueBudget(bytes.size()));
}

// What CPython 3.11 writes for pickle.dumps({'lr': 0.1, 'n': None, 'b': True,
// 'big': 2**40, 'neg': -3, 't': (1, 2)}, protocol=2) (the same bytes torch.save puts in data.pkl).
constexpr char kPythonDict[] =
    "\x80\x02}q\x00(X\x02\x00\x00\x00lrq\x01G\x3f\xb9\x99\x99\x99\x99\x99\x9aX\x01\x00\x00\x00nq\x02N"
    "X\x01\x00\x00\x00" "bq\x03\x88X\x03\x00\x00\x00" "bigq\x04\x8a\x06\x00\x00\x00\x00\x00\x01"
    "X\x03\x00\x00\x00negq\x05J\xfd\xff\xff\xffX\x01\x00\x00\x00tq\x06K\x01K\x02\x86q\x07u.";

PlainValue PythonDictValue() {
  using P = PlainValue;
  return P::Dict({{P::String("lr"), P::Float(0.1)},
                  {P::String("n"), P::None()},
                  {P::String("b"), P::Bool(true)},
                  {P::String("big"), P::Int(int64_t{1} << 40)},
                  {P::String("neg"), P::Int(-3)},
                  {P::String("t"), P::Tuple({P::Int(1), P::Int(2)})}});
}

TEST(Unpickle, ReadsWhatPythonWrites) {
  std::string bytes(kPythonDict, sizeof(kPythonDict) - 1);
  Result<PlainValue> v = LoadPlain(bytes);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, PythonDictValue()) << PlainValueToString(*v);
}

TEST(PickleWriter, WritesWhatPythonWrites) {
  Result<std::string> bytes = EncodePlainPickle(PythonDictValue());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, Raw(kPythonDict));
}

TEST(PickleWriter, IntegersUseTheSmallestOpcode) {
  for (int64_t v : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536},
                    int64_t{-1}, int64_t{INT32_MIN}, int64_t{INT32_MAX}, int64_t{1} << 31,
                    -(int64_t{1} << 31) - 1, int64_t{1} << 40, INT64_MAX, INT64_MIN,
                    int64_t{128} << 48, -(int64_t{128} << 48)}) {
    PickleWriter w;
    w.Int(v);
    std::string bytes = w.Finish();
    Result<PlainValue> back = LoadPlain(bytes);
    ASSERT_TRUE(back.ok()) << v << ": " << back.status();
    EXPECT_EQ(back->int_value, v);
  }
  PickleWriter w;
  w.Int(int64_t{1} << 40);  // Python: \x8a\x06 + 6 bytes
  EXPECT_EQ(w.Finish(), Raw("\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01."));
  PickleWriter neg;
  neg.Int(-(int64_t{1} << 40));  // Python: \x8a\x06\x00\x00\x00\x00\x00\xff
  EXPECT_EQ(neg.Finish(), Raw("\x80\x02\x8a\x06\x00\x00\x00\x00\x00\xff."));
}

PlainValue RandomValue(std::mt19937_64& rng, int depth) {
  using P = PlainValue;
  int kind = static_cast<int>(rng() % (depth > 3 ? 6 : 9));
  auto n = [&] { return static_cast<size_t>(rng() % 5); };
  std::vector<PlainValue> items;
  switch (kind) {
    case 0: return P::None();
    case 1: return P::Bool(rng() & 1);
    case 2: return P::Int(static_cast<int64_t>(rng()) >> (rng() % 64));
    case 3: return P::Float(static_cast<double>(static_cast<int64_t>(rng())) / 7.0);
    case 4: return P::String(std::string(n(), 'a') + "\xc3\xa9");
    case 5: {
      std::string b;
      for (size_t i = 0, e = n(); i < e; ++i) b.push_back(static_cast<char>(rng()));
      return P::Bytes(b);
    }
    case 6:
    case 7:
      for (size_t i = 0, e = n(); i < e; ++i) items.push_back(RandomValue(rng, depth + 1));
      return kind == 6 ? P::List(items) : P::Tuple(items);
    default: {
      std::vector<std::pair<PlainValue, PlainValue>> pairs;
      for (size_t i = 0, e = n(); i < e; ++i) {
        pairs.emplace_back(P::String("k" + std::to_string(i)), RandomValue(rng, depth + 1));
      }
      return P::Dict(pairs);
    }
  }
}

TEST(PlainValue, RandomRoundTrips) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 500; ++i) {
    PlainValue v = RandomValue(rng, 0);
    Result<std::string> bytes = EncodePlainPickle(v);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    Result<PlainValue> back = LoadPlain(*bytes);
    ASSERT_TRUE(back.ok()) << PlainValueToString(v) << ": " << back.status();
    EXPECT_EQ(*back, v) << PlainValueToString(v) << " vs " << PlainValueToString(*back);
  }
}

TEST(PlainValue, ListAndDictBatchesOfAThousand) {
  std::vector<PlainValue> items;
  std::vector<std::pair<PlainValue, PlainValue>> pairs;
  for (int i = 0; i < 2000; ++i) {
    items.push_back(PlainValue::Int(i));
    pairs.emplace_back(PlainValue::Int(i), PlainValue::None());
  }
  for (const PlainValue& v : {PlainValue::List(items), PlainValue::Dict(pairs)}) {
    Result<std::string> bytes = EncodePlainPickle(v);
    ASSERT_TRUE(bytes.ok());
    Result<PlainValue> back = LoadPlain(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, v);
  }
}

TEST(Unpickle, MemoSharesValuesAndProtocol4OpcodesWork) {
  // pickle.dumps(['a', 'a'], protocol=4) with a shared str: MEMOIZE / BINGET, FRAME,
  // SHORT_BINUNICODE.
  std::string bytes = Raw("\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(\x8c\x01" "a\x94h\x01" "e.");
  Result<PlainValue> v = LoadPlain(bytes);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, PlainValue::List({PlainValue::String("a"), PlainValue::String("a")}));
}

TEST(Unpickle, RefusesGlobalsOutsideTheAllowlistByName) {
  PickleWriter w;
  w.Global("os", "system");
  w.String("echo hi");
  w.Tuple(1);
  w.Reduce();
  SP_EXPECT_ERROR(Load(w.Finish()).status(), StatusCode::kDataLoss, "global 'os.system'");

  PickleWriter eval;
  eval.Global("builtins", "eval");  // written as __builtin__ in protocol 2, mapped back
  SP_EXPECT_ERROR(Load(eval.Finish()).status(), StatusCode::kDataLoss, "'builtins.eval'");

  // STACK_GLOBAL (protocol 4) names the global the same way, with its offset.
  std::string stack = Raw("\x80\x04\x8c\x02os\x8c\x06system\x93.");
  Result<PickleTree> r = Load(stack);
  SP_EXPECT_ERROR(r.status(), StatusCode::kDataLoss, "global 'os.system'");
  SP_EXPECT_ERROR(r.status(), StatusCode::kDataLoss, "at byte 14");
}

TEST(Unpickle, RefusesUnknownOpcodesByNameAndOffset) {
  SP_EXPECT_ERROR(Load(Raw("\x80\x02i__builtin__\nobject\n.")).status(),
                  StatusCode::kDataLoss, "at byte 2 (opcode 0x69 INST)");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02\xff.")).status(), StatusCode::kDataLoss,
                  "opcode 0xff unknown");
  SP_EXPECT_ERROR(Load(Raw("\x80\x05\x97.")).status(), StatusCode::kDataLoss,
                  "NEXT_BUFFER");
}

TEST(Unpickle, RefusesTruncatedAndAbsurdInput) {
  std::string good(kPythonDict, sizeof(kPythonDict) - 1);
  for (size_t n = 0; n < good.size(); ++n) {
    Result<PickleTree> r = Load(good.substr(0, n));
    EXPECT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  }
  // BINUNICODE8 with a length of 2^63.
  SP_EXPECT_ERROR(Load(Raw("\x80\x04\x8d\x00\x00\x00\x00\x00\x00\x00\x80.")).status(),
                  StatusCode::kDataLoss, "truncated: length 9223372036854775808");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02X\xff\xff\xff\xff")).status(), StatusCode::kDataLoss,
                  "truncated");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02h\x05.")).status(), StatusCode::kDataLoss,
                  "memo entry 5 was never stored");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02N.junk")).status(), StatusCode::kDataLoss,
                  "4 bytes after STOP");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02.")).status(), StatusCode::kDataLoss,
                  "stack underflow");
  SP_EXPECT_ERROR(Load(Raw("\x80\x01N.")).status(), StatusCode::kDataLoss,
                  "unsupported pickle protocol 1");
  SP_EXPECT_ERROR(Load(Raw("N.")).status(), StatusCode::kDataLoss, "must start with PROTO");
  SP_EXPECT_ERROR(Load(Raw("\x80\x02X\x02\x00\x00\x00\xc3(.")).status(),
                  StatusCode::kDataLoss, "not valid UTF-8");
  // LONG1 wider than 64 bits: 2**64.
  SP_EXPECT_ERROR(Load(Raw("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.")).status(),
                  StatusCode::kDataLoss, "wider than 64 bits");
}

TEST(Unpickle, CapsNestingAndCount) {
  std::string deep = "\x80\x02" + std::string(300, '(');
  SP_EXPECT_ERROR(Load(deep).status(), StatusCode::kDataLoss, "nested MARKs");
  UnpickleOptions options;
  options.what = "small";
  options.max_nodes = 3;
  std::string four = Raw("\x80\x02K\x01K\x02K\x03K\x04.");
  SP_EXPECT_ERROR(Unpickle(AsBytes(four), options).status(), StatusCode::kDataLoss, "more than 3 values");
}

// Regression (issue 13, defect 4): values popped off the stack stayed allocated, so a 32 MB
// pickle of throw-away values took 2.35 GB. Popped, dropped and overwritten values are now freed
// and their nodes reused: the arena stays as small as what is alive at once.
TEST(Unpickle, ThrowAwayValuesAreFreed) {
  std::string bytes = Raw("\x80\x02");
  for (int i = 0; i < 150000; ++i) {
    bytes += Raw("]0");                     // EMPTY_LIST, POP
    bytes += Raw("(K\x01X\x01\x00\x00\x00" "a]1");  // MARK, int, str, list, POP_MARK
    bytes += Raw("}q\x00K\x07]s0");        // dict (memo 0, overwriting the last), SETITEM, POP
    bytes += Raw("K\x02K\x03\x86\x85\x85\x85\x85\x85\x85" "0");  // ((((((2, 3),),),),),) popped
    bytes += Raw("NNNN\x88\x89)0000000");  // shared None / True / False / (), popped
  }
  bytes += Raw("h\x00.");  // the last dict, from the memo
  ASSERT_GT(bytes.size(), size_t{6} << 20);
  Result<PickleTree> tree = Load(bytes);
  ASSERT_TRUE(tree.ok()) << tree.status();
  // 3.3 million values were created; never more than a dozen were alive at once.
  EXPECT_LE(tree->node_count(), 16u);
  Result<PlainValue> last = ToPlainValue(tree->root(), "test.pkl", PlainValueBudget(bytes.size()));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, PlainValue::Dict({{PlainValue::Int(7), PlainValue::List({})}}));
}

// Regression (issue 13, defect 4): the value limit was a fixed 2^26 (~10 GB of nodes); it is now
// derived from the input size (MaxLivePickleNodes), and the message names the input.
TEST(Unpickle, LiveValuesAreBoundedByTheInputSize) {
  const size_t n = 200000;  // one-byte EMPTY_LISTs kept alive by APPENDS: a value per byte
  std::string dense = Raw("\x80\x02](") + std::string(n, ']') + Raw("e.");
  const size_t limit = MaxLivePickleNodes(dense.size());
  EXPECT_EQ(limit, dense.size() / 2 + 65536);
  SP_EXPECT_ERROR(Load(dense).status(), StatusCode::kDataLoss,
                  "pickle test.pkl: more than " + std::to_string(limit) +
                      " values alive at once (the limit for " + std::to_string(dense.size()) +
                      " bytes of pickle)");
  // What the pickle writer (like CPython) emits for as many values stays under the limit: small
  // ints (two bytes each) and memoized empty lists (three bytes each).
  std::vector<PlainValue> ints(300000, PlainValue::Int(5));
  std::vector<PlainValue> lists(200000, PlainValue::List({}));
  for (const PlainValue& v : {PlainValue::List(ints), PlainValue::List(lists)}) {
    Result<std::string> written = EncodePlainPickle(v);
    ASSERT_TRUE(written.ok());
    Result<PlainValue> back = LoadPlain(*written);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, v);
  }
}

TEST(Unpickle, StackGlobalNamesAreCapped) {
  std::string name(2000, 'x');
  std::string bytes = Raw("\x80\x04\x8c\x0b") + "collections" + Raw("X\xd0\x07\x00\x00") + name +
                      Raw("\x93.");
  SP_EXPECT_ERROR(Load(bytes).status(), StatusCode::kDataLoss,
                  "STACK_GLOBAL name longer than 1024 bytes");
}

TEST(Unpickle, SelfReferenceIsRefusedWhenWalked) {
  // l = []; l.append(l): EMPTY_LIST, BINPUT 0, BINGET 0, APPEND.
  std::string cyclic = Raw("\x80\x02]q\x00h\x00" "a.");
  Result<PickleTree> tree = Load(cyclic);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(&tree->root(), tree->root().items[0]);
  SP_EXPECT_ERROR(ToPlainValue(tree->root(), "cyclic", PlainValueBudget(cyclic.size())).status(),
                  StatusCode::kDataLoss, "nested deeper than");
}

// A memo bomb: 40 levels of [x, x] are 2^40 values when each shared use is converted. The
// conversion stops at the budget of the pickle's size instead of running for hours (found as a
// 173-byte input of nested DUPs taking seconds by unpickle_fuzz).
TEST(Unpickle, SharedReferencesAreExpandedWithinABudget) {
  std::string bomb = Raw("\x80\x02}q\x00X\x01\x00\x00\x00kq\x01K\x00");
  for (int i = 0; i < 40; ++i) bomb += "q\x02" "0" "h\x02h\x02\x86";
  bomb += "s.";
  const uint64_t budget = PlainValueBudget(bomb.size());
  EXPECT_EQ(budget, (uint64_t{1} << 16) + 16 * bomb.size());
  SP_EXPECT_ERROR(DecodePlainPickle(bomb, "bomb.pkl").status(), StatusCode::kDataLoss,
                  "bomb.pkl: more than " + std::to_string(budget) +
                      " values once its shared references are expanded");
  // 15 levels are 2^16 + 1 values: within the budget of their 137 bytes, every use expanded.
  std::string shared = Raw("\x80\x02}q\x00X\x01\x00\x00\x00kq\x01K\x00");
  for (int i = 0; i < 15; ++i) shared += "q\x02" "0" "h\x02h\x02\x86";
  shared += "s.";
  Result<PlainValue> value = DecodePlainPickle(shared, "shared.pkl");
  ASSERT_TRUE(value.ok()) << value.status();
  const PlainValue* v = &value->items[1];
  for (int i = 0; i < 15; ++i) {
    ASSERT_EQ(v->items.size(), 2u);
    EXPECT_EQ(v->items[0], v->items[1]);
    v = &v->items[0];
  }
  EXPECT_EQ(*v, PlainValue::Int(0));
  // An explicit budget is what it says: exactly the values the pickle expands to, and one less.
  Result<PickleTree> tree = Load(shared);
  ASSERT_TRUE(tree.ok());
  const uint64_t values = 2 + ((uint64_t{1} << 16) - 1);  // the dict, the key, the tuples' tree
  EXPECT_TRUE(ToPlainValue(tree->root(), "t", values).ok());
  SP_EXPECT_ERROR(ToPlainValue(tree->root(), "t", values - 1).status(), StatusCode::kDataLoss,
                  "t: more than " + std::to_string(values - 1) + " values");
}

// A long text shared by many references: 20,000 uses of one 64 KiB str would be 1.3 GB of text
// in a 200 KB pickle (found as 360 bytes of shared strings taking 950 MB and 9 s by objects_fuzz).
// Each use counts its text against the budget; the same text once, unshared, decodes.
TEST(Unpickle, SharedTextIsChargedToTheBudget) {
  const std::string text(65536, 'a');
  auto str = [&] {
    std::string op = Raw("X");
    for (int i = 0; i < 4; ++i) op.push_back(static_cast<char>((text.size() >> (8 * i)) & 0xff));
    return op + text;
  };
  std::string bomb = Raw("\x80\x02") + str() + Raw("q\x00" "0" "](");
  for (int i = 0; i < 20000; ++i) bomb += Raw("h\x00");
  bomb += Raw("e.");
  SP_EXPECT_ERROR(DecodePlainPickle(bomb, "text.pkl").status(), StatusCode::kDataLoss,
                  "text.pkl: more than " + std::to_string(PlainValueBudget(bomb.size())) +
                      " values once its shared references are expanded");
  // Four uses, and one 4 MiB text alone: well within the budget.
  std::string few = Raw("\x80\x02") + str() + Raw("q\x00" "0" "](h\x00h\x00h\x00h\x00" "e.");
  Result<PlainValue> value = DecodePlainPickle(few, "few.pkl");
  ASSERT_TRUE(value.ok()) << value.status();
  ASSERT_EQ(value->items.size(), 4u);
  EXPECT_EQ(value->items[3], PlainValue::String(text));
  PlainValue big = PlainValue::String(std::string(4 << 20, 'b'));
  Result<std::string> encoded = EncodePlainPickle(big);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  Result<PlainValue> decoded = DecodePlainPickle(*encoded, "big.pkl");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, big);
}

TEST(Unpickle, PersistentIdsOnlyWhenAllowed) {
  std::string pid = Raw("\x80\x02X\x01\x00\x00\x00" "0Q.");
  SP_EXPECT_ERROR(Load(pid).status(), StatusCode::kDataLoss, "persistent ids are not allowed");
  Result<PickleTree> tree = Load(pid, PlainDataGlobals(), /*persistent=*/true);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_TRUE(tree->root().is(Kind::kPersistentId));
  EXPECT_EQ(tree->root().args->text, "0");
}

TEST(Unpickle, ObjectsKeepTheirGlobalArgsAndState) {
  PickleWriter w;
  w.Global("collections", "OrderedDict");
  w.Tuple(0);
  w.Reduce();
  w.Mark();
  w.String("a");
  w.Int(1);
  w.SetItems();  // one pair through MARK ... SETITEMS
  w.EmptyDict();
  w.String("x");
  w.Bool(true);
  w.SetItem();
  w.Build();
  Result<PickleTree> tree = Load(w.Finish());
  ASSERT_TRUE(tree.ok()) << tree.status();
  const PickleValue& root = tree->root();
  EXPECT_TRUE(IsObjectOf(root, "collections", "OrderedDict"));
  ASSERT_EQ(root.pair_count(), 1u);
  EXPECT_EQ(root.key(0).text, "a");
  const PickleValue* x = FindAttribute(root, "x");
  ASSERT_NE(x, nullptr);
  EXPECT_TRUE(x->bool_value);
  Result<PlainValue> plain = ToPlainValue(root, "od", PlainValueBudget(0));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(PlainValueToString(*plain), "{'a': 1}");
}

TEST(PlainValue, BytesRoundTripThroughCodecsEncode) {
  for (std::string b : {std::string(), Raw("\x00\x7f\x80\xff")}) {
    Result<std::string> bytes = EncodePlainPickle(PlainValue::Bytes(b));
    ASSERT_TRUE(bytes.ok());
    Result<PlainValue> back = LoadPlain(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, PlainValue::Bytes(b));
  }
}

}  // namespace
}  // namespace sp::torch_save
