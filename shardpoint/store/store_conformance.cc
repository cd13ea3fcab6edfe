#include "shardpoint/store/store_conformance.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace sp {

StoreTestEnv::StoreTestEnv(StoreTestEnv&& other) noexcept
    : cleanup(std::exchange(other.cleanup, nullptr)),
      base(std::move(other.base)),
      store(std::move(other.store)),
      root(std::move(other.root)) {}

StoreTestEnv& StoreTestEnv::operator=(StoreTestEnv&& other) noexcept {
  if (this != &other) {
    Release();
    cleanup = std::exchange(other.cleanup, nullptr);
    base = std::move(other.base);
    store = std::move(other.store);
    root = std::move(other.root);
  }
  return *this;
}

StoreTestEnv::~StoreTestEnv() { Release(); }

void StoreTestEnv::Release() {
  store.reset();
  base.reset();
  if (cleanup) std::exchange(cleanup, nullptr)();
}

void PrintTo(const StoreConformanceParam& param, std::ostream* os) { *os << param.name; }

std::string StoreConformanceParamName(
    const ::testing::TestParamInfo<StoreConformanceParam>& info) {
  return info.param.name;
}

void StoreConformanceTest::SetUp() {
  if (GetParam().unavailable) {
    if (std::optional<std::string> why = GetParam().unavailable()) GTEST_SKIP() << *why;
  }
  Result<StoreTestEnv> env = GetParam().make();
  ASSERT_TRUE(env.ok()) << env.status();
  env_ = std::move(env).value();
}

void StoreConformanceTest::TearDown() { env_ = StoreTestEnv(); }

Status StoreConformanceTest::WriteWholeFile(std::string_view path, std::string_view content) {
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, store().NewWritableFile(path));
  SP_RETURN_IF_ERROR(file->WriteAt(0, AsBytes(content)));
  SP_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

