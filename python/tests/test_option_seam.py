"""The seam between the Python package and the core: option objects whose defaults are the C++
structs' (and which the Python front leaves alone), the communicator's spans_machines() deciding
load's shared reads, and read-only metadata objects."""

import gc
import sys

import numpy as np
import pytest

import shardpoint as sp
from shardpoint import _core, _dist
from test_core import FakeComm, FakeGroup, run_ranks, whole

LOAD_FIELDS = ("strict", "allow_cast", "threads", "verify_checksums", "memory_budget_bytes", "share_reads",
               "allow_external_links", "direct_io", "direct_io_min_bytes", "io_depth", "machine_read_gate")
SAVE_FIELDS = ("overwrite", "threads", "files_per_rank", "dedup_to_lowest_rank", "format", "separate_key_prefixes",
               "direct_io", "direct_io_min_bytes")
CONSOLIDATE_FIELDS = ("format", "max_shard_bytes", "dtype", "keys", "prefixes", "all_tensors", "rename", "overwrite",
                      "threads", "memory_budget_bytes", "placements", "mapped_renames", "allow_external_links")


def fields(options, names):
    return {name: getattr(options, name) for name in names}


def test_keywords_set_fields_and_the_rest_keep_the_struct_defaults():
    defaults = fields(_core.LoadOptions(), LOAD_FIELDS)
    options = _core.LoadOptions(strict=False, share_reads=True, threads=3)
    assert fields(options, LOAD_FIELDS) == {**defaults, "strict": False, "share_reads": True, "threads": 3}
    assert defaults["share_reads"] is None  # unset: the communicator decides (checkpoint.h)
    save = _core.SaveOptions(format="megatron", attributes={"step": "7"})
    assert (save.format, save.attributes, save.threads) == ("megatron", {"step": "7"}, _core.SaveOptions().threads)
    consolidate = _core.ConsolidateOptions(dtype="bf16", rename=[("a.", "b.")])
    assert (consolidate.dtype, consolidate.rename) == ("bfloat16", [("a.", "b.")])
    assert consolidate.max_shard_bytes == _core.ConsolidateOptions().max_shard_bytes
    # The defaults the documentation states, read through the core's own size parser.
    assert _core.ConsolidateOptions().max_shard_bytes == _core.parse_byte_size("5GB")
    assert _core.ConsolidateOptions().memory_budget_bytes == _core.parse_byte_size("256MiB")
    assert _core.LoadOptions().memory_budget_bytes == _core.parse_byte_size("256MiB")
    assert _core.SaveOptions().format == "native" and _core.ConsolidateOptions().format == "safetensors"
    assert _core.LoadOptions().direct_io is None  # chosen per file
    assert _core.LoadOptions().direct_io_min_bytes == _core.parse_byte_size("1MiB")
    assert _core.LoadOptions().io_depth == 0  # tuned
    assert _core.LoadOptions().machine_read_gate is True


def test_bad_keywords_are_refused_by_name():
    with pytest.raises(TypeError, match=r"^shardpoint._core.LoadOptions\(\) got an unexpected keyword argument "
                                        r"'share_read'$"):
        _core.LoadOptions(share_read=True)
    with pytest.raises(TypeError, match=r"^shardpoint._core.SaveOptions keyword 'threads' does not take a str: "):
        _core.SaveOptions(threads="4")
    with pytest.raises(ValueError, match=r"^unknown checkpoint format 'dcp' \(expected native, torch-dcp or "
                                         r"safetensors\)$"):
        _core.SaveOptions(format="dcp")
    with pytest.raises(ValueError, match=r"^format must be 'safetensors' or 'torch', not 'onnx'$"):
        _core.ConsolidateOptions(format="onnx")


def _spy(monkeypatch, name):
    """Replaces _core.<name> by a wrapper that records the options object of each call."""
    calls = []
    real = getattr(_core, name)

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(_core, name, spy)
    return calls


