// The state of the engine tests on object storage: a float32 matrix "w" of [rows, cols] whose
// elements depend on a step, saved split by rows over some ranks (in-process threads) with an
// object "step", and loaded split by columns over others with every element checked.
#ifndef SHARDPOINT_TESTING_SPLIT_MATRIX_H_
#define SHARDPOINT_TESTING_SPLIT_MATRIX_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/thread_comm.h"

namespace sp::testing {

inline float SplitMatrixValue(int64_t r, int64_t c, int64_t cols, int step) {
  return static_cast<float>((int64_t{step} * 7919 + r * cols + c) % 16777216);
}

// The first error of `statuses`, or OK.
inline Status FirstError(const std::vector<Status>& statuses) {
  for (const Status& s : statuses) SP_RETURN_IF_ERROR(s);
  return OkStatus();
}

// Saves step `step` of w [rows, cols] split by rows over `ranks` ranks (rows divisible by ranks)
// to `url` through `store` (the URL's own when null); every rank's status.
inline std::vector<Status> SaveRowSplit(const std::string& url, int step, int64_t rows,
                                        int64_t cols, int ranks, Store* store, bool overwrite) {
  return RunRanks(ranks, [&](Communicator& comm) -> Status {
    const int64_t mine_rows = rows / ranks, first = comm.rank() * mine_rows;
    std::vector<float> mine(mine_rows * cols);
    for (int64_t r = 0; r < mine_rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        mine[r * cols + c] = SplitMatrixValue(first + r, c, cols, step);
      }
    }
    SaveState state;
    state.tensors.push_back(
        SaveTensor{"w", DType::kFloat32, {rows, cols},
                   {ConstPieceView{Box({first, 0}, {mine_rows, cols}),
                                   reinterpret_cast<const std::byte*>(mine.data())}}});
    state.objects.push_back(ObjectEntry{"step", ObjectEncoding::kJson, std::to_string(step)});
    SaveOptions options;
    options.comm = &comm;
    options.store = store;
    options.overwrite = overwrite;
    return Save(state, url, options);
  });
}

// Loads w split by columns over `ranks` ranks through `store` and checks the object and every
// element against step `step`. `bytes_read`, when given, gets the bytes each rank read. With
// `across_machines` the ranks say they run on separate machines (comm/comm_test_util.h).
inline Status LoadColumnSplitAndCheck(const std::string& url, int step, int64_t rows, int64_t cols,
                                      int ranks, Store* store,
                                      std::vector<uint64_t>* bytes_read = nullptr,
                                      std::optional<bool> share_reads = std::nullopt,
                                      bool across_machines = false) {
  if (bytes_read != nullptr) bytes_read->assign(ranks, 0);
  return FirstError(RunRanks(ranks, [&](Communicator& threads) -> Status {
    AcrossMachinesComm apart(threads);
    Communicator& comm = across_machines ? static_cast<Communicator&>(apart) : threads;
    const int64_t per_rank = (cols + ranks - 1) / ranks, first = comm.rank() * per_rank;
    const int64_t mine_cols = std::max<int64_t>(0, std::min(per_rank, cols - first));
    std::vector<float> mine(rows * mine_cols, -1.0f);
    LoadState state;
    state.tensors.push_back(LoadTensor{"w", DType::kFloat32, {rows, cols},
                                       {PieceView{Box({0, first}, {rows, mine_cols}),
                                                  reinterpret_cast<std::byte*>(mine.data())}}});
    state.objects.push_back("step");
    LoadOptions options;
    options.comm = &comm;
    options.store = store;
    options.share_reads = share_reads;
    SP_ASSIGN_OR_RETURN(LoadResult result, Load(state, url, options));
    if (bytes_read != nullptr) (*bytes_read)[comm.rank()] = result.bytes_read;
    if (result.objects.size() != 1 || result.objects[0].payload != std::to_string(step)) {
      return DataLossError("object 'step' is not " + std::to_string(step));
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < mine_cols; ++c) {
        if (mine[r * mine_cols + c] != SplitMatrixValue(r, first + c, cols, step)) {
          return DataLossError("w[" + std::to_string(r) + ", " + std::to_string(first + c) +
                               "] differs");
        }
      }
    }
    return OkStatus();
  }));
}

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_SPLIT_MATRIX_H_