namespace {

using ::testing::HasSubstr;

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

std::string ReadRange(const ReadableFile& file, uint64_t offset, size_t n, Status* status) {
  std::string out(n, '\0');
  *status = file.ReadAt(offset, AsMutableBytes(out.data(), out.size()));
  return out;
}

#define SP_ASSERT_OK(expr)                    \
  do {                                        \
    ::sp::Status sp_assert_status_ = (expr);  \
    ASSERT_TRUE(sp_assert_status_.ok()) << #expr << ": " << sp_assert_status_; \
  } while (0)

TEST_P(StoreConformanceTest, WritesOutOfOrderAndReadsBackBitExact) {
  std::mt19937_64 rng(1);
  const std::string expected = RandomBytes(rng, 256 * 1024 + 17);
  auto file = store().NewWritableFile(Path("data.bin"));
  ASSERT_TRUE(file.ok()) << file.status();
  // Pieces of random sizes, written in a shuffled order.
  std::vector<std::pair<size_t, size_t>> pieces;
  for (size_t pos = 0; pos < expected.size();) {
    size_t n = std::min<size_t>(1 + rng() % 9000, expected.size() - pos);
    pieces.emplace_back(pos, n);
    pos += n;
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  for (auto [pos, n] : pieces) {
    SP_ASSERT_OK((*file)->WriteAt(pos, AsBytes(expected.data() + pos, n)));
  }
  EXPECT_EQ((*file)->path(), Path("data.bin"));
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK((*file)->Close());

  auto read = store().ReadFile(Path("data.bin"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read == expected);
  auto reader = store().OpenReadable(Path("data.bin"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->size(), expected.size());
  EXPECT_EQ((*reader)->path(), Path("data.bin"));
}

TEST_P(StoreConformanceTest, RandomReadsMatchReference) {
  std::mt19937_64 rng(2);
  const std::string expected = RandomBytes(rng, 100000);
  SP_ASSERT_OK(WriteWholeFile(Path("r.bin"), expected));
  auto reader = store().OpenReadable(Path("r.bin"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (int i = 0; i < 200; ++i) {
    uint64_t offset = rng() % (expected.size() + 1);
    size_t n = rng() % (expected.size() - offset + 1);
    Status status;
    std::string got = ReadRange(**reader, offset, n, &status);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_TRUE(got == expected.substr(offset, n)) << "offset " << offset << " size " << n;
  }
}

TEST_P(StoreConformanceTest, ScatterReadsMatchReference) {
  std::mt19937_64 rng(12);
  const std::string expected = RandomBytes(rng, 300000);
  SP_ASSERT_OK(WriteWholeFile(Path("v.bin"), expected));
  auto reader = store().OpenReadable(Path("v.bin"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (int i = 0; i < 100; ++i) {
    // Up to 3,000 pieces (more than one preadv takes), empty ones included, in one buffer.
    const uint64_t offset = rng() % (expected.size() + 1);
    const size_t total = rng() % (expected.size() - offset + 1);
    std::string got(total, '\0');
    std::vector<MutableByteView> pieces;
    const size_t mean = 1 + rng() % 400;
    for (size_t at = 0; at < total || (pieces.empty() && i % 2 == 0);) {
      const size_t n = std::min(total - at, rng() % (2 * mean));
      pieces.push_back(AsMutableBytes(got.data() + at, n));
      at += n;
    }
    SP_ASSERT_OK((*reader)->ReadVAt(offset, pieces));
    ASSERT_TRUE(got == expected.substr(offset, total))
        << "offset " << offset << " size " << total << " pieces " << pieces.size();
  }
}

TEST_P(StoreConformanceTest, ScatterReadPastTheEndIsDataLoss) {
  const std::string path = Path("vshort.bin");
  SP_ASSERT_OK(WriteWholeFile(path, std::string(120, 'x')));
  auto reader = store().OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  std::string a(30, '\0'), b(40, '\0');
  const MutableByteView pieces[] = {AsMutableBytes(a.data(), a.size()),
                                    AsMutableBytes(b.data(), b.size())};
  Status status = (*reader)->ReadVAt(60, pieces);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("120 bytes"));
  EXPECT_EQ(a, std::string(30, 'x'));  // the pieces within the file were filled
}

TEST_P(StoreConformanceTest, EmptyFileAndZeroLengthTransfers) {
  auto file = store().NewWritableFile(Path("empty"));
  ASSERT_TRUE(file.ok()) << file.status();
  SP_ASSERT_OK((*file)->WriteAt(0, ByteView()));
  SP_ASSERT_OK((*file)->Close());
  auto read = store().ReadFile(Path("empty"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "");
  auto reader = store().OpenReadable(Path("empty"));
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->size(), 0u);
  SP_ASSERT_OK((*reader)->ReadAt(0, MutableByteView()));
}

TEST_P(StoreConformanceTest, HolesReadAsZeros) {
  auto file = store().NewWritableFile(Path("holes"));
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->WriteAt(1 << 20, AsBytes("tail")));
  SP_ASSERT_OK((*file)->WriteAt(10, AsBytes("head")));
  SP_ASSERT_OK((*file)->Close());
  auto read = store().ReadFile(Path("holes"));
  ASSERT_TRUE(read.ok());
  std::string expected((1 << 20) + 4, '\0');
  std::memcpy(expected.data() + 10, "head", 4);
  std::memcpy(expected.data() + (1 << 20), "tail", 4);
  EXPECT_TRUE(*read == expected);
}

TEST_P(StoreConformanceTest, NewWritableFileTruncatesAnExistingFile) {
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "a long first version"));
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "short"));
  auto read = store().ReadFile(Path("f"));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "short");
}

TEST_P(StoreConformanceTest, MissingParentIsNotFound) {
  const std::string path = Path("no/such/dir/f");
  auto file = store().NewWritableFile(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  auto exists = store().Exists(Path("no"));
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists);
}

TEST_P(StoreConformanceTest, OpeningAMissingFileIsNotFound) {
  const std::string path = Path("absent");
  auto reader = store().OpenReadable(path);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(reader.status().message(), HasSubstr(path));
  auto read = store().ReadFile(path);
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
}

TEST_P(StoreConformanceTest, ShortReadIsDataLossNamingPathOffsetAndSizes) {
  const std::string path = Path("short.bin");
  SP_ASSERT_OK(WriteWholeFile(path, std::string(120, 'x')));
  auto reader = store().OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  Status status;
  ReadRange(**reader, 100, 50, &status);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("offset 100"));
  EXPECT_THAT(status.message(), HasSubstr("50 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("120 bytes"));
  ReadRange(**reader, 1000, 1, &status);  // starts past the end
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("offset 1000"));
}

TEST_P(StoreConformanceTest, ConcurrentWritesOnDisjointRanges) {
  constexpr int kThreads = 8;
  constexpr size_t kBlock = 4096 + 13;  // not aligned, so neighbours share pages
  constexpr int kBlocksPerThread = 64;
  std::mt19937_64 rng(3);
  const std::string expected = RandomBytes(rng, kBlock * kThreads * kBlocksPerThread);
  auto file = store().NewWritableFile(Path("striped"));
  ASSERT_TRUE(file.ok());
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Thread t writes blocks t, t + 8, t + 16, ... from the last one back, so that every
      // thread extends the file while others write below it.
      for (int b = kBlocksPerThread - 1; b >= 0; --b) {
        size_t pos = (static_cast<size_t>(b) * kThreads + t) * kBlock;
        Status s = (*file)->WriteAt(pos, AsBytes(expected.data() + pos, kBlock));
        if (!s.ok()) results[t] = s;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s;
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK((*file)->Close());
  auto read = store().ReadFile(Path("striped"));
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(*read == expected);
}

TEST_P(StoreConformanceTest, ConcurrentReads) {
  std::mt19937_64 rng(4);
  const std::string expected = RandomBytes(rng, 1 << 20);
  SP_ASSERT_OK(WriteWholeFile(Path("shared"), expected));
  auto reader = store().OpenReadable(Path("shared"));
  ASSERT_TRUE(reader.ok());
  std::vector<int> mismatches(8, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 local(100 + t);
      for (int i = 0; i < 100; ++i) {
        uint64_t offset = local() % expected.size();
        size_t n = local() % (expected.size() - offset + 1);
        Status status;
        std::string got = ReadRange(**reader, offset, n, &status);
        if (!status.ok() || got != expected.substr(offset, n)) ++mismatches[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST_P(StoreConformanceTest, PreallocateThenWriteGivesExactlyTheWrittenBytes) {
  std::mt19937_64 rng(5);
  const std::string expected = RandomBytes(rng, 70000);
  auto file = store().NewWritableFile(Path("pre"));
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->Preallocate(expected.size()));
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes(expected)));
  SP_ASSERT_OK((*file)->Preallocate(10));  // never shrinks
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK((*file)->Close());
  auto read = store().ReadFile(Path("pre"));
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(*read == expected);
}

TEST_P(StoreConformanceTest, DropCacheKeepsContent) {
  SP_ASSERT_OK(WriteWholeFile(Path("cold"), "bytes on the device"));
  auto reader = store().OpenReadable(Path("cold"));
  ASSERT_TRUE(reader.ok());
  SP_ASSERT_OK((*reader)->DropCache());
  Status status;
  EXPECT_EQ(ReadRange(**reader, 6, 13, &status), "on the device");
  EXPECT_TRUE(status.ok()) << status;
}

// CachedFraction, where the store can tell, sees bytes just read as cached and, where the file
// system keeps its cache apart from the files (those with direct I/O; not tmpfs), dropped bytes as
// not; it has no answer for an empty range or one past the end.
TEST_P(StoreConformanceTest, CachedFractionSeesReadAndDroppedBytes) {
  const std::string content(64 * 4096 + 10, 'c');
  SP_ASSERT_OK(WriteWholeFile(Path("resident"), content));
  auto reader = store().OpenReadable(Path("resident"));
  ASSERT_TRUE(reader.ok());
  ReadableFile& file = **reader;
  EXPECT_FALSE(file.CachedFraction(0, 0).has_value());
  EXPECT_FALSE(file.CachedFraction(content.size(), 10).has_value());
  Status status;
  EXPECT_EQ(ReadRange(file, 0, content.size(), &status), content);
  std::optional<double> read = file.CachedFraction(0, content.size());
  if (!read.has_value()) {
    EXPECT_FALSE(file.CachedFraction(0, 4096).has_value()) << "answers for some ranges only";
    GTEST_SKIP() << "the store cannot tell what is cached";
  }
  EXPECT_EQ(*read, 1.0);
  EXPECT_EQ(file.CachedFraction(4096 * 10 + 5, 1), 1.0);
  EXPECT_EQ(file.CachedFraction(0, uint64_t{1} << 62), 1.0) << "the range ends with the file";
  if (file.direct_io_alignment() == 0) return;
  SP_ASSERT_OK(file.DropCache());
  std::optional<double> dropped = file.CachedFraction(0, content.size());
  ASSERT_TRUE(dropped.has_value());
  EXPECT_LE(*dropped, 0.25);
  EXPECT_EQ(ReadRange(file, 0, 8 * 4096, &status), content.substr(0, 8 * 4096));
  EXPECT_EQ(file.CachedFraction(0, 8 * 4096), 1.0);
}

// Ranges of more than 16 MiB are sampled: a sparse file read in its first half only.
TEST_P(StoreConformanceTest, CachedFractionSamplesLargeRanges) {
  if (!GetParam().large_sparse_files) GTEST_SKIP() << "store keeps files in memory";
  constexpr uint64_t kSize = uint64_t{600} << 20;
  auto writable = store().NewWritableFile(Path("sparse"));
  ASSERT_TRUE(writable.ok());
  SP_ASSERT_OK((*writable)->WriteAt(kSize - 1, AsBytes(std::string(1, 'x'))));
  SP_ASSERT_OK((*writable)->Sync());
  SP_ASSERT_OK((*writable)->Close());
  auto reader = store().OpenReadable(Path("sparse"));
  ASSERT_TRUE(reader.ok());
  ReadableFile& file = **reader;
  if (file.direct_io_alignment() == 0) GTEST_SKIP() << "no cache apart from the file";
  SP_ASSERT_OK(file.DropCache());
  std::optional<double> cold = file.CachedFraction(0, kSize);
  ASSERT_TRUE(cold.has_value());
  EXPECT_LE(*cold, 0.05);
  std::vector<std::byte> buffer(uint64_t{16} << 20);
  for (uint64_t at = 0; at < kSize / 2; at += buffer.size()) {
    SP_ASSERT_OK(file.ReadAt(at, MutableByteView(buffer.data(), buffer.size())));
  }
  std::optional<double> half = file.CachedFraction(0, kSize);
  ASSERT_TRUE(half.has_value());
  EXPECT_GE(*half, 0.45);
  EXPECT_LE(*half, 0.6);
  SP_ASSERT_OK(file.DropCache());
}

// Direct reads, where the store offers them, return the bytes buffered reads return, stop where
// the file ends, and refuse unaligned requests; a store without them refuses every one.
TEST_P(StoreConformanceTest, DirectReadsMatchBufferedReadsOrAreRefused) {
  std::string content(3 * 4096 + 100, '\0');
  for (size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>(i * 131 + 7);
  SP_ASSERT_OK(WriteWholeFile(Path("direct"), content));
  auto reader = store().OpenReadable(Path("direct"));
  ASSERT_TRUE(reader.ok());
  const uint64_t a = (*reader)->direct_io_alignment();
  if (a == 0) {
    AlignedBuffer buffer(4096);
    Result<uint64_t> refused = (*reader)->ReadDirectAt(0, buffer.view());
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("does not read files directly"));
    EXPECT_THAT(refused.status().message(), HasSubstr(Path("direct")));
    return;
  }
  ASSERT_EQ(a & (a - 1), 0u) << a;  // a power of two
  const uint64_t whole = (content.size() + a - 1) / a * a;
  AlignedBuffer buffer(whole + a, a);
  Result<uint64_t> n = (*reader)->ReadDirectAt(0, buffer.view());
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, content.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer.data()), *n), content);
  if (content.size() > a) {
    Result<uint64_t> middle = (*reader)->ReadDirectAt(a, MutableByteView(buffer.data(), a));
    ASSERT_TRUE(middle.ok()) << middle.status();
    EXPECT_EQ(*middle, std::min<uint64_t>(a, content.size() - a));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer.data()), *middle),
              content.substr(a, *middle));
  }
  Result<uint64_t> past = (*reader)->ReadDirectAt(whole, MutableByteView(buffer.data(), a));
  ASSERT_TRUE(past.ok()) << past.status();
  EXPECT_EQ(*past, 0u);
  Result<uint64_t> unaligned = (*reader)->ReadDirectAt(1, MutableByteView(buffer.data(), a));
  EXPECT_EQ(unaligned.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(unaligned.status().message(), HasSubstr("is not aligned to"));
}

