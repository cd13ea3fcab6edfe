"""The batches of a load to the device with two core loads in flight (docs/GPU.md), driven on a
machine without a GPU: host tensors stand for device ones, and a stand-in for shardpoint._cuda
hands out the batches' halves and runs their copies at once. What is checked is what the device
path shares with it: the batching, two loads in flight on their own communicators, every rank
running as many batches as the rank with the most, errors of a late batch reaching every rank.
The copies themselves are checked on a GPU (test_cuda.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

import shardpoint as sp
from shardpoint import _api, _core


class FakeBatches:
    """shardpoint._cuda.LoadBatches without pinned memory: begin hands out no pool (host
    destinations take their own buffers), to_device runs the copies on the spot."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.begun: list[int] = []
        self.copied: list[int] = []
        self.finished = 0

    def start(self, devices: set, needs: list) -> None:
        self.begun, self.copied = [], []

    def begin(self, batch: int) -> None:
        self.begun.append(batch)
        return None

    def to_device(self, batch: int, copies: list[Callable[[], None]]) -> None:
        for copy in copies:
            copy()
        self.copied.append(batch)

    def finish(self) -> None:
        self.finished += 1


class FakeDevice:
    """The parts of shardpoint._cuda that a load uses."""

    DEFAULT_LOAD_STAGING = 2 << 30

    def __init__(self, lanes: int) -> None:
        self.LOAD_LANES = lanes
        self.batches = FakeBatches()

    def load_batches(self, budget: int) -> FakeBatches:
        return self.batches


class CoreLoads:
    """Wraps the core's load to count how many run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.calls = 0
        self.real = _core.load

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)
        try:
            return self.real(*args)
        finally:
            with self.lock:
                self.running -= 1


@contextlib.contextmanager
def device_batches(lanes: int) -> Iterator[tuple[FakeDevice, CoreLoads]]:
    """Loads inside run as loads to a device: every tensor destination counts as on device 0."""
    fake, loads = FakeDevice(lanes), CoreLoads()
    saved = (_api._device_module, _api._device_of, _core.load)
    _api._device_module = lambda: fake
    _api._device_of = lambda value: 0 if _api._local_tensor(value) is not None else None
    _core.load = loads
    try:
        yield fake, loads
    finally:
        _api._device_module, _api._device_of, _core.load = saved


def _state(seed: int, count: int, prefix: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}{k}": torch.randn(96 + k, 64, generator=g) for k in range(count)}


@pytest.mark.parametrize("lanes", [1, 2])
def test_one_process_loads_in_batches_with_two_in_flight(tmp_path, lanes):
    source = _state(1, 12, "l")
    source["tied"] = source["l0"]
    sp.save({**source, "step": 7}, tmp_path / "c")
    target = {k: torch.full_like(v, float("nan")) for k, v in source.items() if k != "tied"}
    target["tied"] = target["l0"]
    target["step"] = None
    target["absent"] = torch.zeros(3)
    with device_batches(lanes) as (fake, loads):
        # Two tensors of about 26 KB per half of 64 KB: 6 batches or more.
        result = sp.load(target, tmp_path / "c", staging_budget=128 << 10, strict=False)
    assert result.missing_keys == ["absent"] and result.unexpected_keys == []
    assert all(torch.equal(target[k], source[k]) for k in source)
    assert target["tied"] is target["l0"] and target["step"] == 7
    assert fake.batches.begun == fake.batches.copied == list(range(loads.calls)) and loads.calls >= 6
    assert fake.batches.finished == 1
    assert loads.most == lanes


def test_an_error_in_a_late_batch_is_raised_after_the_other_load_returned(tmp_path):
    source = _state(2, 10, "l")
    sp.save(source, tmp_path / "c")
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    target["l8"] = torch.zeros_like(source["l8"], dtype=torch.float16)
    with device_batches(2) as (fake, loads):
        with pytest.raises(sp.CheckpointArgumentError, match=r"tensor 'l8': checkpoint has dtype float32"):
            sp.load(target, tmp_path / "c", staging_budget=128 << 10)
    assert loads.running == 0 and fake.batches.finished == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("shardpoint-load-")]
    del target["l8"]
    with device_batches(2):
        sp.load(target, tmp_path / "c", staging_budget=128 << 10, strict=False)
    assert all(torch.equal(target[k], source[k]) for k in target)


def _lane_ranks(rank: int, world: int, path: str) -> list:
    """Each rank loads the other's tensors (a different number of batches on each), twice; then
    rank 1 asks for a wrong dtype in its last batch, which every rank must raise; then a load that
    works again on the same groups."""
    counts = [6 + 5 * r for r in range(world)]
    mine = _state(100 + rank, counts[rank], f"r{rank}.")
    shared = torch.arange(4096.0).reshape(64, 64)
    sp.save({**mine, "shared": shared}, path)
    other = (rank + 1) % world
    expect = _state(100 + other, counts[other], f"r{other}.")
    target: dict[str, Any] = {k: torch.full_like(v, float("nan")) for k, v in expect.items()}
    target["shared"] = torch.zeros(64, 64)
    out: list = []
    with device_batches(2) as (fake, loads):
        for _ in range(2):
            sp.load(target, path, staging_budget=128 << 10)
            out.append(all(torch.equal(target[k], expect[k]) for k in expect) and torch.equal(target["shared"], shared))
        out.append((loads.calls, loads.most))
        bad = dict(target)
        if rank == 1:
            bad[f"r{other}.{counts[other] - 1}"] = torch.zeros(96 + counts[other] - 1, 64, dtype=torch.float16)
        try:
            sp.load(bad, path, staging_budget=128 << 10)
            out.append("no error")
        except sp.CheckpointError as e:
            out.append(str(e))
        for v in target.values():
            v.zero_()
        sp.load(target, path, staging_budget=128 << 10)
        out.append(all(torch.equal(target[k], expect[k]) for k in expect) and torch.equal(target["shared"], shared))
    return out


def test_two_processes_load_with_two_batches_in_flight():
    import tempfile

    from distributed import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(2, _lane_ranks, f"{tmp}/c")
    for rank, out in enumerate(results):
        assert out[0] and out[1] and out[4], (rank, out)
        assert "tensor 'r0.5'" in out[3] and "float16" in out[3], (rank, out[3])
    # Both ranks ran as many core loads as the one with the most batches (rank 0: 11 tensors).
    assert results[0][2][0] == results[1][2][0] and results[0][2][1] == 2
