// crash_driver: one save or one check of the crash-consistency campaign (scripts/crash_trials.py,
// docs/TESTING.md "Crash consistency"). Not installed.
//
// The state is a pure function of a seed and the size: five tensors (float32, bfloat16, int64;
// split by rows, by columns, on a grid, and replicated on every rank) whose bytes come from a
// splitmix64 stream keyed by the seed, plus three objects (JSON and bytes) that name the seed. A
// checker recomputes it and compares every byte.
//
// usage:
//   crash_driver save DIR --seed S [--ranks R] [--format native|torch-dcp] [--async]
//                         [--overwrite] [--direct-io] [--mb M]
//       Saves the state of seed S from R in-process ranks (default 1). Prints "saving" on stdout
//       (flushed) once the state is built, just before the save starts, so that a runner can time
//       the save alone. With --async each rank uses an AsyncSaver and overwrites its own tensors
//       with garbage as soon as Start returns (the checkpoint must hold the values at Start).
//       With --direct-io the large writes bypass the page cache (SaveOptions::direct_io).
//       Exit 0 when committed, 1 on a save error (printed).
//   crash_driver check DIR --expect S[,S...] [--ranks Q] [--mb M]
//       Loads DIR from Q in-process ranks (default 1; any Q works for any saved R: the load
//       layouts differ from the save layouts, so the reads reshard) and compares the tensors and
//       objects bit-exactly with the state of the seed the checkpoint names. Exit codes:
//         0  loaded, equal to the state of one of the expected seeds ("loaded seed S")
//         3  refused cleanly: no committed checkpoint at DIR (the error is printed)
//         4  refused with another error (a committed checkpoint that cannot be loaded)
//         5  loaded but WRONG: a byte or an object differs, or the seed is not expected
//         2  usage; anything else (a signal) means the checker crashed.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shardpoint/base/bytes.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/format/torch_save/plain_value.h"
#include "shardpoint/geometry/strided_copy.h"
#include "tools/cli.h"