def test_the_python_front_leaves_the_core_defaults(tmp_path, monkeypatch):
    saves, loads, consolidations = (_spy(monkeypatch, n) for n in ("save", "load", "consolidate"))
    weights = np.arange(24, dtype=np.float32).reshape(4, 6)
    path = tmp_path / "ckpt"
    sp.save({"w": weights}, path)
    out = {"w": np.zeros_like(weights)}
    sp.load(out, path)
    assert out["w"].tobytes() == weights.tobytes()
    assert sp.load_full(path)["w"].numpy().tobytes() == weights.tobytes()
    result = sp.consolidate(path, tmp_path / "hf")
    assert result.files == ["model.safetensors"]

    assert [fields(s, SAVE_FIELDS) for s in saves] == [fields(_core.SaveOptions(), SAVE_FIELDS)]
    assert [fields(o, LOAD_FIELDS) for o in loads] == [fields(_core.LoadOptions(), LOAD_FIELDS)] * 2
    assert [fields(c, CONSOLIDATE_FIELDS) for c in consolidations] == [
        fields(_core.ConsolidateOptions(), CONSOLIDATE_FIELDS)]


def test_the_python_front_passes_what_the_caller_gives(tmp_path, monkeypatch):
    loads, consolidations = _spy(monkeypatch, "load"), _spy(monkeypatch, "consolidate")
    weights = np.arange(10, dtype=np.float64)
    path = tmp_path / "ckpt"
    sp.save({"w": weights}, path)
    sp.load({"w": np.zeros(10, np.float32)}, path, cast=True, share_reads=False, threads=2, direct_io=True,
            io_depth=3, machine_read_gate=False)
    sp.consolidate(path, tmp_path / "hf", max_shard_size="2KB", memory_budget=4096, threads=3, dtype="bf16")
    assert fields(loads[0], ("allow_cast", "share_reads", "threads", "direct_io", "io_depth",
                             "machine_read_gate")) == {
        "allow_cast": True, "share_reads": False, "threads": 2, "direct_io": True, "io_depth": 3,
        "machine_read_gate": False}
    assert fields(consolidations[0], ("max_shard_bytes", "memory_budget_bytes", "threads", "dtype")) == {
        "max_shard_bytes": 2000, "memory_budget_bytes": 4096, "threads": 3, "dtype": "bfloat16"}


def test_direct_io_loads_are_bit_exact(tmp_path):
    # 3 MiB in one chunk and a small one: the large read bypasses the page cache where the file
    # system allows it (else it is an ordinary read), the small one never does.
    rng = np.random.default_rng(9)
    state = {"big": rng.standard_normal((1000, 393)), "small": rng.integers(0, 1 << 30, 77, dtype=np.int64)}
    path = tmp_path / "ckpt"
    sp.save(state, path)
    out = {k: np.zeros_like(v) for k, v in state.items()}
    result = sp.load(out, path, direct_io=True)
    assert all(out[k].tobytes() == state[k].tobytes() for k in state)
    assert result.bytes_read >= state["big"].nbytes + state["small"].nbytes


def test_direct_io_none_chooses_per_file_and_is_bit_exact(tmp_path, monkeypatch):
    # None reaches the engine unset (it reads the files that are not in the page cache directly).
    loads = _spy(monkeypatch, "load")
    rng = np.random.default_rng(11)
    state = {"big": rng.standard_normal((1000, 393)), "small": rng.integers(0, 1 << 30, 77, dtype=np.int64)}
    path = tmp_path / "ckpt"
    sp.save(state, path)
    out = {k: np.zeros_like(v) for k, v in state.items()}
    sp.load(out, path)  # the default
    sp.load(out, path, direct_io=False)
    assert loads[0].direct_io is None and loads[1].direct_io is False
    assert all(out[k].tobytes() == state[k].tobytes() for k in state)
    options = _core.LoadOptions(direct_io=False)
    assert options.direct_io is False
    options.direct_io = True
    assert options.direct_io is True


def test_direct_io_saves_are_bit_exact_and_pass_the_option(tmp_path, monkeypatch):
    saves = _spy(monkeypatch, "save")
    rng = np.random.default_rng(10)
    state = {"big": rng.standard_normal((1000, 393)), "small": rng.integers(0, 1 << 30, 77, dtype=np.int64)}
    path = tmp_path / "ckpt"
    sp.save(state, path, direct_io=True)
    assert saves[0].direct_io is True
    assert sp.verify(path).ok
    out = {k: np.zeros_like(v) for k, v in state.items()}
    sp.load(out, path)
    assert all(out[k].tobytes() == state[k].tobytes() for k in state)
    handle = sp.async_save(state, tmp_path / "async", direct_io=True)
    handle.wait()
    out = {k: np.zeros_like(v) for k, v in state.items()}
    sp.load(out, tmp_path / "async")
    assert all(out[k].tobytes() == state[k].tobytes() for k in state)


