#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/open_store.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/store/store_conformance.h"

namespace sp {
namespace {

using ::testing::HasSubstr;

Result<std::string> MakeTempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "sp-store-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) return ErrnoToStatus(errno, "mkdtemp " + pattern);
  return pattern;
}

Result<StoreTestEnv> MakePosixEnv() {
  SP_ASSIGN_OR_RETURN(std::string dir, MakeTempDir());
  StoreTestEnv env;
  env.cleanup = [dir] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  };
  env.store = std::make_unique<PosixStore>();
  env.root = dir;
  return env;
}

Result<StoreTestEnv> MakeMemoryEnv() {
  StoreTestEnv env;
  env.store = std::make_unique<MemoryStore>();
  env.root = "/ckpt";
  SP_RETURN_IF_ERROR(env.store->CreateDirs(env.root));
  return env;
}

Result<StoreTestEnv> MakeFaultOverMemoryEnv() {
  StoreTestEnv env;
  env.base = std::make_unique<MemoryStore>();
  env.store = std::make_unique<FaultStore>(env.base.get());
  env.root = "/ckpt";
  SP_RETURN_IF_ERROR(env.store->CreateDirs(env.root));
  return env;
}

StoreConformanceParam Param(std::string name, std::function<Result<StoreTestEnv>()> make,
                            bool large_sparse_files = false) {
  StoreConformanceParam param;
  param.name = std::move(name);
  param.make = std::move(make);
  param.large_sparse_files = large_sparse_files;
  return param;
}

INSTANTIATE_TEST_SUITE_P(
    Stores, StoreConformanceTest,
    ::testing::Values(Param("Posix", MakePosixEnv, /*large_sparse_files=*/true),
                      Param("Memory", MakeMemoryEnv),
                      Param("FaultOverMemory", MakeFaultOverMemoryEnv)),
    StoreConformanceParamName);

// Direct reads through a fault store over POSIX files fail with the read faults, like buffered
// reads, and succeed once the fault is spent.
TEST(PosixStoreTest, FaultStoreFailsDirectReadsLikeOtherReads) {
  Result<StoreTestEnv> env = MakePosixEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  FaultStore faults(env->store.get());
  const std::string path = env->root + "/f";
  {
    auto out = faults.NewWritableFile(path);
    ASSERT_TRUE(out.ok());
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(std::string(8192, 'x'))).ok());
    ASSERT_TRUE((*out)->Sync().ok());
    ASSERT_TRUE((*out)->Close().ok());
  }
  auto reader = faults.OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  const uint64_t a = (*reader)->direct_io_alignment();
  if (a == 0 || a > 8192) GTEST_SKIP() << "no direct I/O in " << env->root;
  AlignedBuffer buffer(8192, a);
  faults.FailNext(FaultStore::Op::kRead, DataLossError("Input/output error"));
  Result<uint64_t> failed = (*reader)->ReadDirectAt(0, buffer.view());
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(failed.status().message(), "read " + path + " at offset 0: Input/output error");
  Result<uint64_t> read = (*reader)->ReadDirectAt(0, buffer.view());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, 8192u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer.data()), 8192), std::string(8192, 'x'));
}

// Direct writes through a fault store over POSIX files fail with the write faults, like buffered
// writes, and land once the fault is spent.
TEST(PosixStoreTest, FaultStoreFailsDirectWritesLikeOtherWrites) {
  Result<StoreTestEnv> env = MakePosixEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  FaultStore faults(env->store.get());
  const std::string path = env->root + "/f";
  auto out = faults.NewWritableFile(path);
  ASSERT_TRUE(out.ok());
  const uint64_t a = (*out)->direct_io_alignment();
  if (a == 0 || a > 8192) GTEST_SKIP() << "no direct I/O in " << env->root;
  AlignedBuffer buffer(8192, a);
  std::memset(buffer.data(), 'y', 8192);
  faults.FailNext(FaultStore::Op::kWrite, ResourceExhaustedError("No space left on device"));
  Status failed = (*out)->WriteDirectAt(0, buffer.view());
  EXPECT_EQ(failed.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(failed.message(), "write " + path + " at offset 0: No space left on device");
  ASSERT_TRUE((*out)->WriteDirectAt(0, buffer.view()).ok());
  ASSERT_TRUE((*out)->Sync().ok());
  ASSERT_TRUE((*out)->Close().ok());
  Result<std::string> back = faults.ReadFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, std::string(8192, 'y'));
}