// A direct scatter read fills its aligned pieces in order with the bytes one buffered read
// returns, stops where the file ends, and refuses a piece whose address or size is not aligned
// (naming the file); a store without direct reads refuses it.
TEST_P(StoreConformanceTest, DirectScatterReadsFillAlignedPiecesInOrder) {
  std::string content(5 * 4096 + 333, '\0');
  for (size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>(i * 29 + 3);
  SP_ASSERT_OK(WriteWholeFile(Path("scatter"), content));
  auto reader = store().OpenReadable(Path("scatter"));
  ASSERT_TRUE(reader.ok());
  const uint64_t a = (*reader)->direct_io_alignment();
  AlignedBuffer first(8192, 4096), second(8192, 4096), third(24576, 4096);
  if (a == 0) {
    const MutableByteView one[] = {first.view()};
    Result<uint64_t> refused = (*reader)->ReadDirectVAt(0, one);
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("does not read files directly"));
    return;
  }
  ASSERT_LE(a, 4096u);
  // Pieces of a, 2a and the rest (past the end of the file) at offset a.
  const MutableByteView pieces[] = {MutableByteView(first.data(), a),
                                    MutableByteView(second.data() + a, 2 * a),
                                    MutableByteView(third.data(), third.size())};
  Result<uint64_t> n = (*reader)->ReadDirectVAt(a, pieces);
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, content.size() - a);
  const auto text = [](const std::byte* p, uint64_t size) {
    return std::string(reinterpret_cast<const char*>(p), size);
  };
  EXPECT_EQ(text(first.data(), a), content.substr(a, a));
  EXPECT_EQ(text(second.data() + a, 2 * a), content.substr(2 * a, 2 * a));
  EXPECT_EQ(text(third.data(), *n - 3 * a), content.substr(4 * a));
  const MutableByteView unaligned[] = {MutableByteView(first.data(), a),
                                       MutableByteView(second.data() + 1, a)};
  Result<uint64_t> refused = (*reader)->ReadDirectVAt(0, unaligned);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("is not aligned to"));
  EXPECT_THAT(refused.status().message(), HasSubstr(Path("scatter")));
  if (a > 1) {
    const MutableByteView ragged[] = {MutableByteView(first.data(), a - 1),
                                      MutableByteView(second.data(), a)};
    EXPECT_EQ((*reader)->ReadDirectVAt(0, ragged).status().code(),
              StatusCode::kFailedPrecondition);
  }
}