class MachineComm(FakeComm):
    """A FakeComm that says whether its group spans machines, and counts the questions."""

    def __init__(self, group, rank, answer):
        super().__init__(group, rank)
        self.answer = answer
        self.asked = 0

    def spans_machines(self):
        self.asked += 1
        if self.answer is RuntimeError:
            raise RuntimeError("no hosts")
        return self.answer


@pytest.fixture(scope="module")
def one_chunk(tmp_path_factory):
    """A checkpoint of one (64, 32) float64 tensor stored as one chunk."""
    full = np.random.default_rng(5).standard_normal((64, 32))
    path = str(tmp_path_factory.mktemp("seam") / "ckpt")
    _core.save(path, [whole("w", "float64", full)], [])
    return path, full


def _load_whole_on_two_ranks(comms, path, full, **load_options):
    """Both ranks load the whole tensor through ``comms``; returns each rank's _core.load result."""

    def load(rank):
        out = np.zeros_like(full)
        options = _core.LoadOptions(comm=comms[rank], **load_options)
        result = _core.load(path, [whole("w", "float64", out)], [], options)
        assert out.tobytes() == full.tobytes()
        return result

    return run_ranks(2, load)


def _load_on_two_ranks(path, full, answer, **load_options):
    """Both ranks load the whole tensor; returns (bytes each rank read, questions each comm got)."""
    group = FakeGroup(2)
    comms = [MachineComm(group, rank, answer) for rank in range(2)]
    results = _load_whole_on_two_ranks(comms, path, full, **load_options)
    return [bytes_read for _, _, _, bytes_read, *_ in results], [c.asked for c in comms]


def test_spans_machines_decides_shared_reads(one_chunk):
    path, full = one_chunk
    read, asked = _load_on_two_ranks(path, full, True)
    assert sum(read) == full.nbytes and asked == [1, 1]  # one rank read the chunk and sent it
    read, asked = _load_on_two_ranks(path, full, False)
    assert read == [full.nbytes, full.nbytes] and asked == [1, 1]


def test_explicit_share_reads_wins_over_spans_machines(one_chunk):
    path, full = one_chunk
    read, _ = _load_on_two_ranks(path, full, True, share_reads=False)
    assert read == [full.nbytes, full.nbytes]
    read, _ = _load_on_two_ranks(path, full, False, share_reads=True)
    assert sum(read) == full.nbytes


def test_spans_machines_that_fails_counts_as_one_machine(one_chunk, monkeypatch):
    path, full = one_chunk
    reported = []
    # Only the messages are kept: the exceptions' tracebacks hold the rank threads' frames.
    monkeypatch.setattr(sys, "unraisablehook", lambda report: reported.append(str(report.exc_value)))
    read, asked = _load_on_two_ranks(path, full, RuntimeError)
    assert read == [full.nbytes, full.nbytes] and asked == [1, 1]
    assert reported == ["no hosts", "no hosts"]
    reported.clear()
    read, _ = _load_on_two_ranks(path, full, "yes")
    assert read == [full.nbytes, full.nbytes]
    assert reported == ["comm.spans_machines() returned str, expected a bool"] * 2


def test_torch_comm_spans_machines_compares_host_names(monkeypatch):
    comm = object.__new__(_dist.TorchComm)
    monkeypatch.setattr(_dist, "_hosts", lambda c: [b"node-a", b"node-a"])
    assert comm.spans_machines() is False
    monkeypatch.setattr(_dist, "_hosts", lambda c: [b"node-a", b"node-b"])
    assert comm.spans_machines() is True


class FlagComm(FakeComm):
    """A FakeComm with any_rank (answering ``answer`` when it is set), counting its collectives."""

    def __init__(self, group, rank, answer=None):
        super().__init__(group, rank)
        self.answer = answer
        self.calls = []

    def any_rank(self, flag):
        self.calls.append("any_rank")
        flags = self._exchange(bool(flag))
        return any(flags) if self.answer is None else self.answer

    def all_gather(self, data):
        self.calls.append("all_gather")
        return super().all_gather(data)