// CachedFraction counts a range of up to 16 MiB page by page and samples a larger one: both
// see which part of a file the page cache holds.
TEST(PosixStoreTest, CachedFractionSeesTheCachedPartOfSmallAndSampledRanges) {
  Result<StoreTestEnv> env = MakePosixEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  const std::string path = env->root + "/f";
  constexpr uint64_t kMiB = uint64_t{1} << 20, kSize = 48 * kMiB;
  {
    auto out = env->store->NewWritableFile(path);
    ASSERT_TRUE(out.ok());
    std::string bytes(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
    ASSERT_TRUE((*out)->Sync().ok());
    ASSERT_TRUE((*out)->Close().ok());
  }
  auto reader = env->store->OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  ReadableFile& file = **reader;
  std::optional<double> cold = file.DropCache().ok() ? file.CachedFraction(0, kSize) : std::nullopt;
  if (!cold.has_value() || *cold > 0.02) {
    GTEST_SKIP() << "the file system under " << env->root << " cannot drop files from its cache";
  }
  // The last 16 MiB read through the cache, in 1 MiB reads (read-ahead, which caches up to
  // several MiB past a read, stops at the end of the file).
  std::string buffer(kMiB, '\0');
  for (uint64_t at = kSize - 16 * kMiB; at < kSize; at += kMiB) {
    ASSERT_TRUE(file.ReadAt(at, AsMutableBytes(buffer.data(), buffer.size())).ok());
  }
  // 16 MiB counted page by page; 24 and 48 MiB sampled.
  const std::optional<double> tail = file.CachedFraction(kSize - 16 * kMiB, 16 * kMiB);
  const std::optional<double> head = file.CachedFraction(0, 24 * kMiB);
  const std::optional<double> whole = file.CachedFraction(0, kSize);
  ASSERT_TRUE(head.has_value() && tail.has_value() && whole.has_value());
  EXPECT_EQ(*tail, 1.0);
  EXPECT_LT(*head, 0.02);
  EXPECT_GT(*whole, 1.0 / 3 - 0.03);
  EXPECT_LT(*whole, 1.0 / 3 + 0.06);
  EXPECT_EQ(file.CachedFraction(0, 0), std::nullopt);
  EXPECT_EQ(file.CachedFraction(kSize, 4096), std::nullopt);
}

// A block device's queue limits come from its sysfs directory, a partition's from its disk's;
// requests into scattered 4 KiB pages are shorter where the segments per request hold fewer
// pages than the largest request.
TEST(PosixStoreTest, BlockQueueLimitsComeFromTheDeviceOrItsDisk) {
  Result<std::string> dir = MakeTempDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto write = [](const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr) << path;
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  // A virtio disk (254 segments, 4 MiB requests) with a partition; an NVMe-like device (127
  // segments, 128 KiB requests); a directory without a queue.
  write(*dir + "/vda/queue/max_segments", "254\n");
  write(*dir + "/vda/queue/max_sectors_kb", "4096\n");
  std::filesystem::create_directories(*dir + "/vda/vda1");
  write(*dir + "/nvme/queue/max_segments", "127\n");
  write(*dir + "/nvme/queue/max_sectors_kb", "128\n");
  std::filesystem::create_directories(*dir + "/none");
  const BlockQueueLimits disk = ReadBlockQueueLimits(*dir + "/vda");
  EXPECT_EQ(disk.max_segments, 254u);
  EXPECT_EQ(disk.max_request_bytes, 4u << 20);
  EXPECT_TRUE(disk.small_pages_shorten_requests());
  const BlockQueueLimits partition = ReadBlockQueueLimits(*dir + "/vda/vda1");
  EXPECT_EQ(partition.max_segments, 254u);
  EXPECT_TRUE(partition.small_pages_shorten_requests());
  const BlockQueueLimits nvme = ReadBlockQueueLimits(*dir + "/nvme");
  EXPECT_EQ(nvme.max_request_bytes, 128u << 10);
  EXPECT_FALSE(nvme.small_pages_shorten_requests());
  const BlockQueueLimits none = ReadBlockQueueLimits(*dir + "/none");
  EXPECT_EQ(none.max_segments, 0u);
  EXPECT_FALSE(none.small_pages_shorten_requests());
  std::filesystem::remove_all(*dir);

  // A file on this machine answers as its device's directory does; one in shared memory (tmpfs:
  // no block device) does not shorten.
  Result<StoreTestEnv> env = MakePosixEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  const std::string path = env->root + "/f";
  write(path, "x");
  auto reader = env->store->OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  const std::string device = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                             std::to_string(minor(st.st_dev));
  EXPECT_EQ((*reader)->small_pages_shorten_requests(),
            major(st.st_dev) != 0 &&
                ReadBlockQueueLimits(device).small_pages_shorten_requests());
  if (std::filesystem::is_directory("/dev/shm")) {
    const std::string shm = "/dev/shm/sp-store-limits-" + std::to_string(::getpid());
    write(shm, "x");
    auto in_memory = env->store->OpenReadable(shm);
    ASSERT_TRUE(in_memory.ok());
    EXPECT_FALSE((*in_memory)->small_pages_shorten_requests());
    ::unlink(shm.c_str());
  }
}

TEST(PosixStoreTest, WriteErrorNamesPathAndOffset) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no writable /dev/full";
  PosixStore store;
  auto file = store.NewWritableFile("/dev/full");
  ASSERT_TRUE(file.ok()) << file.status();
  Status status = (*file)->WriteAt(4096, AsBytes("payload"));
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("write /dev/full at offset 4096"));
  EXPECT_THAT(status.message(), HasSubstr("errno 28"));
}