// Direct writes, where the store offers them, land the bytes buffered reads then see, beside
// buffered writes to other blocks of the same file, and refuse unaligned requests; a store
// without them refuses every one.
TEST_P(StoreConformanceTest, DirectWritesLandBesideBufferedWritesOrAreRefused) {
  auto file = store().NewWritableFile(Path("direct-out"));
  ASSERT_TRUE(file.ok());
  const uint64_t a = (*file)->direct_io_alignment();
  if (a == 0) {
    AlignedBuffer buffer(4096);
    Status refused = (*file)->WriteDirectAt(0, buffer.view());
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.message(), HasSubstr("does not write files directly"));
    EXPECT_THAT(refused.message(), HasSubstr(Path("direct-out")));
    return;
  }
  ASSERT_EQ(a & (a - 1), 0u) << a;  // a power of two
  // Blocks 1 and 2 directly; a partial block 0 and a tail after block 3 through the page cache.
  std::string expected(4 * a + 77, '\0');
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<char>(i * 37 + 11);
  AlignedBuffer buffer(2 * a, a);
  std::memcpy(buffer.data(), expected.data() + a, 2 * a);
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes(expected.substr(0, a))));
  SP_ASSERT_OK((*file)->WriteDirectAt(a, buffer.view()));
  SP_ASSERT_OK((*file)->WriteAt(3 * a, AsBytes(expected.substr(3 * a))));
  Status unaligned = (*file)->WriteDirectAt(1, ByteView(buffer.data(), a));
  EXPECT_EQ(unaligned.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(unaligned.message(), HasSubstr("is not aligned to"));
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK((*file)->Close());
  auto reader = store().OpenReadable(Path("direct-out"));
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->size(), expected.size());
  Status status;
  EXPECT_EQ(ReadRange(**reader, 0, expected.size(), &status), expected);
  EXPECT_TRUE(status.ok()) << status;
}

