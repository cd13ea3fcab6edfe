// Helpers of the tests that run several processes or may block (exec/shared_io_tuner_test.cc,
// exec/round_board_test.cc).
#ifndef SHARDPOINT_EXEC_PROCESS_TEST_UTIL_H_
#define SHARDPOINT_EXEC_PROCESS_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>

namespace sp {

// Runs `body` in a forked child; returns its pid. The child exits 0 when body returns true.
template <typename F>
pid_t Fork(F body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body() ? 0 : 1);
  return pid;
}

// Reaps child `pid`: its exit status, or 128 + the signal that ended it.
inline int ExitCode(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Waits for `f` at most `seconds`; a wait that never returns would otherwise hang the test. On
// a timeout the test fails and the process exits (the blocked thread cannot be joined).
template <typename F>
bool Within(double seconds, F f) {
  auto done = std::async(std::launch::async, f);
  if (done.wait_for(std::chrono::duration<double>(seconds)) == std::future_status::ready) {
    return true;
  }
  ADD_FAILURE() << "still blocked after " << seconds << " s";
  std::_Exit(3);
}

}  // namespace sp

#endif  // SHARDPOINT_EXEC_PROCESS_TEST_UTIL_H_