TEST(PosixStoreTest, ReaderSeesBytesWrittenAfterItOpened) {
  auto env = MakePosixEnv();
  ASSERT_TRUE(env.ok());
  Store& store = *env->store;
  const std::string path = JoinPath(env->root, "f");
  auto writer = store.NewWritableFile(path);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->WriteAt(0, AsBytes("abc")).ok());
  auto reader = store.OpenReadable(path);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->size(), 3u);  // the size when opened
  ASSERT_TRUE((*writer)->WriteAt(3, AsBytes("def")).ok());
  std::string out(6, '\0');
  ASSERT_TRUE((*reader)->ReadAt(0, AsMutableBytes(out.data(), out.size())).ok());
  EXPECT_EQ(out, "abcdef");
}

TEST(PosixStoreTest, WorksWithRelativeAndSlashedPaths) {
  auto env = MakePosixEnv();
  ASSERT_TRUE(env.ok());
  PosixStore store;
  ASSERT_TRUE(store.CreateDirs(env->root + "//x/./y/").ok());
  auto is_dir = store.IsDirectory(env->root + "/x/y");
  ASSERT_TRUE(is_dir.ok());
  EXPECT_TRUE(*is_dir);
}

// Issue 13, defect 5: opening a FIFO for reading must neither block nor succeed.
TEST(PosixStoreTest, RefusesFifosAndDevicesWithoutBlocking) {
  auto env = MakePosixEnv();
  ASSERT_TRUE(env.ok());
  const std::string fifo = env->root + "/d-0.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  PosixStore store;
  auto opened = store.OpenReadable(fifo);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(opened.status().message(),
            "open " + fifo + ": it is a FIFO (named pipe), not a regular file; checkpoint files "
            "must be regular files");
  auto small = ReadSmallFile(store, fifo, 1 << 20);
  ASSERT_FALSE(small.ok());
  EXPECT_THAT(small.status().message(), HasSubstr("is a FIFO"));
  auto device = store.OpenReadable("/dev/null");
  ASSERT_FALSE(device.ok());
  EXPECT_THAT(device.status().message(), HasSubstr("it is a character device"));
}