TEST_P(StoreConformanceTest, ClosedFileRejectsFurtherCalls) {
  auto file = store().NewWritableFile(Path("closed"));
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->Close());
  Status write = (*file)->WriteAt(0, AsBytes("x"));
  EXPECT_EQ(write.code(), StatusCode::kFailedPrecondition) << write;
  EXPECT_THAT(write.message(), HasSubstr(Path("closed")));
  EXPECT_EQ((*file)->Sync().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*file)->Close().code(), StatusCode::kFailedPrecondition);
}

TEST_P(StoreConformanceTest, CreateDirsMakesParentsAndIsIdempotent) {
  SP_ASSERT_OK(store().CreateDirs(Path("a/b/c")));
  SP_ASSERT_OK(store().CreateDirs(Path("a/b/c")));
  SP_ASSERT_OK(store().CreateDirs(Path("a/b")));
  SP_ASSERT_OK(store().CreateDirs(Path("a//b/c/")));
  for (const char* dir : {"a", "a/b", "a/b/c"}) {
    auto is_dir = store().IsDirectory(Path(dir));
    ASSERT_TRUE(is_dir.ok()) << is_dir.status();
    EXPECT_TRUE(*is_dir) << dir;
    auto exists = store().Exists(Path(dir));
    ASSERT_TRUE(exists.ok());
    EXPECT_TRUE(*exists) << dir;
  }
  SP_ASSERT_OK(WriteWholeFile(Path("a/b/c/f"), "nested"));
  auto read = store().ReadFile(Path("a/b/c/f"));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "nested");
}

