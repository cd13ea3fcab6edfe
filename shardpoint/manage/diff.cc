// Diff: keys from the two metadata, values through batched Loads of A's chunks from both sides.
#include "shardpoint/manage/diff.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "shardpoint/checkpoint.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/geometry/convert.h"
#include "shardpoint/store/open_store.h"

namespace sp {
namespace {

constexpr int64_t kCompareElements = 8192;  // elements converted to float64 at a time

enum class Kind { kFloat, kComplex, kExact };

Kind KindOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3FNUZ:
    case DType::kFloat8E5M2FNUZ:
    case DType::kFloat8E8M0FNU:
      return Kind::kFloat;
    case DType::kComplex64:
    case DType::kComplex128:
      return Kind::kComplex;
    default:
      return Kind::kExact;
  }
}

// One region of a tensor to compare, and where its bytes lie in the batch buffers.
struct Slab {
  const TensorMetadata* tensor = nullptr;
  Box box;
  uint64_t buffer_offset = 0;
};

// The global index of element `linear` (row-major) of `box`.
std::vector<int64_t> GlobalIndex(const Box& box, int64_t linear) {
  std::vector<int64_t> index(box.rank());
  for (size_t d = box.rank(); d-- > 0;) {
    index[d] = box.offsets[d] + linear % box.sizes[d];
    linear /= box.sizes[d];
  }
  return index;
}

// |a - b| under the rules of diff.h; 0 when equal.
double Difference(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::isnan(a) && std::isnan(b) ? 0 : std::numeric_limits<double>::infinity();
  }
  if (a == b) return 0;
  const double d = std::fabs(a - b);
  return std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
}

void Record(TensorValueDiff* diff, const Box& box, int64_t element, double d) {
  if (diff->elements_differing++ == 0) diff->first_index = GlobalIndex(box, element);
  diff->max_abs_diff = std::max(diff->max_abs_diff, d);
}

// Compares `count` elements at a and b (dtype of `diff`) of the slab `box`.
Status CompareValues(const std::byte* a, const std::byte* b, int64_t count, const Box& box,
                     double atol, TensorValueDiff* diff) {
  const Kind kind = KindOf(diff->dtype);
  const size_t item = DTypeSize(diff->dtype);
  const int parts = kind == Kind::kComplex ? 2 : 1;
  const DType wide = kind == Kind::kComplex ? DType::kComplex128 : DType::kFloat64;
  std::vector<double> da(kCompareElements * parts), db(kCompareElements * parts);
  for (int64_t lo = 0; lo < count; lo += kCompareElements) {
    const int64_t n = std::min(kCompareElements, count - lo);
    if (kind == Kind::kExact && std::memcmp(a + lo * item, b + lo * item, n * item) == 0) continue;
    SP_RETURN_IF_ERROR(ConvertElements(diff->dtype, a + lo * item, wide, da.data(), n));
    SP_RETURN_IF_ERROR(ConvertElements(diff->dtype, b + lo * item, wide, db.data(), n));
    for (int64_t i = 0; i < n; ++i) {
      double worst = 0;
      bool differs = false;
      if (kind == Kind::kExact) {
        differs = std::memcmp(a + (lo + i) * item, b + (lo + i) * item, item) != 0;
        worst = std::fabs(da[i] - db[i]);
      } else {
        for (int p = 0; p < parts; ++p) {
          const double d = Difference(da[i * parts + p], db[i * parts + p]);
          worst = std::max(worst, d);
          differs = differs || d > atol;
        }
      }
      if (differs) Record(diff, box, lo + i, worst);
    }
  }
  return OkStatus();
}

// Loads the slabs of a batch from one checkpoint into `buffer`.
Status LoadSlabs(const std::vector<Slab>& slabs, std::string_view path, Store* store, int threads,
                 std::vector<std::byte>* buffer) {
  LoadState state;
  std::map<std::string_view, size_t> index;
  for (const Slab& s : slabs) {
    auto [it, added] = index.try_emplace(s.tensor->name, state.tensors.size());
    if (added) state.tensors.push_back({s.tensor->name, s.tensor->dtype, s.tensor->shape, {}});
    state.tensors[it->second].pieces.push_back({s.box, buffer->data() + s.buffer_offset});
  }
  LoadOptions options;
  options.store = store;
  options.threads = threads;
  return Load(state, path, options).status();
}

class Comparer {
 public:
  Comparer(std::string_view a, std::string_view b, const DiffOptions& options)
      : a_(a), b_(b), options_(options) {}

  // Queues the slabs of every chunk of `tensor` (A's), flushing full batches.
  Status AddTensor(const TensorMetadata& tensor) {
    const uint64_t item = DTypeSize(tensor.dtype);
    for (const StoredChunk& chunk : tensor.chunks) {
      for (Box& box : SplitIntoSlabs(chunk.box, item, options_.slab_bytes)) {
        const uint64_t bytes = static_cast<uint64_t>(box.volume()) * item;
        if (batch_bytes_ + bytes > options_.slab_bytes) SP_RETURN_IF_ERROR(Flush());
        batch_.push_back({&tensor, std::move(box), batch_bytes_});
        batch_bytes_ += bytes;
      }
    }
    return OkStatus();
  }