// Issue 13, defect 6: a link out of the checkpoint directory is refused unless allowed; the
// directory itself may be a link, and links inside it are followed.
TEST(PosixStoreTest, OpenInDirectoryRefusesLinksOutUnlessAllowed) {
  auto env = MakePosixEnv();
  ASSERT_TRUE(env.ok());
  PosixStore store;
  const std::string ckpt = env->root + "/ckpt", outside = env->root + "/outside";
  ASSERT_TRUE(store.CreateDirs(ckpt + "/blobs").ok());
  ASSERT_TRUE(store.CreateDirs(outside).ok());
  for (const std::string& path : {outside + "/x", ckpt + "/blobs/y"}) {
    auto file = store.NewWritableFile(path);
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE((*file)->WriteAt(0, AsBytes("abc", 3)).ok());
    ASSERT_TRUE((*file)->Close().ok());
  }
  ASSERT_EQ(::symlink((outside + "/x").c_str(), (ckpt + "/out").c_str()), 0);
  ASSERT_EQ(::symlink("../outside", (ckpt + "/sub").c_str()), 0);
  ASSERT_EQ(::symlink("blobs/y", (ckpt + "/in").c_str()), 0);
  ASSERT_EQ(::symlink(ckpt.c_str(), (env->root + "/latest").c_str()), 0);

  auto out = store.OpenInDirectory(ckpt, "out");
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(out.status().message(),
              HasSubstr("open " + ckpt + "/out: it is a symbolic link (or lies below one) to " +
                        outside + "/x, outside the checkpoint directory " + ckpt));
  EXPECT_FALSE(store.OpenInDirectory(ckpt, "sub/x").ok());
  EXPECT_TRUE(store.OpenInDirectory(ckpt, "in").ok());
  EXPECT_TRUE(store.OpenInDirectory(env->root + "/latest", "in").ok());
  EXPECT_TRUE(store.OpenInDirectory(env->root + "/latest", "blobs/y").ok());
  auto link = store.FindLink(ckpt, "in");
  ASSERT_TRUE(link.ok());
  EXPECT_TRUE(link->through_link && link->inside);
  EXPECT_EQ(link->target, ckpt + "/blobs/y");

  PosixStore allowing(PosixStoreOptions{.allow_external_links = true});
  EXPECT_TRUE(allowing.allows_external_links());
  EXPECT_TRUE(allowing.OpenInDirectory(ckpt, "out").ok());
  EXPECT_TRUE(allowing.OpenInDirectory(ckpt, "sub/x").ok());
}

// Issue 13, defect 9: one directory under several spellings is one file.
TEST(PosixStoreTest, SameFileSeesThroughSpellings) {
  auto env = MakePosixEnv();
  ASSERT_TRUE(env.ok());
  PosixStore store;
  const std::string dir = env->root + "/c01";
  ASSERT_TRUE(store.CreateDirs(dir).ok());
  ASSERT_EQ(::symlink(dir.c_str(), (env->root + "/alias").c_str()), 0);
  for (const std::string& other : {dir + "/.", dir + "/../c01", env->root + "/alias", dir + "/"}) {
    auto same = store.SameFile(dir, other);
    ASSERT_TRUE(same.ok());
    EXPECT_TRUE(*same) << other;
  }
  auto missing = store.SameFile(dir, env->root + "/absent");
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(*missing);
  auto other = store.SameFile(dir, env->root);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(*other);
}