TEST_P(StoreConformanceTest, CreateDirsThroughAFileIsFailedPrecondition) {
  SP_ASSERT_OK(WriteWholeFile(Path("file"), "x"));
  for (const char* dir : {"file", "file/sub"}) {
    Status status = store().CreateDirs(Path(dir));
    EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(status.message(), HasSubstr(Path("file")));
  }
}

TEST_P(StoreConformanceTest, FilesAndDirectoriesAreToldApart) {
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "x"));
  SP_ASSERT_OK(store().CreateDirs(Path("d")));
  auto is_dir = store().IsDirectory(Path("f"));
  ASSERT_TRUE(is_dir.ok());
  EXPECT_FALSE(*is_dir);
  auto missing = store().IsDirectory(Path("none"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  auto under_file = store().Exists(Path("f/x"));
  ASSERT_TRUE(under_file.ok()) << under_file.status();
  EXPECT_FALSE(*under_file);
  auto open_dir = store().OpenReadable(Path("d"));
  EXPECT_EQ(open_dir.status().code(), StatusCode::kInvalidArgument) << open_dir.status();
  auto create_dir = store().NewWritableFile(Path("d"));
  EXPECT_EQ(create_dir.status().code(), StatusCode::kInvalidArgument) << create_dir.status();
}

TEST_P(StoreConformanceTest, RenameReplacesAnExistingFile) {
  SP_ASSERT_OK(WriteWholeFile(Path("tmp"), "new metadata"));
  SP_ASSERT_OK(WriteWholeFile(Path("final"), "old metadata, longer"));
  SP_ASSERT_OK(store().Rename(Path("tmp"), Path("final")));
  auto read = store().ReadFile(Path("final"));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "new metadata");
  auto exists = store().Exists(Path("tmp"));
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists);
  SP_ASSERT_OK(store().SyncDir(env_.root));
}

// A store that writes conditionally (Store::WriteFileIf) checks the condition with the write: of
// several writers racing for one, exactly one wins; a lost write leaves the file as it was.
TEST_P(StoreConformanceTest, ConditionalWritesHoldAtomicallyOrAreUnimplemented) {
  const FileCondition absent{FileCondition::Kind::kAbsent, ""};
  Status first = store().WriteFileIf(Path("m"), "first", absent);
  if (first.code() == StatusCode::kUnimplemented) {
    GTEST_SKIP() << "no conditional writes: " << first.message();
  }
  SP_ASSERT_OK(first);
  auto read = [&](std::string_view name) {
    Result<std::string> bytes = store().ReadFile(Path(name));
    return bytes.ok() ? *bytes : "error: " + bytes.status().ToString();
  };
  EXPECT_EQ(read("m"), "first");
  Status again = store().WriteFileIf(Path("m"), "second", absent);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again;
  EXPECT_THAT(again.message(), ::testing::HasSubstr(Path("m")));
  EXPECT_EQ(read("m"), "first");
  // A write whose condition fails where the file already holds its bytes (a retried write that
  // had landed) succeeds.
  EXPECT_TRUE(store().WriteFileIf(Path("m"), "first", absent).ok());

  Result<std::string> v1 = store().FileVersion(Path("m"));
  if (v1.status().code() == StatusCode::kUnimplemented) {  // kAbsent only
    EXPECT_EQ(store().WriteFileIf(Path("m"), "x", FileCondition{FileCondition::Kind::kVersion, "1"})
                  .code(),
              StatusCode::kUnimplemented);
  } else {
    ASSERT_TRUE(v1.ok()) << v1.status();
    SP_ASSERT_OK(store().WriteFileIf(Path("m"), "third",
                                     FileCondition{FileCondition::Kind::kVersion, *v1}));
    EXPECT_EQ(read("m"), "third");
    Result<std::string> v2 = store().FileVersion(Path("m"));
    ASSERT_TRUE(v2.ok()) << v2.status();
    EXPECT_NE(*v1, *v2);
    Status stale = store().WriteFileIf(Path("m"), "fourth",
                                       FileCondition{FileCondition::Kind::kVersion, *v1});
    EXPECT_EQ(stale.code(), StatusCode::kAlreadyExists) << stale;
    EXPECT_EQ(read("m"), "third");
    EXPECT_EQ(store().FileVersion(Path("none")).status().code(), StatusCode::kNotFound);
    Status no_file = store().WriteFileIf(Path("none"), "x",
                                         FileCondition{FileCondition::Kind::kVersion, *v2});
    EXPECT_FALSE(no_file.ok());
    auto none = store().Exists(Path("none"));
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(*none);
  }

  // Larger than a part of an object store's multipart upload.
  std::mt19937_64 rng(17);
  const std::string big = RandomBytes(rng, 6 << 20);
  SP_ASSERT_OK(store().WriteFileIf(Path("big"), big, absent));
  EXPECT_TRUE(read("big") == big);
  EXPECT_EQ(store().WriteFileIf(Path("big"), big.substr(1), absent).code(),
            StatusCode::kAlreadyExists);

  // Racing writers: one wins, and the file holds the winner's bytes.
  constexpr int kWriters = 6;
  std::vector<Status> results(kWriters);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWriters; ++i) {
    threads.emplace_back([&, i] {
      results[i] = store().WriteFileIf(Path("race"), "writer " + std::to_string(i), absent);
    });
  }
  for (std::thread& t : threads) t.join();
  int won = -1;
  for (int i = 0; i < kWriters; ++i) {
    if (results[i].ok()) {
      EXPECT_EQ(won, -1) << "writers " << won << " and " << i << " both won";
      won = i;
    } else {
      EXPECT_EQ(results[i].code(), StatusCode::kAlreadyExists) << results[i];
    }
  }
  ASSERT_NE(won, -1);
  EXPECT_EQ(read("race"), "writer " + std::to_string(won));
}

