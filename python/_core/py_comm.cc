#include "python/_core/py_comm.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include <nanobind/stl/vector.h>

#include "python/_core/arrays.h"
#include "python/_core/errors.h"

namespace nb = nanobind;

namespace sp::python {
namespace {

constexpr const char* kMethods[] = {"gather", "scatter", "broadcast", "all_gather", "barrier"};

nb::bytes ToBytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

// A list of exactly `count` bytes-like objects; raises TypeError / ValueError.
std::vector<std::string> FromBytesList(nb::handle obj, int count, std::string_view op) {
  if (obj.is_none()) {
    throw nb::type_error((std::string(op) + " returned None, expected a list of " +
                          std::to_string(count) + " bytes objects").c_str());
  }
  std::vector<std::string> out;
  for (nb::handle item : obj) out.push_back(BytesFromPython(item));
  if (static_cast<int>(out.size()) != count) {
    throw nb::value_error((std::string(op) + " returned " + std::to_string(out.size()) +
                           " payloads, expected one per rank (" + std::to_string(count) + ")")
                              .c_str());
  }
  return out;
}

// Runs `body` with the GIL held; a Python exception becomes kUnavailable naming the collective.
template <typename T, typename Body>
Result<T> CallWithGil(std::string_view op, Body&& body) {
  nb::gil_scoped_acquire gil;
  try {
    return body();
  } catch (nb::python_error& e) {
    return UnavailableError("communicator " + std::string(op) +
                            " failed: " + DescribePythonError(e));
  } catch (const std::exception& e) {
    return UnavailableError("communicator " + std::string(op) + " failed: " + e.what());
  }
}

int ReadIntAttribute(nb::handle comm, const char* name) {
  if (!nb::hasattr(comm, name)) {
    throw nb::type_error(
        (std::string("comm object has no attribute '") + name + "' (expected an int)").c_str());
  }
  nb::object value = comm.attr(name);
  int out = 0;
  if (!nb::try_cast(value, out)) {
    throw nb::type_error((std::string("comm.") + name + " must be an int, found " +
                          nb::type_name(value.type()).c_str())
                             .c_str());
  }
  return out;
}

}  // namespace

std::unique_ptr<PyCommunicator> PyCommunicator::FromObject(nb::handle comm) {
  const int rank = ReadIntAttribute(comm, "rank");
  const int size = ReadIntAttribute(comm, "size");
  if (size < 1 || rank < 0 || rank >= size) {
    throw nb::value_error(("comm has rank " + std::to_string(rank) + " and size " +
                           std::to_string(size) + ": expected 0 <= rank < size")
                              .c_str());
  }
  for (const char* method : kMethods) {
    if (!nb::hasattr(comm, method)) {
      throw nb::type_error((std::string("comm object has no method '") + method + "'").c_str());
    }
  }
  return std::unique_ptr<PyCommunicator>(
      new PyCommunicator(nb::borrow<nb::object>(comm), rank, size, nb::hasattr(comm, "all_to_all"),
                         nb::hasattr(comm, "all_to_all_buffers"),
                         nb::hasattr(comm, "spans_machines"), nb::hasattr(comm, "any_rank"),
                         nb::hasattr(comm, "exchange_with_peers")));
}

Result<std::vector<std::string>> PyCommunicator::Gather(std::string payload, int root) {
  return CallWithGil<std::vector<std::string>>("gather", [&] {
    nb::object gathered = comm_.attr("gather")(ToBytes(payload), root);
    if (rank_ != root) return std::vector<std::string>();
    return FromBytesList(gathered, size_, "gather");
  });
}

Result<std::string> PyCommunicator::Scatter(std::vector<std::string> payloads, int root) {
  return CallWithGil<std::string>("scatter", [&] {
    nb::object chunks = nb::none();
    if (rank_ == root) {
      nb::list list;
      for (const std::string& p : payloads) list.append(ToBytes(p));
      chunks = std::move(list);
    }
    return BytesFromPython(comm_.attr("scatter")(chunks, root));
  });
}

Result<std::string> PyCommunicator::Broadcast(std::string payload, int root) {
  return CallWithGil<std::string>("broadcast", [&] {
    nb::object data = rank_ == root ? nb::object(ToBytes(payload)) : nb::none();
    return BytesFromPython(comm_.attr("broadcast")(data, root));
  });
}

Result<std::vector<std::string>> PyCommunicator::AllGather(std::string payload) {
  return CallWithGil<std::vector<std::string>>("all_gather", [&] {
    return FromBytesList(comm_.attr("all_gather")(ToBytes(payload)), size_, "all_gather");
  });
}

Status PyCommunicator::Barrier() {
  Result<bool> done = CallWithGil<bool>("barrier", [&] {
    comm_.attr("barrier")();
    return true;
  });
  return done.status();
}

Result<bool> PyCommunicator::AnyRank(bool flag) {
  if (!has_any_rank_) return Communicator::AnyRank(flag);
  return CallWithGil<bool>("any_rank", [&] {
    nb::object answer = comm_.attr("any_rank")(flag);
    if (!nb::isinstance<nb::bool_>(answer)) {
      throw nb::type_error((std::string("any_rank returned ") +
                            nb::type_name(answer.type()).c_str() + ", expected a bool")
                               .c_str());
    }
    return nb::cast<bool>(answer);
  });
}

Result<std::vector<std::string>> PyCommunicator::AllToAll(std::vector<std::string> payloads) {
  if (!has_all_to_all_ && !has_all_to_all_buffers_) {
    return Communicator::AllToAll(std::move(payloads));
  }
  if (static_cast<int>(payloads.size()) != size_) {
    return InvalidArgumentError("AllToAll: rank " + std::to_string(rank_) + " passed " +
                                std::to_string(payloads.size()) +
                                " payloads, expected one per rank (" + std::to_string(size_) + ")");
  }
  if (has_all_to_all_buffers_) return AllToAllBuffers(std::move(payloads));
  return CallWithGil<std::vector<std::string>>("all_to_all", [&] {
    nb::list list;
    for (const std::string& p : payloads) list.append(ToBytes(p));
    return FromBytesList(comm_.attr("all_to_all")(list), size_, "all_to_all");
  });
}

Result<std::vector<std::string>> PyCommunicator::ExchangeWithPeers(
    std::vector<std::pair<int, std::string>> sends, const std::vector<int>& from) {
  if (!has_exchange_with_peers_) return Communicator::ExchangeWithPeers(std::move(sends), from);
  // Checked before the call: the object's sends and receives would wait on a rank that is not
  // there.
  SP_RETURN_IF_ERROR(CheckPeerLists(sends, from, rank_, size_));
  return CallWithGil<std::vector<std::string>>("exchange_with_peers", [&] {
    // Each payload as a bytearray: torch views it as a writable buffer, without a copy.
    nb::list outgoing;
    for (const auto& [q, bytes] : sends) {
      nb::object data = nb::steal(PyByteArray_FromStringAndSize(
          bytes.data(), static_cast<Py_ssize_t>(bytes.size())));
      if (!data.is_valid()) throw nb::python_error();
      outgoing.append(nb::make_tuple(q, data));
    }
    nb::list sources;
    for (int s : from) sources.append(s);
    nb::object got = comm_.attr("exchange_with_peers")(outgoing, sources);
    if (got.is_none()) {
      throw nb::type_error(("exchange_with_peers returned None, expected a list of " +
                            std::to_string(from.size()) + " bytes objects")
                               .c_str());
    }
    std::vector<std::string> received;
    for (nb::handle item : got) received.push_back(BytesFromPython(item));
    if (received.size() != from.size()) {
      throw nb::value_error(("exchange_with_peers returned " + std::to_string(received.size()) +
                             " payloads, expected one per source (" +
                             std::to_string(from.size()) + ")")
                                .c_str());
    }
    return received;
  });
}

namespace {

// A buffer-protocol view of an object, released (with the GIL held) when it goes.
class HeldBuffer {
 public:
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  // Views `obj` as C-contiguous bytes; raises TypeError naming `what` when it cannot.
  void Take(nb::handle obj, const char* what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw nb::type_error((std::string(what) + " is a " + nb::type_name(obj.type()).c_str() +
                            ", expected a C-contiguous object with the buffer protocol")
                               .c_str());
    }
    held_ = true;
  }
  const char* data() const { return static_cast<const char*>(view_.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

}  // namespace

Result<std::vector<std::string>> PyCommunicator::AllToAllBuffers(
    std::vector<std::string> payloads) {
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const std::string& p : payloads) {
    sizes.push_back(p.size());
    total += p.size();
  }
  return CallWithGil<std::vector<std::string>>("all_to_all_buffers", [&] {
    // An uninitialized bytearray, filled without the GIL: nothing else refers to it yet.
    nb::object send = nb::steal(PyByteArray_FromStringAndSize(nullptr, total));
    if (!send.is_valid()) throw nb::python_error();
    {
      nb::gil_scoped_release released;
      char* at = PyByteArray_AS_STRING(send.ptr());
      for (std::string& p : payloads) {
        std::copy(p.begin(), p.end(), at);
        at += p.size();
        std::string().swap(p);  // each payload's memory goes as soon as it is copied
      }
    }
    nb::list size_list;
    for (uint64_t n : sizes) size_list.append(n);
    nb::object reply = comm_.attr("all_to_all_buffers")(send, size_list);
    send.reset();
    nb::object recv;
    std::vector<int64_t> recv_sizes;
    if (!PyTuple_Check(reply.ptr()) || PyTuple_GET_SIZE(reply.ptr()) != 2 ||
        !nb::try_cast(nb::handle(PyTuple_GET_ITEM(reply.ptr(), 1)), recv_sizes)) {
      throw nb::type_error(("all_to_all_buffers returned a " +
                            std::string(nb::type_name(reply.type()).c_str()) +
                            ", expected a tuple (buffer, list of int)")
                               .c_str());
    }
    recv = nb::borrow(PyTuple_GET_ITEM(reply.ptr(), 0));
    HeldBuffer view;
    view.Take(recv, "all_to_all_buffers' received buffer");
    uint64_t sum = 0;
    bool negative = false;
    for (int64_t n : recv_sizes) {
      negative = negative || n < 0;
      sum += static_cast<uint64_t>(n);
    }
    if (static_cast<int>(recv_sizes.size()) != size_ || negative || sum != view.size()) {
      throw nb::value_error(("all_to_all_buffers returned " + std::to_string(recv_sizes.size()) +
                             " sizes adding up to " + std::to_string(sum) + " bytes and a " +
                             std::to_string(view.size()) +
                             "-byte buffer: expected one non-negative size per rank (" +
                             std::to_string(size_) + ") adding up to the buffer's length")
                                .c_str());
    }
    std::vector<std::string> out(recv_sizes.size());
    {
      // The view keeps the buffer alive and in place while the GIL is released.
      nb::gil_scoped_release released;
      const char* at = view.data();
      for (size_t r = 0; r < out.size(); ++r) {
        out[r].assign(at, recv_sizes[r]);
        at += recv_sizes[r];
      }
    }
    return out;
  });
}

bool PyCommunicator::spans_machines() const {
  if (!has_spans_machines_) return false;
  if (spans_machines_) return *spans_machines_;
  nb::gil_scoped_acquire gil;
  bool answer = false;
  try {
    nb::object value = comm_.attr("spans_machines")();
    if (!nb::try_cast(value, answer, /*convert=*/false)) {
      PyErr_Format(PyExc_TypeError, "comm.spans_machines() returned %s, expected a bool",
                   nb::type_name(value.type()).c_str());
      throw nb::python_error();
    }
  } catch (nb::python_error& e) {
    e.discard_as_unraisable("shardpoint communicator spans_machines()");
    answer = false;
  }
  spans_machines_ = answer;
  return answer;
}

std::vector<int> PyCommunicator::machine_ranks() {
  if (machine_ranks_) return *machine_ranks_;
  std::vector<int> answer = {rank_};
  nb::gil_scoped_acquire gil;
  if (nb::hasattr(comm_, "machine_ranks")) {
    try {
      nb::object value = comm_.attr("machine_ranks")();
      std::vector<int> ranks;
      if (!nb::try_cast(value, ranks, /*convert=*/false)) {
        PyErr_Format(PyExc_TypeError, "comm.machine_ranks() returned %s, expected a list of int",
                     nb::type_name(value.type()).c_str());
        throw nb::python_error();
      }
      const bool ascending = std::adjacent_find(ranks.begin(), ranks.end(),
                                                [](int a, int b) { return a >= b; }) == ranks.end();
      const bool in_range = !ranks.empty() && ranks.front() >= 0 && ranks.back() < size_;
      if (!ascending || !in_range || !std::binary_search(ranks.begin(), ranks.end(), rank_)) {
        PyErr_Format(PyExc_ValueError,
                     "comm.machine_ranks() returned %zu ranks: expected ascending ranks below %d "
                     "that include this rank (%d)",
                     ranks.size(), size_, rank_);
        throw nb::python_error();
      }
      answer = std::move(ranks);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("shardpoint communicator machine_ranks()");
    }
  }
  machine_ranks_ = answer;
  return answer;
}

std::unique_ptr<PyCommunicator> MaybeCommunicator(nb::handle comm) {
  if (comm.is_none()) return nullptr;
  return PyCommunicator::FromObject(comm);
}

}  // namespace sp::python
