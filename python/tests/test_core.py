"""Tests of the extension module shardpoint._core: arrays crossing zero-copy, error mapping,
multi-rank collectives through a Python communicator, and AsyncSaver."""

import os
import threading

import numpy as np
import pytest

from shardpoint import _core

NUMPY_DTYPES = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
}


def random_array(dtype, shape, rng):
    """Random values covering the whole bit pattern of the dtype (NaNs included for floats)."""
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def whole(name, dtype, array):
    shape = tuple(array.shape)
    return (name, dtype, shape, [((0,) * len(shape), shape, array)])


class FakeGroup:
    """ranks of one process exchanging bytes through shared slots; one thread per rank."""

    def __init__(self, size):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)
        self.calling_threads = set()
        self.lock = threading.Lock()

    def comm(self, rank):
        return FakeComm(self, rank)


class FakeComm:
    def __init__(self, group, rank):
        self.group = group
        self.rank = rank
        self.size = group.size

    def _exchange(self, value):
        g = self.group
        with g.lock:
            g.calling_threads.add(threading.get_ident())
        g.slots[self.rank] = value
        g.barrier.wait()
        values = list(g.slots)
        g.barrier.wait()
        return values

    def gather(self, data, root):
        values = self._exchange(bytes(data))
        return values if self.rank == root else None

    def scatter(self, chunks, root):
        return self._exchange(chunks)[root][self.rank]

    def broadcast(self, data, root):
        return self._exchange(data)[root]

    def all_gather(self, data):
        return self._exchange(bytes(data))

    def barrier(self):
        self._exchange(None)


class FailingComm(FakeComm):
    """Raises on its first collective and breaks the group, as a dead process group would."""

    def _exchange(self, value):
        self.group.barrier.abort()
        raise RuntimeError("link down")


def run_ranks(size, body):
    """Runs body(rank) on `size` threads; returns each rank's result or raised exception."""
    results = [None] * size

    def run(rank):
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_numpy_round_trip_of_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {name: random_array(dt, (7, 5), rng) for name, dt in NUMPY_DTYPES.items()}
    path = str(tmp_path / "ckpt")
    _core.save(path, [whole("t." + n, n, a) for n, a in arrays.items()], [])
    outs = {n: np.zeros_like(a) for n, a in arrays.items()}
    missing, unexpected, objects, bytes_read, _, _ = _core.load(
        path, [whole("t." + n, n, o) for n, o in outs.items()], [])
    assert (missing, unexpected, objects) == ([], [], [])
    assert bytes_read == sum(a.nbytes for a in arrays.values())
    for n in arrays:
        assert outs[n].tobytes() == arrays[n].tobytes(), n
    md = _core.read_metadata(path)
    assert {t.name: t.dtype for t in md.tensors} == {"t." + n: n for n in arrays}


def test_pieces_reshard_and_objects(tmp_path):
    rng = np.random.default_rng(1)
    full = random_array(np.float32, (6, 10), rng)
    path = str(tmp_path / "ckpt")
    saved = [((0, 0), (4, 10), np.ascontiguousarray(full[:4])),
             ((4, 0), (2, 10), np.ascontiguousarray(full[4:]))]
    _core.save(path, [("w", "float32", (6, 10), saved)],
               [("cfg", "json", b'{"lr": 0.1}'), ("blob", "bytes", b"\x00\x01")],
               _core.SaveOptions(attributes={"step": "12"}))
    left = np.zeros((6, 3), np.float32)
    right = np.zeros((6, 7), np.float32)
    missing, unexpected, objects, *_ = _core.load(
        path, [("w", "float32", (6, 10), [((0, 0), (6, 3), left), ((0, 3), (6, 7), right)])],
        ["cfg", "absent"], _core.LoadOptions(strict=False))
    assert np.concatenate([left, right], axis=1).tobytes() == full.tobytes()
    assert missing == ["absent"]
    assert objects == [("cfg", "json", b'{"lr": 0.1}')]
    md = _core.read_metadata(path)
    assert md.version == "4.0" and md.world_size == 1
    assert md.attributes == {"step": "12"}
    assert md.tensor("w").shape == (6, 10)
    assert sorted((c.offsets, c.sizes) for c in md.tensor("w").chunks) == [((0, 0), (4, 10)), ((4, 0), (2, 10))]
    assert {o.name: {"encoding": o.encoding, "bytes": o.nbytes} for o in md.objects} == {
        "blob": {"encoding": "bytes", "bytes": 2}, "cfg": {"encoding": "json", "bytes": 11}}
    assert md.total_bytes == full.nbytes
    assert _core.read_objects(path, ["blob", "nope"]) == [("blob", "bytes", b"\x00\x01")]
    report = _core.verify(path)
    assert report.ok and report.defects == [] and report.bytes_checked == full.nbytes