TEST_P(StoreConformanceTest, RenameErrors) {
  Status missing = store().Rename(Path("absent"), Path("x"));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr(Path("absent")));
  EXPECT_THAT(missing.message(), HasSubstr(Path("x")));
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "data"));
  Status no_parent = store().Rename(Path("f"), Path("no/dir/f"));
  EXPECT_EQ(no_parent.code(), StatusCode::kNotFound) << no_parent;
  SP_ASSERT_OK(store().CreateDirs(Path("d")));
  EXPECT_FALSE(store().Rename(Path("f"), Path("d")).ok());
  auto read = store().ReadFile(Path("f"));  // failed renames leave the source alone
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "data");
}

TEST_P(StoreConformanceTest, RenameMovesADirectoryWithItsContents) {
  SP_ASSERT_OK(store().CreateDirs(Path("staging/sub")));
  SP_ASSERT_OK(WriteWholeFile(Path("staging/a"), "A"));
  SP_ASSERT_OK(WriteWholeFile(Path("staging/sub/b"), "B"));
  SP_ASSERT_OK(store().Rename(Path("staging"), Path("step-100")));
  auto a = store().ReadFile(Path("step-100/a"));
  auto b = store().ReadFile(Path("step-100/sub/b"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, "A");
  EXPECT_EQ(*b, "B");
  auto old = store().Exists(Path("staging"));
  ASSERT_TRUE(old.ok());
  EXPECT_FALSE(*old);
}

TEST_P(StoreConformanceTest, OpenHandleFollowsItsFileAcrossRename) {
  if (!GetParam().handles_follow_renames) GTEST_SKIP() << "files exist only once closed";
  auto file = store().NewWritableFile(Path("tmp"));
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("before ")));
  SP_ASSERT_OK(store().Rename(Path("tmp"), Path("final")));
  SP_ASSERT_OK((*file)->WriteAt(7, AsBytes("after")));
  SP_ASSERT_OK((*file)->Close());
  auto read = store().ReadFile(Path("final"));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "before after");
}

TEST_P(StoreConformanceTest, ListDirIsSortedWithSizesAndKinds) {
  std::mt19937_64 rng(6);
  std::vector<std::string> names = {"b", "a", "z.tmp", "a.b", "a-b", "A", "d-10", "d-9", "_x"};
  std::shuffle(names.begin(), names.end(), rng);
  for (size_t i = 0; i < names.size(); ++i) {
    SP_ASSERT_OK(WriteWholeFile(Path(names[i]), std::string(names[i].size() * 3 + i, 'q')));
  }
  SP_ASSERT_OK(store().CreateDirs(Path("sub/deeper")));
  SP_ASSERT_OK(WriteWholeFile(Path("sub/deeper/hidden"), "not listed at the top"));
  auto entries = store().ListDir(env_.root);
  ASSERT_TRUE(entries.ok()) << entries.status();
  std::vector<std::string> expected_names = names;
  expected_names.push_back("sub");
  std::sort(expected_names.begin(), expected_names.end());
  ASSERT_EQ(entries->size(), expected_names.size());
  for (size_t i = 0; i < expected_names.size(); ++i) {
    const DirEntry& entry = (*entries)[i];
    EXPECT_EQ(entry.name, expected_names[i]);
    if (entry.name == "sub") {
      EXPECT_TRUE(entry.is_directory);
      continue;
    }
    EXPECT_FALSE(entry.is_directory);
    size_t index = std::find(names.begin(), names.end(), entry.name) - names.begin();
    EXPECT_EQ(entry.size, entry.name.size() * 3 + index) << entry.name;
  }
  auto sub = store().ListDir(Path("sub"));
  ASSERT_TRUE(sub.ok());
  ASSERT_EQ(sub->size(), 1u);
  EXPECT_EQ((*sub)[0].name, "deeper");
  EXPECT_TRUE((*sub)[0].is_directory);
}

