#include "shardpoint/engine/direct_write.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/posix_store.h"

namespace sp {
namespace {

// Writes `content` through a DirectWriteFile over `store` as random disjoint pieces (random
// offsets and lengths, so most pieces start and end inside a block) in random order from four
// threads; returns the bytes written directly.
uint64_t WriteInPieces(Store& store, const std::string& path, const std::string& content,
                       uint64_t min_bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // offset, length
  for (uint64_t at = 0; at < content.size();) {
    const uint64_t n = std::min<uint64_t>(content.size() - at, 1 + rng() % 40000);
    pieces.emplace_back(at, n);
    at += n;
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  BufferPool staging(4, 1 << 20);
  BufferPool::Stay stay(staging);
  auto base = store.NewWritableFile(path);
  EXPECT_TRUE(base.ok()) << base.status();
  DirectWriteFile file(std::move(base).value(), staging, min_bytes, /*piece_bytes=*/16384);
  EXPECT_TRUE(file.Preallocate(content.size()).ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < pieces.size(); i += 4) {
        const auto [at, n] = pieces[i];
        Status s = file.WriteAt(at, AsBytes(content).subspan(at, n));
        EXPECT_TRUE(s.ok()) << s;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(file.Sync().ok());
  EXPECT_TRUE(file.Close().ok());
  return file.direct_bytes();
}

std::string Content(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST(DirectWriteFileTest, RandomPiecesLandExactlyOnAFileThatTakesDirectWrites) {
  std::string dir = (std::filesystem::temp_directory_path() / "sp_direct_write_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  PosixStore store;
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    const std::string content = Content(1'000'003 + seed * 4099, seed);
    const std::string path = dir + "/f" + std::to_string(seed);
    const uint64_t direct = WriteInPieces(store, path, content, /*min_bytes=*/0, seed);
    Result<std::string> back = store.ReadFile(path);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == content) << "seed " << seed;
    auto probe = store.NewWritableFile(dir + "/probe");
    ASSERT_TRUE(probe.ok());
    if ((*probe)->direct_io_alignment() == 0) {
      EXPECT_EQ(direct, 0u);  // a file system without O_DIRECT: all through the page cache
    } else {
      // Most bytes are in whole blocks inside pieces of up to 40,000 bytes.
      EXPECT_GT(direct, content.size() / 2) << "seed " << seed;
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(DirectWriteFileTest, SmallWritesAndStoresWithoutDirectWritesGoThroughThePageCache) {
  MemoryStore memory;
  ASSERT_TRUE(memory.CreateDirs("/d").ok());
  const std::string content = Content(300'000, 9);
  EXPECT_EQ(WriteInPieces(memory, "/d/f", content, 0, 9), 0u);
  Result<std::string> back = memory.ReadFile("/d/f");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == content);

  std::string dir = (std::filesystem::temp_directory_path() / "sp_direct_write_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  PosixStore store;
  // Every piece is under 40,001 bytes: with a minimum above that, none is written directly.
  EXPECT_EQ(WriteInPieces(store, dir + "/f", content, 40001, 9), 0u);
  back = store.ReadFile(dir + "/f");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == content);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sp
