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
// destination (engine/read_executor.h) by default; a chunk with shorter runs is staged. From a
// store whose reads cross the network (object storage: the client copies every byte it receives
// anyway, into pieces or into staging), runs of 512 bytes and more; from local files, where
// each piece is an iovec of preadv (and, with direct I/O, a run that is not aligned lands in
// staging regardless), only runs of 64 KiB and more. On the 2-core test machine a resharded 1 GiB
// load from S3 took 1.15 s instead of 1.40 s with runs of 1-2 KiB in place, and one from a local
// disk 0.76 s instead of 0.55 s (docs/PERFORMANCE.md, "Object storage").
inline constexpr uint64_t kMinScatterRunBytes = 512;
inline constexpr uint64_t kMinScatterRunBytesLocal = uint64_t{64} << 10;

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_BUDGET_H_
