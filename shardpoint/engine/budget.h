// The default byte budget of the memory a call holds beyond the caller's own buffers
// (docs/DESIGN.md decision 8). One constant, so that every default (C++ options, the Python
// binding, the CLI) is the same.
#ifndef SHARDPOINT_ENGINE_BUDGET_H_
#define SHARDPOINT_ENGINE_BUDGET_H_

#include <cstdint>

namespace sp {

// The default bound on the memory a call holds beyond the caller's buffers: a load's staging, a
// streaming save's filled pieces, a consolidation's tensor data in flight.
inline constexpr uint64_t kDefaultMemoryBudgetBytes = uint64_t{256} << 20;

// The shortest run of a stored chunk that a load's scattered read puts straight in its
// destination (engine/read_executor.h); a chunk with shorter runs is staged: many tiny pieces
// cost a scatter read more than one copy of the rows.
inline constexpr uint64_t kMinScatterRunBytes = 512;

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_BUDGET_H_