def _save_and_load_on_two_ranks(tmp_path, comms, fail_rank=None):
    """Both ranks save a row each of a (2, 8) tensor, then load it whole; rank ``fail_rank``
    loads with a dtype the checkpoint does not have. Returns each rank's result or exception."""
    full = np.arange(16, dtype=np.float32).reshape(2, 8)
    path = str(tmp_path / "flags")

    def run(rank):
        _core.save(path, [("w", "float32", (2, 8), [((rank, 0), (1, 8), full[rank:rank + 1].copy())])], [],
                   _core.SaveOptions(comm=comms[rank], overwrite=True))
        out = np.zeros((2, 8), np.float64 if rank == fail_rank else np.float32)
        _core.load(path, [whole("w", out.dtype.name, out)], [], _core.LoadOptions(comm=comms[rank], share_reads=False))
        assert out.tobytes() == full.tobytes()
        return True

    return run_ranks(2, run)


def test_any_rank_agrees_without_gathering_every_rank_s_status(tmp_path):
    group = FakeGroup(2)
    comms = [FlagComm(group, rank) for rank in range(2)]
    assert _save_and_load_on_two_ranks(tmp_path, comms) == [True, True]
    for comm in comms:  # the save's commit and the load's outcome are flags; nothing is all-gathered
        assert "any_rank" in comm.calls and "all_gather" not in comm.calls, comm.calls
    # A rank that fails: the flags say so, and its error reaches both ranks through an all-gather.
    group = FakeGroup(2)
    comms = [FlagComm(group, rank) for rank in range(2)]
    results = _save_and_load_on_two_ranks(tmp_path, comms, fail_rank=1)
    for e in results:
        assert isinstance(e, _core.StatusError) and e.message.startswith("rank 1: "), e
        assert "float64" in e.message and "float32" in e.message, e.message
    assert all("all_gather" in comm.calls for comm in comms)


def test_any_rank_reply_is_checked(tmp_path):
    group = FakeGroup(2)
    comms = [FlagComm(group, rank, answer="no") for rank in range(2)]
    for e in _save_and_load_on_two_ranks(tmp_path, comms):
        assert isinstance(e, _core.StatusError) and e.code == "UNAVAILABLE", e
        assert e.message == "communicator any_rank failed: any_rank returned str, expected a bool", e.message


class BuffersComm(FakeComm):
    """A FakeComm with all_to_all (which must not be called) and all_to_all_buffers, whose reply
    ``bad(recv, sizes)`` may spoil; counts the calls."""

    def __init__(self, group, rank, bad=None):
        super().__init__(group, rank)
        self.bad = bad
        self.calls = 0

    def all_to_all(self, chunks):
        raise AssertionError("all_to_all called although all_to_all_buffers exists")

    def all_to_all_buffers(self, send, sizes):
        self.calls += 1
        assert isinstance(send, bytearray) and len(send) == sum(sizes) and len(sizes) == self.size
        chunks, at = [], 0
        for n in sizes:
            chunks.append(bytes(send[at:at + n]))
            at += n
        mine = [sent[self.rank] for sent in self._exchange(chunks)]
        recv, recv_sizes = np.frombuffer(b"".join(mine), dtype=np.uint8), [len(m) for m in mine]
        return (recv, recv_sizes) if self.bad is None else self.bad(recv, recv_sizes)


class PeersComm(BuffersComm):
    """A BuffersComm with exchange_with_peers too, whose reply ``bad(received)`` may spoil; counts
    its calls apart."""

    def __init__(self, group, rank, bad=None):
        super().__init__(group, rank)
        self.bad_peers = bad
        self.peer_calls = 0

    def exchange_with_peers(self, sends, sources):
        self.peer_calls += 1
        outgoing = [b""] * self.size
        for q, data in sends:
            outgoing[q] = data
        everyone = self._exchange(outgoing)
        received = [everyone[s][self.rank] for s in sources]
        return received if self.bad_peers is None else self.bad_peers(received)