namespace {

constexpr int kExitLoaded = 0;
constexpr int kExitNoCheckpoint = 3;
constexpr int kExitRefused = 4;
constexpr int kExitWrong = 5;

// How a tensor is split over n ranks.
enum class Split { kRows, kCols, kGrid, kWhole };

struct Spec {
  std::string name;
  sp::DType dtype;
  sp::Shape shape;
  Split save_split;
  Split load_split;
};

// The tensors of a state of about `mb` MiB. Dimensions are odd so that splits are uneven.
std::vector<Spec> Specs(int64_t mb) {
  const int64_t unit = mb << 20;
  return {
      {"model.embed", sp::DType::kFloat32, {unit * 4 / 10 / (4 * 1000) | 1, 1000}, Split::kRows,
       Split::kCols},
      {"model.proj", sp::DType::kBFloat16, {767, unit * 3 / 10 / (767 * 2) | 1}, Split::kCols,
       Split::kRows},
      {"optim.exp_avg", sp::DType::kFloat32, {unit * 3 / 10 / (4 * 513) | 1, 513}, Split::kGrid,
       Split::kRows},
      {"model.norm", sp::DType::kFloat32, {4093}, Split::kWhole, Split::kRows},
      {"optim.step", sp::DType::kInt64, {7}, Split::kWhole, Split::kWhole},
  };
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void FillRandom(uint64_t seed, uint64_t stream, sp::MutableByteView out) {
  uint64_t state = seed * 0x100000001b3ull + stream * 0x9e3779b97f4a7c15ull;
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t v = SplitMix64(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  const uint64_t v = SplitMix64(state);
  std::memcpy(out.data() + i, &v, out.size() - i);
}

std::vector<sp::AlignedBuffer> GlobalTensors(const std::vector<Spec>& specs, uint64_t seed) {
  std::vector<sp::AlignedBuffer> out;
  for (size_t t = 0; t < specs.size(); ++t) {
    out.emplace_back(sp::ShapeVolume(specs[t].shape) * sp::DTypeSize(specs[t].dtype));
    FillRandom(seed, t, out.back().view());
  }
  return out;
}

std::vector<sp::ObjectEntry> Objects(uint64_t seed) {
  std::string blob(1000 + seed % 97, '\0');
  FillRandom(seed, 1000, sp::MutableByteView(reinterpret_cast<std::byte*>(blob.data()), blob.size()));
  const std::string s = std::to_string(seed);
  return {{"crash.seed", sp::ObjectEncoding::kJson, s},
          {"crash.config", sp::ObjectEncoding::kJson, "{\"seed\":" + s + ",\"lr\":0.001}"},
          {"crash.rng", sp::ObjectEncoding::kBytes, blob}};
}

// [begin, end) of part `i` of `n` along a dimension of `size`.
std::pair<int64_t, int64_t> Part(int64_t size, int i, int n) {
  return {size * i / n, size * (i + 1) / n};
}

// The box that rank `rank` of `n` holds of `shape` under `split`.
sp::Box BoxFor(const sp::Shape& shape, Split split, int rank, int n) {
  sp::Box box(std::vector<int64_t>(shape.size(), 0), shape);
  auto cut = [&](size_t dim, int i, int parts) {
    const auto [begin, end] = Part(shape[dim], i, parts);
    box.offsets[dim] = begin;
    box.sizes[dim] = end - begin;
  };
  if (split == Split::kRows || (split != Split::kWhole && shape.size() == 1)) {
    cut(0, rank, n);
  } else if (split == Split::kCols) {
    cut(1, rank, n);
  } else if (split == Split::kGrid) {
    int a = 1;
    for (int d = 1; d * d <= n; ++d) {
      if (n % d == 0) a = d;
    }
    cut(0, rank / (n / a), a);
    cut(1, rank % (n / a), n / a);
  }
  return box;
}

// Copies `box` of the row-major global tensor into `out` (sized for the box).
void Extract(const sp::AlignedBuffer& global, const Spec& spec, const sp::Box& box,
             std::byte* out) {
  const size_t element = sp::DTypeSize(spec.dtype);
  sp::Box whole(std::vector<int64_t>(spec.shape.size(), 0), spec.shape);
  sp::Status s = sp::CopyRegion({global.data(), whole, element}, {out, box, element}, box);
  if (!s.ok()) std::abort();  // the boxes above always lie inside the shape
}

struct RankPieces {
  std::vector<sp::Box> boxes;               // per tensor
  std::vector<sp::AlignedBuffer> buffers;   // per tensor, the box's bytes
};

RankPieces PiecesFor(const std::vector<Spec>& specs, bool for_save, int rank, int n) {
  RankPieces p;
  for (const Spec& spec : specs) {
    p.boxes.push_back(BoxFor(spec.shape, for_save ? spec.save_split : spec.load_split, rank, n));
    p.buffers.emplace_back(
        std::max<size_t>(1, sp::ShapeVolume(p.boxes.back().sizes) * sp::DTypeSize(spec.dtype)));
  }
  return p;
}

struct SaveArgs {
  std::string dir;
  uint64_t seed = 0;
  int ranks = 1;
  int64_t mb = 16;
  sp::CheckpointFormat format = sp::CheckpointFormat::kNative;
  bool async = false;
  bool overwrite = false;
  bool direct_io = false;
};

sp::Status SaveOneRank(const SaveArgs& args, const std::vector<Spec>& specs, RankPieces& pieces,
                       sp::Communicator& comm, sp::ThreadPool& pool) {
  sp::SaveState state;
  for (size_t t = 0; t < specs.size(); ++t) {
    state.tensors.push_back({specs[t].name, specs[t].dtype, specs[t].shape,
                             {{pieces.boxes[t], pieces.buffers[t].data()}}});
  }
  state.objects = Objects(args.seed);
  sp::SaveOptions options;
  options.comm = &comm;
  options.pool = &pool;
  options.files_per_rank = 2;
  options.overwrite = args.overwrite;
  options.format = args.format;
  options.direct_io = args.direct_io;
  if (!args.async) return sp::Save(state, args.dir, options);
  sp::AsyncSaver saver;
  SP_RETURN_IF_ERROR(saver.Start(state, args.dir, options));
  // Training goes on: the caller's tensors change while the save runs.
  for (sp::AlignedBuffer& b : pieces.buffers) std::memset(b.data(), 0xA5, b.size());
  return saver.Wait();
}

int Save(const SaveArgs& args) {
  const std::vector<Spec> specs = Specs(args.mb);
  std::vector<sp::AlignedBuffer> global = GlobalTensors(specs, args.seed);
  std::vector<RankPieces> pieces;
  for (int r = 0; r < args.ranks; ++r) {
    pieces.push_back(PiecesFor(specs, /*for_save=*/true, r, args.ranks));
    for (size_t t = 0; t < specs.size(); ++t) {
      Extract(global[t], specs[t], pieces[r].boxes[t], pieces[r].buffers[t].data());
    }
  }
  sp::ThreadPool pool(4);
  std::cout << "saving" << std::endl;
  std::vector<sp::Status> statuses = sp::RunRanks(args.ranks, [&](sp::Communicator& comm) {
    return SaveOneRank(args, specs, pieces[comm.rank()], comm, pool);
  });
  for (const sp::Status& s : statuses) {
    if (!s.ok()) return sp::cli::Fail("crash_driver save", s);
  }
  std::cout << "committed seed " << args.seed << std::endl;
  return 0;
}

// True when `got` holds the value of `want`: the same entry, or (torch-dcp, whose objects are
// torch.save archives that load back as plain pickles) a plain pickle of the same value.
bool SameObject(const sp::ObjectEntry& got, const sp::ObjectEntry& want) {
  namespace ts = sp::torch_save;
  if (got.encoding == want.encoding) return got.payload == want.payload;
  if (got.encoding != sp::ObjectEncoding::kPlain) return false;
  sp::Result<ts::PlainValue> value = ts::DecodePlainPickle(got.payload, got.name);
  if (!value.ok()) return false;
  if (want.encoding == sp::ObjectEncoding::kBytes) return *value == ts::PlainValue::Bytes(want.payload);
  if (want.name == "crash.seed") return *value == ts::PlainValue::Int(std::stoll(want.payload));
  const int64_t seed = std::stoll(want.payload.substr(want.payload.find(':') + 1));
  return *value == ts::PlainValue::Dict({{ts::PlainValue::String("seed"), ts::PlainValue::Int(seed)},
                                         {ts::PlainValue::String("lr"), ts::PlainValue::Float(0.001)}});
}

// Compares rank `rank`'s loaded pieces and objects with the state of `seed`; "" when equal.
std::string Compare(const std::vector<Spec>& specs, const RankPieces& got,
                    const std::vector<sp::ObjectEntry>& objects, uint64_t seed, int rank) {
  const std::vector<sp::AlignedBuffer> global = GlobalTensors(specs, seed);
  for (size_t t = 0; t < specs.size(); ++t) {
    const size_t bytes = sp::ShapeVolume(got.boxes[t].sizes) * sp::DTypeSize(specs[t].dtype);
    sp::AlignedBuffer want(std::max<size_t>(1, bytes));
    Extract(global[t], specs[t], got.boxes[t], want.data());
    if (std::memcmp(want.data(), got.buffers[t].data(), bytes) != 0) {
      return "tensor " + specs[t].name + " on load rank " + std::to_string(rank) + " (box " +
             got.boxes[t].ToString() + ") differs from the state of seed " + std::to_string(seed);
    }
  }
  for (const sp::ObjectEntry& w : Objects(seed)) {
    auto it = std::find_if(objects.begin(), objects.end(),
                           [&](const sp::ObjectEntry& o) { return o.name == w.name; });
    if (it == objects.end() || !SameObject(*it, w)) {
      return "object " + w.name + " differs from the state of seed " + std::to_string(seed);
    }
  }
  return "";
}

// The seed named by the loaded crash.seed object (JSON, or a plain pickle from torch-dcp).
sp::Result<uint64_t> SeedOf(const std::vector<sp::ObjectEntry>& objects) {
  for (const sp::ObjectEntry& o : objects) {
    if (o.name != "crash.seed") continue;
    if (o.encoding == sp::ObjectEncoding::kPlain) {
      sp::Result<sp::torch_save::PlainValue> v = sp::torch_save::DecodePlainPickle(o.payload, o.name);
      if (v.ok() && v->is(sp::torch_save::PlainValue::Kind::kInt) && v->int_value >= 0) {
        return static_cast<uint64_t>(v->int_value);
      }
      break;
    }
    try {
      return static_cast<uint64_t>(std::stoull(o.payload));
    } catch (const std::exception&) {
      break;
    }
  }
  return sp::DataLossError("the loaded objects have no readable crash.seed");
}

int Check(const std::string& dir, const std::set<uint64_t>& expect, int ranks, int64_t mb) {
  const std::vector<Spec> specs = Specs(mb);
  std::vector<std::string> wrong(ranks);
  std::vector<uint64_t> seeds(ranks, 0);
  std::vector<sp::Status> statuses = sp::RunRanks(ranks, [&](sp::Communicator& comm) -> sp::Status {
    RankPieces pieces = PiecesFor(specs, /*for_save=*/false, comm.rank(), ranks);
    sp::LoadState state;
    for (size_t t = 0; t < specs.size(); ++t) {
      state.tensors.push_back({specs[t].name, specs[t].dtype, specs[t].shape,
                               {{pieces.boxes[t], pieces.buffers[t].data()}}});
    }
    for (const sp::ObjectEntry& o : Objects(0)) state.objects.push_back(o.name);
    sp::LoadOptions options;
    options.comm = &comm;
    SP_ASSIGN_OR_RETURN(sp::LoadResult result, sp::Load(state, dir, options));
    sp::Result<uint64_t> seed = SeedOf(result.objects);
    if (!seed.ok()) {
      wrong[comm.rank()] = seed.status().message();
    } else {
      seeds[comm.rank()] = *seed;
      wrong[comm.rank()] = Compare(specs, pieces, result.objects, *seed, comm.rank());
    }
    return sp::OkStatus();
  });
  for (const sp::Status& s : statuses) {
    if (s.ok()) continue;
    std::cout << (s.code() == sp::StatusCode::kNotFound ? "no checkpoint: " : "refused: ")
              << s.ToString() << std::endl;
    return s.code() == sp::StatusCode::kNotFound ? kExitNoCheckpoint : kExitRefused;
  }
  for (int r = 0; r < ranks; ++r) {
    if (!wrong[r].empty()) {
      std::cout << "WRONG: " << dir << ": " << wrong[r] << std::endl;
      return kExitWrong;
    }
    if (!expect.count(seeds[r])) {
      std::cout << "WRONG: " << dir << " holds the state of seed " << seeds[r]
                << ", which is not an expected one" << std::endl;
      return kExitWrong;
    }
  }
  std::cout << "loaded seed " << seeds[0] << std::endl;
  return kExitLoaded;
}

constexpr char kUsage[] =
    "usage: crash_driver save DIR --seed S [--ranks R] [--format native|torch-dcp] [--async] "
    "[--overwrite] [--direct-io] [--mb M]\n"
    "       crash_driver check DIR --expect S[,S...] [--ranks Q] [--mb M]\n";

int Usage(const std::string& message) {
  std::cerr << "crash_driver: " << message << "\n" << kUsage;
  return sp::cli::kExitUsage;
}

sp::Result<std::set<uint64_t>> ParseSeeds(const std::string& text) {
  std::set<uint64_t> seeds;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    SP_ASSIGN_OR_RETURN(int64_t s, sp::cli::ParseInt("expect", item, 0, int64_t{1} << 40));
    seeds.insert(static_cast<uint64_t>(s));
  }
  if (seeds.empty()) return sp::InvalidArgumentError("--expect names no seed");
  return seeds;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> argv_rest(argv + std::min(argc, 2), argv + argc);
  const std::string mode = argc > 1 ? argv[1] : "";
  sp::Result<sp::cli::Args> args = sp::cli::ParseArgs(
      argv_rest, {"async", "overwrite", "direct-io"}, {"seed", "ranks", "format", "mb", "expect"});
  if (!args.ok()) return Usage(args.status().message());
  if (args->positional.size() != 1) return Usage("expected one directory");
  sp::Result<int64_t> ranks = sp::cli::ParseInt("ranks", args->Get("ranks", "1"), 1, 64);
  sp::Result<int64_t> mb = sp::cli::ParseInt("mb", args->Get("mb", "16"), 1, 4096);
  if (!ranks.ok()) return Usage(ranks.status().message());
  if (!mb.ok()) return Usage(mb.status().message());
  if (mode == "check") {
    sp::Result<std::set<uint64_t>> expect = ParseSeeds(args->Get("expect", ""));
    if (!expect.ok()) return Usage(expect.status().message());
    return Check(args->positional[0], *expect, static_cast<int>(*ranks), *mb);
  }
  if (mode != "save") return Usage("the mode is save or check");
  SaveArgs save;
  save.dir = args->positional[0];
  sp::Result<int64_t> seed = sp::cli::ParseInt("seed", args->Get("seed", ""), 0, int64_t{1} << 40);
  if (!seed.ok()) return Usage(seed.status().message());
  save.seed = static_cast<uint64_t>(*seed);
  save.ranks = static_cast<int>(*ranks);
  save.mb = *mb;
  const std::string format = args->Get("format", "native");
  if (format != "native" && format != "torch-dcp") return Usage("--format is native or torch-dcp");
  save.format = format == "native" ? sp::CheckpointFormat::kNative : sp::CheckpointFormat::kTorchDcp;
  save.async = args->Has("async");
  save.overwrite = args->Has("overwrite");
  save.direct_io = args->Has("direct-io");
  return Save(save);
}
