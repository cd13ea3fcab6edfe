#include "shardpoint/exec/shared_memory.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "shardpoint/base/random_id.h"

namespace sp {
namespace {

std::string FreshName() { return "/sp-shm-test-" + RandomHexId(12); }

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(SharedMemoryTest, AnotherProcessSeesTheBytesAndTheNameCanGoWhileMapped) {
  const std::string name = FreshName();
  Result<SharedMemory> created = SharedMemory::Create(name, 3 * 4096 + 5);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->size(), 3u * 4096 + 5);
  for (uint64_t i = 0; i < created->size(); ++i) ASSERT_EQ(created->data()[i], std::byte{0});
  std::memcpy(created->data() + 4096, "parent", 6);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Result<SharedMemory> opened = SharedMemory::Open(name, 3 * 4096 + 5);
    if (!opened.ok() || std::memcmp(opened->data() + 4096, "parent", 6) != 0) _exit(1);
    std::memcpy(opened->data() + 3 * 4096, "child", 5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(std::memcmp(created->data() + 3 * 4096, "child", 5), 0);

  SharedMemory::Unlink(name);
  EXPECT_FALSE(Exists(name));
  std::memcpy(created->data(), "still mapped", 12);  // the mapping outlives the name
  SharedMemory::Unlink(name);                        // gone already: no error
  SharedMemory moved = std::move(created).value();
  EXPECT_EQ(std::memcmp(moved.data(), "still mapped", 12), 0);
}

TEST(SharedMemoryTest, ErrorsNameTheObjectAndWhatIsWrong) {
  const std::string name = FreshName();
  Result<SharedMemory> missing = SharedMemory::Open(name, 4096);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(name), std::string::npos);

  Result<SharedMemory> created = SharedMemory::Create(name, 8192);
  ASSERT_TRUE(created.ok()) << created.status();
  Result<SharedMemory> again = SharedMemory::Create(name, 8192);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  Result<SharedMemory> other_size = SharedMemory::Open(name, 4096);
  EXPECT_EQ(other_size.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other_size.status().message().find("holds 8192 bytes"), std::string::npos)
      << other_size.status();
  SharedMemory::Unlink(name);

  EXPECT_EQ(SharedMemory::Create("no-slash", 4096).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemory::Create("/a/b", 4096).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemory::Create(FreshName(), 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(SharedMemoryTest, AnObjectWhosePagesAreNotReservedIsRefused) {
  // Sized but not reserved (what a creator still reserving its pages, or a foreign object,
  // looks like): touching it could raise SIGBUS on a full /dev/shm, so Open refuses it.
  const std::string name = FreshName();
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
  close(fd);
  Result<SharedMemory> opened = SharedMemory::Open(name, 1 << 20);
  EXPECT_EQ(opened.status().code(), StatusCode::kFailedPrecondition) << opened.status();
  EXPECT_NE(opened.status().message().find("reserved"), std::string::npos) << opened.status();
  SharedMemory::Unlink(name);
}

TEST(SharedMemoryTest, OpenWaitsForACreatorStillSizingTheObject) {
  // A creator between shm_open and posix_fallocate: the object is there but empty. Open with a
  // wait maps it once it is sized and reserved, and never before.
  const std::string name = FreshName();
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  std::thread creator([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_EQ(ftruncate(fd, 8192), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // sized, not yet reserved
    ASSERT_EQ(posix_fallocate(fd, 0, 8192), 0);
    const char hello[] = "sized";
    ASSERT_EQ(pwrite(fd, hello, sizeof(hello), 100), static_cast<ssize_t>(sizeof(hello)));
  });
  Result<SharedMemory> opened = SharedMemory::Open(name, 8192, 10.0);
  creator.join();
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_STREQ(reinterpret_cast<const char*>(opened->data() + 100), "sized");
  close(fd);

  // Without a wait, or once the wait is over, an empty object is refused; one of another size
  // is refused at once, however long the wait.
  SharedMemory::Unlink(name);
  const int empty = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(empty, 0);
  EXPECT_EQ(SharedMemory::Open(name, 8192).status().code(), StatusCode::kFailedPrecondition);
  Result<SharedMemory> late = SharedMemory::Open(name, 8192, 0.05);
  EXPECT_EQ(late.status().code(), StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_NE(late.status().message().find("was not sized within"), std::string::npos)
      << late.status();
  ASSERT_EQ(ftruncate(empty, 100), 0);
  const auto start = std::chrono::steady_clock::now();
  Result<SharedMemory> other = SharedMemory::Open(name, 8192, 10.0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition) << other.status();
  EXPECT_NE(other.status().message().find("holds 100 bytes"), std::string::npos)
      << other.status();
  close(empty);
  SharedMemory::Unlink(name);
}

TEST(SharedMemoryTest, APartlyReservedObjectIsReservedPieceByPieceBeforeItIsWritten) {
  // The creator reserves the first page; Open is told so, and each piece is reserved before it
  // is written. A process that expects every page reserved refuses the object.
  const std::string name = FreshName();
  constexpr uint64_t kBytes = (uint64_t{1} << 20) + 8192;
  Result<SharedMemory> created = SharedMemory::Create(name, kBytes, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  auto reserved = [&] {
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    struct stat st;
    const bool ok = fd >= 0 && fstat(fd, &st) == 0;
    if (fd >= 0) close(fd);
    return ok ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
  };
  EXPECT_GE(reserved(), 4096u);
  EXPECT_LT(reserved(), uint64_t{1} << 20);
  Result<SharedMemory> whole = SharedMemory::Open(name, kBytes);
  EXPECT_EQ(whole.status().code(), StatusCode::kFailedPrecondition) << whole.status();
  EXPECT_NE(whole.status().message().find("with " + std::to_string(kBytes) + " reserved"),
            std::string::npos)
      << whole.status();
  Result<SharedMemory> opened = SharedMemory::Open(name, kBytes, 0, 4096);
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_TRUE(opened->Reserve(8192, uint64_t{1} << 20).ok());
  EXPECT_GE(reserved(), (uint64_t{1} << 20) + 4096);
  std::memcpy(opened->data() + kBytes - 6, "opener", 6);
  EXPECT_EQ(std::memcmp(created->data() + kBytes - 6, "opener", 6), 0);
  const Status outside = created->Reserve(4096, kBytes);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument) << outside;
  EXPECT_NE(outside.message().find(name), std::string::npos) << outside;
  Result<uint64_t> available = created->AvailableBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_GT(*available, 0u);
  SharedMemory::Unlink(name);

  // More than the file system holds: refused by name; a creator that cannot reserve removes the
  // object. (A /dev/shm without a size limit reports no blocks, and is not asked.)
  struct statvfs fs;
  ASSERT_EQ(statvfs("/dev/shm", &fs), 0);
  const uint64_t total = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
  if (total == 0) return;
  const std::string big_name = FreshName();
  Result<SharedMemory> big = SharedMemory::Create(big_name, total + (uint64_t{1} << 20), 4096);
  ASSERT_TRUE(big.ok()) << big.status();
  SharedMemory::Unlink(big_name);
  const Status full = big->Reserve(0, big->size());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find(big_name), std::string::npos) << full;
  const std::string too_big = FreshName();
  EXPECT_EQ(SharedMemory::Create(too_big, total + (uint64_t{1} << 20)).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_FALSE(Exists(too_big));
}

}  // namespace
}  // namespace sp