def _load_columns_shared(path, full, bad=None, comm_type=None):
    """Two ranks load the column halves of ``full`` with shared reads through BuffersComm (or
    ``comm_type``)."""
    group = FakeGroup(2)
    comms = [(comm_type or BuffersComm)(group, rank, bad) for rank in range(2)]
    half = full.shape[1] // 2

    def load(rank):
        out = np.zeros((full.shape[0], half), dtype=full.dtype)
        piece = ((0, rank * half), out.shape, out)
        options = _core.LoadOptions(comm=comms[rank], share_reads=True)
        result = _core.load(path, [("w", "float64", full.shape, [piece])], [], options)
        assert out.tobytes() == np.ascontiguousarray(full[:, rank * half:(rank + 1) * half]).tobytes()
        return result

    return run_ranks(2, load), comms


def test_all_to_all_buffers_carries_the_shared_reads(one_chunk):
    path, full = one_chunk
    results, comms = _load_columns_shared(path, full)
    # One rank read the one stored chunk and sent the other its columns in one buffer.
    assert sum(bytes_read for _, _, _, bytes_read, *_ in results) == full.nbytes
    assert all(c.calls >= 1 for c in comms)


def test_exchange_with_peers_carries_the_shared_reads_instead_of_an_all_to_all(one_chunk):
    path, full = one_chunk
    results, comms = _load_columns_shared(path, full, comm_type=PeersComm)
    assert sum(bytes_read for _, _, _, bytes_read, *_ in results) == full.nbytes
    # Every round went point to point (one call per round on each rank, the same count), and no
    # all-to-all ran.
    assert [c.calls for c in comms] == [0, 0]
    assert comms[0].peer_calls >= 1 and comms[0].peer_calls == comms[1].peer_calls


@pytest.mark.parametrize("bad, message", [
    (lambda received: received + [b"x"], "exchange_with_peers returned 2 payloads, expected one per source (1)"),
    (lambda received: None, "exchange_with_peers returned None, expected a list of 1 bytes objects"),
])
def test_exchange_with_peers_reply_is_checked(one_chunk, bad, message):
    """One rank reads the chunk and sends the other its columns: the receiver checks the reply,
    and both ranks end with its error."""
    path, full = one_chunk
    results, _ = _load_columns_shared(path, full, bad, comm_type=PeersComm)
    messages = [e.message for e in results if isinstance(e, _core.StatusError)]
    assert any(m.endswith("communicator exchange_with_peers failed: " + message) for m in messages), \
        messages


class CountingComm(BuffersComm):
    """A BuffersComm that counts its all-gathers, gathers and scatters too, answers
    machine_ranks() with ``machine``, and agrees through any_rank."""

    def __init__(self, group, rank, machine):
        super().__init__(group, rank)
        self.machine = machine
        self.gathers = 0
        self.rooted = 0

    def all_gather(self, data):
        self.gathers += 1
        return super().all_gather(data)

    def gather(self, data, root):
        self.rooted += 1
        return super().gather(data, root)

    def scatter(self, chunks, root):
        self.rooted += 1
        return super().scatter(chunks, root)

    def machine_ranks(self):
        return self.machine

    def any_rank(self, flag):
        return any(self._exchange(bool(flag)))