  Status Flush() {
    if (batch_.empty()) return OkStatus();
    buffer_a_.assign(batch_bytes_, std::byte{0});
    buffer_b_.assign(batch_bytes_, std::byte{0});
    SP_RETURN_IF_ERROR(LoadSlabs(batch_, a_, options_.store_a, options_.threads, &buffer_a_));
    SP_RETURN_IF_ERROR(LoadSlabs(batch_, b_, options_.store_b, options_.threads, &buffer_b_));
    for (const Slab& s : batch_) {
      TensorValueDiff& diff = diffs_[s.tensor->name];
      diff.name = s.tensor->name;
      diff.dtype = s.tensor->dtype;
      elements_ += static_cast<uint64_t>(s.box.volume());
      SP_RETURN_IF_ERROR(CompareValues(buffer_a_.data() + s.buffer_offset,
                                       buffer_b_.data() + s.buffer_offset, s.box.volume(), s.box,
                                       options_.atol, &diff));
    }
    batch_.clear();
    batch_bytes_ = 0;
    return OkStatus();
  }

  void Report(DiffReport* report) const {
    for (const auto& [name, diff] : diffs_) {
      if (diff.elements_differing > 0) report->values_differ.push_back(diff);
    }
    report->elements_compared = elements_;
  }

 private:
  std::string_view a_, b_;
  const DiffOptions& options_;
  std::vector<Slab> batch_;
  uint64_t batch_bytes_ = 0;
  std::vector<std::byte> buffer_a_, buffer_b_;
  std::map<std::string, TensorValueDiff> diffs_;
  uint64_t elements_ = 0;
};

void CompareObjects(const CheckpointMetadata& a, const CheckpointMetadata& b, DiffReport* report) {
  for (const ObjectEntry& o : a.objects) {
    const ObjectEntry* other = b.FindObject(o.name);
    if (other == nullptr) {
      report->objects_only_in_a.push_back(o.name);
    } else if (other->encoding != o.encoding || other->payload != o.payload) {
      report->objects_differ.push_back(o.name);
    }
  }
  for (const ObjectEntry& o : b.objects) {
    if (a.FindObject(o.name) == nullptr) report->objects_only_in_b.push_back(o.name);
  }
}

}  // namespace

bool DiffReport::equal() const {
  return tensors_only_in_a.empty() && tensors_only_in_b.empty() && objects_only_in_a.empty() &&
         objects_only_in_b.empty() && mismatched.empty() && values_differ.empty() &&
         objects_differ.empty();
}

std::vector<Box> SplitIntoSlabs(const Box& box, uint64_t item_bytes, uint64_t max_bytes) {
  if (box.empty()) return {};
  const size_t rank = box.rank();
  if (rank == 0 || static_cast<uint64_t>(box.volume()) * item_bytes <= max_bytes) return {box};
  // The outermost dimension d whose single index fits, and how many indices of it fit.
  size_t d = rank - 1;
  uint64_t inner = item_bytes;
  for (size_t k = rank - 1; k > 0 && inner * box.sizes[k] <= max_bytes; --k) {
    inner *= box.sizes[k];
    d = k - 1;
  }
  const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(max_bytes / inner));
  std::vector<Box> slabs;
  std::vector<int64_t> outer(d, 0);  // odometer over dimensions [0, d)
  while (true) {
    for (int64_t lo = 0; lo < box.sizes[d]; lo += step) {
      Box slab = box;
      for (size_t k = 0; k < d; ++k) {
        slab.offsets[k] += outer[k];
        slab.sizes[k] = 1;
      }
      slab.offsets[d] += lo;
      slab.sizes[d] = std::min(step, box.sizes[d] - lo);
      slabs.push_back(std::move(slab));
    }
    size_t k = d;
    while (k > 0 && ++outer[k - 1] == box.sizes[k - 1]) outer[--k] = 0;
    if (k == 0) break;
  }
  return slabs;
}

namespace {

// Reads the payloads of the objects of `md` (the checkpoint at `path`) that are still stored.
Status ReadAllObjects(std::string_view path, Store* store, CheckpointMetadata& md) {
  std::unique_ptr<Store> owned;
  if (store == nullptr) {
    SP_ASSIGN_OR_RETURN(owned, OpenStore(path));
    store = owned.get();
  }
  return ReadObjectPayloads(*store, path, md, md.objects);
}

}  // namespace

Result<DiffReport> Diff(std::string_view a, std::string_view b, const DiffOptions& options) {
  if (!(options.atol >= 0)) return InvalidArgumentError("atol must be a number >= 0");
  if (options.slab_bytes == 0) return InvalidArgumentError("slab_bytes must be positive");
  SP_ASSIGN_OR_RETURN(CheckpointMetadata ma, ReadCheckpointMetadata(a, options.store_a));
  SP_ASSIGN_OR_RETURN(CheckpointMetadata mb, ReadCheckpointMetadata(b, options.store_b));
  DiffReport report;
  Comparer comparer(a, b, options);
  for (const TensorMetadata& t : ma.tensors) {
    const TensorMetadata* other = mb.FindTensor(t.name);
    if (other == nullptr) {
      report.tensors_only_in_a.push_back(t.name);
    } else if (other->dtype != t.dtype || other->shape != t.shape) {
      report.mismatched.push_back({t.name, t.dtype, other->dtype, t.shape, other->shape});
    } else {
      ++report.tensors_compared;
      SP_RETURN_IF_ERROR(comparer.AddTensor(t));
    }
  }
  SP_RETURN_IF_ERROR(comparer.Flush());
  comparer.Report(&report);
  for (const TensorMetadata& t : mb.tensors) {
    if (ma.FindTensor(t.name) == nullptr) report.tensors_only_in_b.push_back(t.name);
  }
  SP_RETURN_IF_ERROR(ReadAllObjects(a, options.store_a, ma));
  SP_RETURN_IF_ERROR(ReadAllObjects(b, options.store_b, mb));
  CompareObjects(ma, mb, &report);
  return report;
}

}  // namespace sp