def test_torch_low_precision_round_trip_via_dlpack(tmp_path):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bfloat16": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
        "float8_e4m3fn": torch.randn(9, 4, generator=gen).to(torch.float8_e4m3fn),
        "float8_e5m2": torch.randn(9, 4, generator=gen).to(torch.float8_e5m2),
        "complex64": torch.randn(9, 4, dtype=torch.complex64, generator=gen),
        "bool": torch.randn(9, 4, generator=gen) > 0,
    }
    path = str(tmp_path / "ckpt")
    _core.save(path, [whole(n, n, t) for n, t in tensors.items()], [])
    outs = {n: torch.zeros_like(t) for n, t in tensors.items()}
    _core.load(path, [whole(n, n, o) for n, o in outs.items()], [])
    for n, t in tensors.items():
        assert torch.equal(outs[n].view(torch.uint8), t.view(torch.uint8)), n
    # The binding reads bytes, not the array's dtype: a uint8 view of bf16 loads as bf16.
    as_bytes = torch.zeros(9, 8, dtype=torch.uint8)
    _core.load(path, [("bfloat16", "bfloat16", (9, 4), [((0, 0), (9, 4), as_bytes)])], [],
               _core.LoadOptions(strict=False))
    assert torch.equal(as_bytes.view(torch.bfloat16), tensors["bfloat16"])


def test_status_errors_carry_the_code(tmp_path):
    with pytest.raises(_core.StatusError) as info:
        _core.read_metadata(str(tmp_path / "nothing"))
    assert info.value.code == "NOT_FOUND"
    assert str(info.value) == info.value.message
    assert "nothing" in info.value.message
    assert isinstance(info.value, Exception)

    path = str(tmp_path / "ckpt")
    a = np.arange(4096, dtype=np.int32)
    _core.save(path, [whole("a", "int32", a)], [])
    with pytest.raises(_core.StatusError) as info:
        _core.save(path, [whole("a", "int32", a)], [])
    assert info.value.code == "ALREADY_EXISTS"
    _core.save(path, [whole("a", "int32", a + 1)], [], _core.SaveOptions(overwrite=True))

    with pytest.raises(_core.StatusError) as info:
        _core.load(path, [whole("a", "float32", np.zeros(4096, np.float32))], [])
    assert info.value.code == "INVALID_ARGUMENT" and "'a'" in info.value.message

    data_file = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, data_file), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    with pytest.raises(_core.StatusError) as info:
        _core.load(path, [whole("a", "int32", np.zeros(4096, np.int32))], [])
    assert info.value.code == "DATA_LOSS"
    assert data_file in info.value.message
    report = _core.verify(path)
    assert not report.ok and any(data_file in d for d in report.defects)