TEST_P(StoreConformanceTest, ListDirErrors) {
  auto missing = store().ListDir(Path("absent"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(Path("absent")));
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "x"));
  auto on_file = store().ListDir(Path("f"));
  EXPECT_EQ(on_file.status().code(), StatusCode::kNotFound) << on_file.status();
  auto empty = store().ListDir(env_.root + "/");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 1u);
}

TEST_P(StoreConformanceTest, RemoveFile) {
  SP_ASSERT_OK(WriteWholeFile(Path("f"), "x"));
  SP_ASSERT_OK(store().RemoveFile(Path("f")));
  auto exists = store().Exists(Path("f"));
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists);
  Status again = store().RemoveFile(Path("f"));
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again;
  EXPECT_THAT(again.message(), HasSubstr(Path("f")));
  SP_ASSERT_OK(store().CreateDirs(Path("d")));
  EXPECT_FALSE(store().RemoveFile(Path("d")).ok());
}

TEST_P(StoreConformanceTest, RemoveDirOnlyWhenEmpty) {
  SP_ASSERT_OK(store().CreateDirs(Path("d")));
  SP_ASSERT_OK(WriteWholeFile(Path("d/f"), "x"));
  Status full = store().RemoveDir(Path("d"));
  EXPECT_EQ(full.code(), StatusCode::kFailedPrecondition) << full;
  EXPECT_THAT(full.message(), HasSubstr(Path("d")));
  SP_ASSERT_OK(store().RemoveFile(Path("d/f")));
  SP_ASSERT_OK(store().RemoveDir(Path("d")));
  EXPECT_EQ(store().RemoveDir(Path("d")).code(), StatusCode::kNotFound);
  auto exists = store().Exists(Path("d"));
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists);
}

TEST_P(StoreConformanceTest, SyncDir) {
  SP_ASSERT_OK(store().CreateDirs(Path("d")));
  SP_ASSERT_OK(store().SyncDir(Path("d")));
  SP_ASSERT_OK(store().SyncDir(env_.root));
  Status missing = store().SyncDir(Path("absent"));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr(Path("absent")));
}

TEST_P(StoreConformanceTest, OffsetsBeyondFourGiB) {
  if (!GetParam().large_sparse_files) GTEST_SKIP() << "store keeps files in memory";
  constexpr uint64_t kFourGiB = uint64_t{1} << 32;
  std::mt19937_64 rng(7);
  const std::string across = RandomBytes(rng, 64);    // straddles the 4 GiB boundary
  const std::string far = RandomBytes(rng, 4096);     // near 5 GiB
  const uint64_t far_offset = kFourGiB + (uint64_t{1} << 30) + 123;
  auto file = store().NewWritableFile(Path("big"));
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->WriteAt(far_offset, AsBytes(far)));
  SP_ASSERT_OK((*file)->WriteAt(kFourGiB - 32, AsBytes(across)));
  SP_ASSERT_OK((*file)->Close());
  auto reader = store().OpenReadable(Path("big"));
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->size(), far_offset + far.size());
  Status status;
  EXPECT_TRUE(ReadRange(**reader, kFourGiB - 32, across.size(), &status) == across);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_TRUE(ReadRange(**reader, far_offset, far.size(), &status) == far);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(ReadRange(**reader, 3 * (kFourGiB / 4), 8, &status), std::string(8, '\0'));
  ReadRange(**reader, far_offset + 1, far.size(), &status);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("offset " + std::to_string(far_offset + 1)));
  auto entries = store().ListDir(env_.root);
  ASSERT_TRUE(entries.ok());
  ASSERT_EQ(entries->size(), 1u);
  EXPECT_EQ((*entries)[0].size, far_offset + far.size());
}

}  // namespace
}  // namespace sp
