// make_test_checkpoint: writes a small native checkpoint for the command-line tests
// (tools/cli_verbs_test.sh). Not installed.
//
// usage: make_test_checkpoint DIR [--bump INDEX] [--no-optim] [--step N]
//   model.w   float32 [16, 8]  i * 0.25 (element INDEX gets +0.5 with --bump)
//   model.b   float32 [16]     i
//   optim.m   float32 [16, 8]  -i        (left out with --no-optim)
//   optim.count int64  [4]     i * 1000
//   objects: train.step = N (default 100), optim.lr = 0.001
// Saved from 2 in-process ranks (dimension 0 split), 2 files per rank.
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "tools/cli.h"

namespace {

struct Whole {
  std::string name;
  sp::DType dtype;
  sp::Shape shape;
  std::vector<std::byte> bytes;
};

template <typename T>
Whole Make(std::string name, sp::DType dtype, sp::Shape shape, const std::vector<T>& values) {
  Whole w{std::move(name), dtype, std::move(shape),
          std::vector<std::byte>(values.size() * sizeof(T))};
  std::memcpy(w.bytes.data(), values.data(), w.bytes.size());
  return w;
}

sp::Status SaveWholes(const std::string& dir, const std::vector<Whole>& tensors,
                      const std::vector<sp::ObjectEntry>& objects) {
  constexpr int kRanks = 2;
  std::vector<sp::Status> statuses = sp::RunRanks(kRanks, [&](sp::Communicator& comm) {
    sp::SaveState state;
    for (const Whole& t : tensors) {
      const int64_t rows = t.shape[0], row_bytes = static_cast<int64_t>(t.bytes.size()) / rows;
      const int64_t begin = rows * comm.rank() / kRanks, end = rows * (comm.rank() + 1) / kRanks;
      sp::Box box(std::vector<int64_t>(t.shape.size(), 0), t.shape);
      box.offsets[0] = begin;
      box.sizes[0] = end - begin;
      state.tensors.push_back(
          {t.name, t.dtype, t.shape, {{box, t.bytes.data() + begin * row_bytes}}});
    }
    if (comm.rank() == 0) state.objects = objects;
    sp::SaveOptions options;
    options.comm = &comm;
    options.files_per_rank = 2;
    return sp::Save(state, dir, options);
  });
  for (const sp::Status& s : statuses) SP_RETURN_IF_ERROR(s);
  return sp::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  sp::Result<sp::cli::Args> parsed = sp::cli::ParseArgs(args, {"no-optim"}, {"bump", "step"});
  if (!parsed.ok() || parsed->positional.size() != 1) {
    std::cerr << "usage: make_test_checkpoint DIR [--bump INDEX] [--no-optim] [--step N]\n";
    return 2;
  }
  std::vector<float> w(128), b(16), m(128);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i);
  for (size_t i = 0; i < m.size(); ++i) m[i] = -static_cast<float>(i);
  if (parsed->Has("bump")) {
    sp::Result<int64_t> at = sp::cli::ParseInt("bump", parsed->Get("bump", ""), 0, 127);
    if (!at.ok()) return sp::cli::Fail("make_test_checkpoint", at.status()) + 1;
    w[*at] += 0.5f;
  }
  std::vector<Whole> tensors = {Make("model.w", sp::DType::kFloat32, {16, 8}, w),
                                Make("model.b", sp::DType::kFloat32, {16}, b)};
  if (!parsed->Has("no-optim")) {
    tensors.push_back(Make("optim.m", sp::DType::kFloat32, {16, 8}, m));
    tensors.push_back(Make<int64_t>("optim.count", sp::DType::kInt64, {4}, {0, 1000, 2000, 3000}));
  }
  std::vector<sp::ObjectEntry> objects = {
      {"train.step", sp::ObjectEncoding::kJson, parsed->Get("step", "100")}};
  if (!parsed->Has("no-optim")) objects.push_back({"optim.lr", sp::ObjectEncoding::kJson, "0.001"});
  sp::Status s = SaveWholes(parsed->positional[0], tensors, objects);
  if (!s.ok()) return sp::cli::Fail("make_test_checkpoint", s);
  return 0;
}