TEST(MemoryStoreTest, PathsAreNormalized) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/a//b/").ok());
  auto file = store.NewWritableFile("a/b/./f");
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->WriteAt(0, AsBytes("12345")).ok());
  auto read = store.ReadFile("/a/b/f");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "12345");
  EXPECT_EQ(store.TotalFileBytes(), 5u);
  auto root = store.ListDir("/");
  ASSERT_TRUE(root.ok());
  ASSERT_EQ(root->size(), 1u);
  EXPECT_EQ((*root)[0].name, "a");
}

TEST(MemoryStoreTest, RemovedFileStaysReadableThroughAnOpenHandle) {
  MemoryStore store;
  auto file = store.NewWritableFile("f");
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->WriteAt(0, AsBytes("kept")).ok());
  auto reader = store.OpenReadable("f");
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(store.RemoveFile("f").ok());
  std::string out(4, '\0');
  ASSERT_TRUE((*reader)->ReadAt(0, AsMutableBytes(out.data(), 4)).ok());
  EXPECT_EQ(out, "kept");
  EXPECT_EQ(store.TotalFileBytes(), 0u);
}

TEST(MemoryStoreTest, RenamingADirectoryIntoItselfFails) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("d/e").ok());
  Status status = store.Rename("d", "d/e/f");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  auto is_dir = store.IsDirectory("d/e");
  ASSERT_TRUE(is_dir.ok());
  EXPECT_TRUE(*is_dir);
}

TEST(NormalizePathTest, Cases) {
  EXPECT_EQ(NormalizePath("/a//b/./c/"), "/a/b/c");
  EXPECT_EQ(NormalizePath("a/"), "a");
  EXPECT_EQ(NormalizePath("/"), "/");
  EXPECT_EQ(NormalizePath("//"), "/");
  EXPECT_EQ(NormalizePath(""), "");
  EXPECT_EQ(NormalizePath("./a/../b"), "a/../b");
}

TEST(OpenStoreTest, PicksTheStoreByScheme) {
  auto plain = OpenStore("/tmp/ckpt");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->name(), "posix");
  auto file = OpenStore("file:///tmp/ckpt");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->name(), "posix");
  auto memory = OpenStore("memory://");
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ((*memory)->name(), "memory");
  auto relative = ParseStoreUrl("runs/ckpt:1");
  ASSERT_TRUE(relative.ok());
  EXPECT_EQ(relative->scheme, "file");
  EXPECT_EQ(relative->path, "runs/ckpt:1");
  auto parsed = ParseStoreUrl("FILE:///a/b");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->scheme, "file");
  EXPECT_EQ(parsed->path, "/a/b");
}

TEST(OpenStoreTest, ParsesS3UrlsIntoBucketAndPath) {
  auto parsed = ParseStoreUrl("S3://my-bucket.1/runs/step-100");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->scheme, "s3");
  EXPECT_EQ(parsed->bucket, "my-bucket.1");
  EXPECT_EQ(parsed->path, "/runs/step-100");
  auto root = ParseStoreUrl("s3://bucket");
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(root->path, "/");
  for (const char* bad : {"s3://", "s3://ab/x", "s3://Upper/x", "s3://-dash/x", "s3://a_b/x"}) {
    auto refused = ParseStoreUrl(bad);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(refused.status().message(), HasSubstr("is not an S3 bucket name")) << bad;
  }
}

TEST(OpenStoreTest, RejectsUnknownSchemesAndHosts) {
  auto gs = OpenStore("gs://bucket/ckpt");
  ASSERT_FALSE(gs.ok());
  EXPECT_EQ(gs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(gs.status().message(), HasSubstr("'gs'"));
  EXPECT_THAT(gs.status().message(), HasSubstr("gs://bucket/ckpt"));
  auto host = OpenStore("file://host/ckpt");
  EXPECT_EQ(host.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStore("").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sp