@pytest.mark.parametrize("machine, share", [([0, 1], None), (None, True)])
def test_a_load_that_shares_nothing_reads_its_own_without_exchanging(tmp_path, machine, share):
    """Two ranks load the row halves they saved: no stored chunk is needed by both, so after the
    ranks' needs are known no slot is mapped (processes of one machine) and no round is exchanged
    (ranks anywhere); a column split of the same checkpoint still exchanges."""
    full = np.random.default_rng(8).standard_normal((64, 32))
    path = str(tmp_path / "rows")
    group = FakeGroup(2)

    def save(rank):
        rows = np.ascontiguousarray(full[rank * 32:(rank + 1) * 32])
        _core.save(path, [("w", "float64", full.shape, [((rank * 32, 0), rows.shape, rows)])], [],
                   _core.SaveOptions(comm=group.comm(rank)))

    assert run_ranks(2, save) == [None, None]
    for split in (0, 1):
        group = FakeGroup(2)
        comms = [CountingComm(group, rank, machine or [rank]) for rank in range(2)]

        def load(rank):
            index = [slice(None), slice(None)]
            index[split] = slice(rank * 32 // (split + 1), (rank + 1) * 32 // (split + 1))
            out = np.zeros(full[tuple(index)].shape)
            offsets = (rank * 32, 0) if split == 0 else (0, rank * 16)
            options = _core.LoadOptions(comm=comms[rank], share_reads=share)
            result = _core.load(path, [("w", "float64", full.shape, [(offsets, out.shape, out)])], [], options)
            assert out.tobytes() == np.ascontiguousarray(full[tuple(index)]).tobytes()
            return result

        results = run_ranks(2, load)
        read = [bytes_read for _, _, _, bytes_read, *_ in results]
        if split == 0:
            assert read == [full.nbytes // 2] * 2, read
            # Each rank's boxes gathered to the coordinator and each rank's part of the metadata
            # scattered; the needs gathered to rank 0 and each rank's plan scattered; nothing
            # all-gathered: no slot sizes (one machine), no all-to-all (anywhere).
            assert [(c.rooted, c.gathers, c.calls) for c in comms] == [(4, 0, 0)] * 2
        else:
            assert sum(read) == full.nbytes, read  # each chunk read once, for both
            assert all(c.rooted == 4 and c.gathers + c.calls >= 1 for c in comms), \
                [(c.rooted, c.gathers, c.calls) for c in comms]


@pytest.mark.parametrize("bad, messages", [
    (lambda recv, sizes: (recv, sizes[:1]),
     ["all_to_all_buffers returned 1 sizes adding up to ",
      "-byte buffer: expected one non-negative size per rank (2) adding up to the buffer's length"]),
    (lambda recv, sizes: (recv, [-1, sum(sizes) + 1]),
     ["all_to_all_buffers returned 2 sizes", "expected one non-negative size per rank (2)"]),
    (lambda recv, sizes: (7, sizes),
     ["all_to_all_buffers' received buffer is a int, expected a C-contiguous object with the buffer protocol"]),
    (lambda recv, sizes: (np.zeros((3, recv.size + 2), dtype=np.uint8).T, sizes),
     ["all_to_all_buffers' received buffer is a ndarray, expected a C-contiguous object"]),
    (lambda recv, sizes: [recv, sizes],
     ["all_to_all_buffers returned a list, expected a tuple (buffer, list of int)"]),
])
def test_all_to_all_buffers_reply_is_checked(one_chunk, bad, messages):
    path, full = one_chunk
    results, _ = _load_columns_shared(path, full, bad)
    for e in results:
        assert isinstance(e, _core.StatusError) and e.code == "UNAVAILABLE", e
        assert e.message.startswith("communicator all_to_all_buffers failed: "), e.message
        assert all(m in e.message for m in messages), e.message


class ProcessesComm(FakeComm):
    """A FakeComm whose machine_ranks() gives ``answer`` (or raises it)."""

    def __init__(self, group, rank, answer):
        super().__init__(group, rank)
        self.answer = answer

    def machine_ranks(self):
        if self.answer is RuntimeError:
            raise RuntimeError("no hosts")
        return self.answer(self.rank) if callable(self.answer) else self.answer


def _gate_ranks_on_two_ranks(path, full, answer, **load_options):
    group = FakeGroup(2)
    comms = [ProcessesComm(group, rank, answer) for rank in range(2)]
    return [r[4] for r in _load_whole_on_two_ranks(comms, path, full, **load_options)]


def test_machine_ranks_puts_the_reads_of_a_machine_through_one_gate(one_chunk, monkeypatch):
    path, full = one_chunk
    # Each reading its own: one gate for the machine.
    assert _gate_ranks_on_two_ranks(path, full, [0, 1], share_reads=False) == [2, 2]
    assert _gate_ranks_on_two_ranks(path, full, [0, 1], share_reads=False, machine_read_gate=False) == [1, 1]
    assert _gate_ranks_on_two_ranks(path, full, [0, 1], share_reads=False, io_depth=1) == [1, 1]
    assert _gate_ranks_on_two_ranks(path, full, lambda rank: [rank], share_reads=False) == [1, 1]  # two machines
    # Sharing the chunk both need through shared memory (the default): one reader, own gates.
    assert _gate_ranks_on_two_ranks(path, full, [0, 1]) == [1, 1]
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda report: reported.append(str(report.exc_value)))
    # An answer that cannot be right is reported and taken as "this rank alone".
    assert _gate_ranks_on_two_ranks(path, full, RuntimeError) == [1, 1]
    assert reported == ["no hosts"] * 2
    reported.clear()
    assert _gate_ranks_on_two_ranks(path, full, "01") == [1, 1]
    assert reported == ["comm.machine_ranks() returned str, expected a list of int"] * 2
    reported.clear()
    assert _gate_ranks_on_two_ranks(path, full, [1, 0]) == [1, 1]
    assert sorted(reported) == [f"comm.machine_ranks() returned 2 ranks: expected ascending ranks below 2 "
                                f"that include this rank ({rank})" for rank in (0, 1)]


def test_torch_comm_machine_ranks_are_the_ranks_on_the_same_host(monkeypatch):
    comm = object.__new__(_dist.TorchComm)
    monkeypatch.setattr(_dist, "_hosts", lambda c: [b"node-a", b"node-b", b"node-a", b"node-b"])
    for rank, expected in [(0, [0, 2]), (1, [1, 3]), (2, [0, 2]), (3, [1, 3])]:
        monkeypatch.setattr(comm, "rank", rank, raising=False)
        assert comm.machine_ranks() == expected


def test_metadata_objects_are_read_only(tmp_path):
    path = str(tmp_path / "ckpt")
    _core.save(path, [whole("w", "int32", np.arange(6, dtype=np.int32))], [("cfg", "json", b"{}")],
               _core.SaveOptions(attributes={"step": "3"}))
    md = _core.read_metadata(path)
    tensor, obj, data_file = md.tensors[0], md.objects[0], md.files[0]
    chunk = tensor.chunks[0]
    for owner, name, value in [(md, "world_size", 2), (md, "save_id", "x"), (md, "attributes", {}),
                               (md, "tensors", []), (md, "version", "9.0"), (tensor, "shape", (7,)),
                               (tensor, "name", "v"), (tensor, "dtype", "int64"), (chunk, "sizes", (1,)),
                               (obj, "encoding", "bytes"), (data_file, "name", "x"), (data_file, "size", 0)]:
        with pytest.raises(AttributeError):
            setattr(owner, name, value)
        assert getattr(owner, name) != value, name
    with pytest.raises(AttributeError):
        md.extra = 1
    for cls in (_core.CheckpointMetadata, _core.TensorMetadata, _core.StoredChunk, _core.ObjectMetadata,
                _core.DataFile):
        with pytest.raises(TypeError, match="no constructor defined"):
            cls()
    md.tensors.clear()  # a fresh list: the metadata keeps its tensors
    md.attributes["step"] = "9"
    assert [t.name for t in md.tensors] == ["w"] and md.attributes == {"step": "3"}
    assert md.tensor("nope") is None and md.object("cfg").nbytes == 2
    del md
    gc.collect()
    # The views keep the metadata they come from alive.
    assert (tensor.name, tensor.dtype, tensor.shape, tensor.nbytes) == ("w", "int32", (6,), 24)
    assert (chunk.offsets, chunk.sizes, chunk.byte_length) == ((0,), (6,), 24)
    assert (obj.name, obj.encoding) == ("cfg", "json")


def test_verify_and_consolidate_results_are_read_only(tmp_path):
    path = str(tmp_path / "ckpt")
    values = np.arange(6, dtype=np.float32)
    _core.save(path, [whole("w", "float32", values)], [])
    report = _core.verify(path)
    assert (report.ok, report.defects, report.bytes_checked, report.has_checksums) == (True, [], 24, True)
    result = _core.consolidate(path, str(tmp_path / "hf"))
    assert (result.files, result.index_file, result.tensors, result.total_bytes) == (
        ["model.safetensors"], None, 1, 24)
    for owner, name in [(report, "ok"), (report, "defects"), (result, "files"), (result, "index_file"),
                        (result, "tensors")]:
        before = getattr(owner, name)
        with pytest.raises(AttributeError):
            setattr(owner, name, None)
        assert getattr(owner, name) == before