def test_bad_arrays_raise_value_error(tmp_path):
    path = str(tmp_path / "ckpt")
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"tensor 'w' piece \[0:4, 0:4\]: the array holds 32 "
                                         r"bytes, expected 64"):
        _core.save(path, [("w", "float32", (4, 4), [((0, 0), (4, 4), a[:2])])], [])
    with pytest.raises(ValueError, match="not C-contiguous"):
        _core.save(path, [("w", "float32", (4, 2), [((0, 0), (4, 2), a[:, ::2])])], [])
    with pytest.raises(ValueError, match="unknown dtype"):
        _core.save(path, [("w", "float33", (4, 4), [((0, 0), (4, 4), a)])], [])
    with pytest.raises(ValueError, match="DLPack or the buffer protocol, found list"):
        _core.save(path, [("w", "float32", (2,), [((0,), (2,), [1.0, 2.0])])], [])
    with pytest.raises(ValueError, match="unknown encoding 'yaml'"):
        _core.save(path, [], [("o", "yaml", b"x")])
    with pytest.raises(TypeError, match="expected a tuple of 3 items"):
        _core.save(path, [("w", "float32", (4, 4), [((0, 0), (4, 4))])], [])
    _core.save(path, [whole("w", "float32", a)], [])
    frozen = np.zeros((4, 4), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _core.load(path, [whole("w", "float32", frozen)], [])


def test_multi_rank_save_and_resharded_load_through_a_python_comm(tmp_path):
    rng = np.random.default_rng(2)
    full = random_array(np.float64, (8, 6), rng)
    path = str(tmp_path / "ckpt")
    group = FakeGroup(4)

    def save(rank):
        rows = slice(2 * rank, 2 * rank + 2)
        piece = ((2 * rank, 0), (2, 6), np.ascontiguousarray(full[rows]))
        replicated = np.arange(3, dtype=np.int64)
        _core.save(path, [("w", "float64", (8, 6), [piece]), whole("r", "int64", replicated)],
                   [("step", "json", b"5")], _core.SaveOptions(comm=group.comm(rank), threads=2))

    assert run_ranks(4, save) == [None] * 4
    assert _core.read_metadata(path).world_size == 4

    load_group = FakeGroup(2)

    def load(rank):
        out = np.zeros((8, 3), np.float64)
        result = _core.load(path, [("w", "float64", (8, 6), [((0, 3 * rank), (8, 3), out)])],
                            ["step"], _core.LoadOptions(comm=load_group.comm(rank), strict=False))
        return out, result

    results = run_ranks(2, load)
    for rank, (out, (missing, unexpected, objects, *_)) in enumerate(results):
        assert out.tobytes() == full[:, 3 * rank:3 * rank + 3].tobytes()
        assert unexpected == ["r"] and missing == [] and objects == [("step", "json", b"5")]


def test_communicator_exception_fails_every_rank(tmp_path):
    group = FakeGroup(3)
    path = str(tmp_path / "ckpt")

    def save(rank):
        comm = FailingComm(group, rank) if rank == 1 else group.comm(rank)
        _core.save(path, [whole("x%d" % rank, "int8", np.ones(4, np.int8))], [], _core.SaveOptions(comm=comm))

    errors = run_ranks(3, save)
    for e in errors:
        assert isinstance(e, _core.StatusError) and e.code == "UNAVAILABLE", e
        assert e.message.startswith("communicator ") and " failed: " in e.message
    assert "RuntimeError: link down" in errors[1].message
    with pytest.raises(_core.StatusError, match="no committed checkpoint"):
        _core.read_metadata(path)


def test_comm_object_is_checked():
    class NoMethods:
        rank = 0
        size = 1

    with pytest.raises(TypeError, match="no method 'gather'"):
        _core.save("/nonexistent/x", [], [], _core.SaveOptions(comm=NoMethods()))

    class BadRank(FakeComm):
        pass

    with pytest.raises(ValueError, match="rank 3 and size 2"):
        _core.save("/nonexistent/x", [], [], _core.SaveOptions(comm=BadRank(FakeGroup(2), 3)))


def test_async_saver_holds_values_from_start(tmp_path):
    rng = np.random.default_rng(3)
    a = random_array(np.float32, (256, 128), rng)
    b = random_array(np.uint8, (1000,), rng)
    original = (a.copy(), b.copy())
    saver = _core.AsyncSaver()
    path = str(tmp_path / "ckpt")
    saver.start(path, [whole("a", "float32", a), whole("b", "uint8", b)], [("o", "json", b"1")])
    a[:] = 0
    b[:] = 7
    saver.wait()
    assert saver.done()
    saver.wait()  # nothing running: returns
    outs = (np.zeros_like(a), np.zeros_like(b))
    _core.load(path, [whole("a", "float32", outs[0]), whole("b", "uint8", outs[1])], ["o"])
    assert outs[0].tobytes() == original[0].tobytes()
    assert outs[1].tobytes() == original[1].tobytes()

    capacity = saver.staging_bytes
    assert capacity >= a.nbytes + b.nbytes
    saver.start(path, [whole("a", "float32", a), whole("b", "uint8", b)], [], _core.SaveOptions(overwrite=True))
    saver.wait()
    assert saver.staging_bytes == capacity


def test_async_saver_errors(tmp_path):
    path = str(tmp_path / "ckpt")
    a = np.ones(1024, np.float32)
    _core.save(path, [whole("a", "float32", a)], [])
    saver = _core.AsyncSaver()
    saver.start(path, [whole("a", "float32", a)], [])  # overwrite=False: fails in the background
    with pytest.raises(_core.StatusError) as info:
        saver.wait()
    assert info.value.code == "ALREADY_EXISTS"

    small = _core.AsyncSaver(staging_budget_bytes=1000)
    with pytest.raises(_core.StatusError) as info:
        small.start(str(tmp_path / "other"), [whole("a", "float32", a)], [])
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "needs 4096 bytes" in info.value.message and "budget of 1000 bytes" in info.value.message
    assert small.done()


def test_async_saver_uses_the_python_comm_from_its_background_thread(tmp_path):
    rng = np.random.default_rng(4)
    full = random_array(np.int32, (4, 50), rng)
    path = str(tmp_path / "ckpt")
    group = FakeGroup(2)
    rank_threads = set()

    def save(rank):
        rank_threads.add(threading.get_ident())
        piece = full[2 * rank:2 * rank + 2].copy()
        saver = _core.AsyncSaver()
        saver.start(path, [("w", "int32", (4, 50), [((2 * rank, 0), (2, 50), piece)])], [],
                    _core.SaveOptions(comm=group.comm(rank)))
        piece[:] = -1
        saver.wait()
        return saver.done()

    assert run_ranks(2, save) == [True, True]
    # Start's agreement ran on the rank threads; the save's collectives on the saver's threads.
    assert group.calling_threads - rank_threads
    out = np.zeros_like(full)
    _core.load(path, [whole("w", "int32", out)], [])
    assert out.tobytes() == full.tobytes()


def test_async_save_failure_surfaces_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    _core.save(path, [whole("w", "int8", np.ones(8, np.int8))], [])
    group = FakeGroup(2)

    def save(rank):
        saver = _core.AsyncSaver()
        saver.start(path, [("w", "int8", (8,), [((4 * rank,), (4,), np.ones(4, np.int8))])], [],
                    _core.SaveOptions(comm=group.comm(rank)))
        saver.wait()

    errors = run_ranks(2, save)
    for e in errors:
        assert isinstance(e, _core.StatusError) and e.code == "ALREADY_EXISTS", e
    assert errors[0].message == errors[1].message
