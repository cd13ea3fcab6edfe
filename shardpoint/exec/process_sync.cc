#include "shardpoint/exec/process_sync.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#ifdef __linux__
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace sp {

#ifdef __linux__

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double seconds) {
  timespec timeout;
  timeout.tv_sec = static_cast<time_t>(seconds);
  timeout.tv_nsec = static_cast<long>((seconds - static_cast<double>(timeout.tv_sec)) * 1e9);
  // Not FUTEX_PRIVATE: the word is in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr,
          0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

uint64_t PidNamespace() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

uint64_t ProcessStartTime(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buffer[1024];
  const ssize_t n = ::read(fd, buffer, sizeof(buffer) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buffer[n] = '\0';
  // The command name (field 2) is in parentheses and may hold spaces: count from the last ')'.
  const char* at = std::strrchr(buffer, ')');
  if (at == nullptr) return 0;
  for (int field = 2; field < 22 && at != nullptr; ++field) at = std::strchr(at + 1, ' ');
  return at == nullptr ? 0 : std::strtoull(at + 1, nullptr, 10);
}

bool ProcessExited(int pid, uint64_t started) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  return started != 0 && ProcessStartTime(pid) != started;
}

#else  // !__linux__

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double) {
  if (word->load() == expected) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}
void FutexWake(std::atomic<uint32_t>*) {}
uint64_t PidNamespace() { return 0; }
uint64_t ProcessStartTime(int) { return 0; }
bool ProcessExited(int, uint64_t) { return false; }

#endif

}  // namespace sp
