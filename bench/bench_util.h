// What the C++ benchmarks share: a median, and integer flags ("--runs 5").
#ifndef SHARDPOINT_BENCH_BENCH_UTIL_H_
#define SHARDPOINT_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace sp::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Sets each flag of `flags` ({"--runs", &runs}, ...) given as "--name N"; returns false (after
// printing "usage: <usage>") on anything else.
inline bool ParseIntFlags(int argc, char** argv,
                          const std::vector<std::pair<const char*, int*>>& flags,
                          const char* usage) {
  for (int i = 1; i < argc; ++i) {
    bool known = false;
    for (const auto& [name, value] : flags) {
      if (std::strcmp(argv[i], name) == 0 && i + 1 < argc) {
        *value = std::atoi(argv[++i]);
        known = true;
        break;
      }
    }
    if (!known) {
      std::fprintf(stderr, "usage: %s\n", usage);
      return false;
    }
  }
  return true;
}

}  // namespace sp::bench

#endif  // SHARDPOINT_BENCH_BENCH_UTIL_H_
