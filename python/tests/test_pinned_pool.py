"""The accounting of shardpoint._cuda.PinnedPool, which bounds the pinned memory of device saves and
loads (docs/GPU.md). Runs without a GPU: the blocks are plain host memory here (the page-locking
itself is exercised by test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from shardpoint import _api, _cuda


class HostPool(_cuda.PinnedPool):
    def __init__(self) -> None:
        super().__init__()
        self._blocks = []  # not the list the pool unregisters when it goes: nothing is registered

    def _new_block(self, size: int) -> torch.Tensor:
        block = torch.empty(size, dtype=torch.uint8)
        self._blocks.append(block)
        self.registered = getattr(self, "registered", 0) + 1
        return block

    def _drop_blocks(self) -> None:
        self._blocks.clear()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(_cuda, "_MIN_BLOCK", 4096)


def test_regions_are_aligned_and_disjoint():
    pool = HostPool()
    regions = [pool.take(n) for n in (10, 100, 1, 4000, 70)]
    spans = sorted((r.data_ptr(), r.data_ptr() + r.numel()) for r in regions)
    assert all(r.data_ptr() % _cuda._ALIGN == 0 for r in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert [r.numel() for r in regions] == [10, 100, 1, 4000, 70]


def test_an_operation_stays_within_its_limit():
    pool = HostPool()
    assert pool.take(600, 1000) is not None
    assert pool.capacity == 1000  # the block is cut to the limit
    assert pool.take(600, 1000) is None  # 640 + 600 > 1000
    assert pool.take(300, 1000) is not None  # at 640: ends at 940
    assert pool.take(100, 1000) is None  # at 960 (aligned): ends at 1060
    assert pool.take(5000, 1000) is None
    assert pool.capacity == 1000


def test_blocks_are_reused_and_a_smaller_limit_is_kept():
    pool = HostPool()
    pool.take(900, 1000)
    block = pool._blocks[0].data_ptr()
    pool.reset()
    region = pool.take(900, 1000)
    assert region.data_ptr() == block and pool.capacity == 1000  # reused, nothing allocated
    pool.reset()
    # An operation with a smaller limit does not use the room a larger one left in the pool.
    assert pool.take(900, 800) is None
    assert pool.take(700, 800) is not None
    assert pool.take(97, 800) is None  # at 704: would end at 801
    pool.reset()
    assert pool.take(60, 800) is not None and pool.take(60, 800) is not None


def test_passed_blocks_count_against_the_limit():
    pool = HostPool()
    pool.take(500, 500)  # block 1: 500 bytes
    pool.reset()
    # 600 bytes do not fit in block 1: it is passed over, and its 500 bytes count.
    assert pool.take(600, 1000) is None
    assert pool.capacity == 500
    pool.reset()
    assert pool.take(600, 1200) is not None  # 500 passed + a new block of at most 700
    assert pool.capacity <= 1200
    pool.reset()
    # Without a limit, blocks grow as needed.
    assert pool.take(10_000) is not None and pool.capacity >= 10_500


def test_device_batches_take_host_items_first_then_units_in_order_within_half_the_budget():
    # Units of device items with their bytes; a unit over the half makes a batch of its own.
    units = [(["a"], 60), (["b", "b_tied"], 50), (["c"], 300), (["d"], 10), (["e"], 95)]
    assert _api.device_batches(["host"], units, 100) == [["host", "a"], ["b", "b_tied"], ["c"], ["d"], ["e"]]
    assert _api.device_batches([], units, 120) == [["a", "b", "b_tied"], ["c"], ["d", "e"]]
    assert _api.device_batches(["h"], [], 100) == [["h"]]


def test_reserve_keeps_a_block_large_enough_and_replaces_a_smaller_pool_by_one_block():
    pool = HostPool()
    pool.take(100)
    pool.take(5000)  # a second block
    assert len(pool._blocks) == 2 and not pool.holds(6000)
    pool.reserve(6000)
    assert [b.numel() for b in pool._blocks] == [6000]
    first = pool._blocks[0].data_ptr()
    pool.reset()
    pool.reserve(4000)  # smaller: kept
    assert [b.numel() for b in pool._blocks] == [6000] and pool._blocks[0].data_ptr() == first
    regions = [pool.take(n) for n in (1000, 2999, 1900)]  # 1024 + 3008 + 1900 <= 6000
    assert len(pool._blocks) == 1
    assert all(first <= r.data_ptr() and r.data_ptr() + r.numel() <= first + 6000 for r in regions)


def _bench_like_sizes(per_tensor: int, tensors: int = 64) -> list[int]:
    """Byte sizes shaped like bench/gpu_bench.py's state: bf16 / fp32 rows of 4096 or 4000 columns,
    so that neighbouring tensors differ a little in size."""
    sizes = []
    for i in range(tensors):
        itemsize, cols = (2 if i % 2 == 0 else 4), (4096 if i % 5 else 4000)
        sizes.append(max(1, per_tensor // (cols * itemsize)) * cols * itemsize)
    return sizes


def _run_load(loads: _cuda.LoadBatches, sizes: list[int], half: int) -> None:
    """One load of tensors of ``sizes`` bytes through ``loads`` as _api._BatchLoad drives it (no
    device here: no copies, no events), checking that each batch's regions lie in its half's first
    block, disjoint."""
    units = [([i], _cuda.region_bytes(n)) for i, n in enumerate(sizes)]
    batches = _api.device_batches([], units, half)
    needs = [sum(_cuda.region_bytes(sizes[i]) for i in batch) for batch in batches]
    loads.start(set(), needs)
    try:
        for b, batch in enumerate(batches):
            pool = loads.begin(b)
            block = pool._blocks[0]
            spans = sorted((r.data_ptr(), r.data_ptr() + r.numel()) for r in (pool.take(sizes[i]) for i in batch))
            assert spans[0][0] >= block.data_ptr() and spans[-1][1] <= block.data_ptr() + block.numel()
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
            loads.to_device(b, [])
    finally:
        loads.finish()


@pytest.mark.parametrize("per_tensor_mib", [1, 16, 64])
def test_each_load_half_is_one_block_registered_once_within_its_budget(per_tensor_mib):
    # Tensors of slightly different sizes used to leave blocks too small for the next batch's
    # tensors: a half then registered new blocks in the middle of the load, past its budget (a
    # 32 GiB state of 512 MiB tensors held 2 GiB in a 1 GiB half).
    budget = 64 << 20
    half = budget // 2
    sizes = _bench_like_sizes(per_tensor_mib << 20)
    loads = _cuda.LoadBatches(budget)
    loads.pools = (HostPool(), HostPool())
    _run_load(loads, sizes, half)
    largest = max(_cuda.region_bytes(n) for n in sizes)
    for pool in loads.pools:
        assert pool.registered == 1 and len(pool._blocks) == 1
        assert pool.capacity <= max(half, largest)
    _run_load(loads, sizes, half)  # the next load of the same state registers nothing
    _run_load(loads, sizes[:7], half)  # nor does a smaller one
    assert [p.registered for p in loads.pools] == [1, 1]


def test_a_half_that_fails_to_register_in_the_background_fails_the_batch_that_needs_it():
    class Failing(HostPool):
        def _new_block(self, size: int) -> torch.Tensor:
            raise _cuda.error_for("RESOURCE_EXHAUSTED", f"cannot page-lock {size} bytes")

    loads = _cuda.LoadBatches(1 << 20)
    loads.pools = (HostPool(), Failing())
    loads.start(set(), [4096, 4096])
    assert loads.begin(0).take(4096) is not None
    with pytest.raises(Exception, match="cannot page-lock 4096 bytes"):
        loads.begin(1)
    loads.finish()
    # A load that fails in its first batch while half 1 is still being registered finishes quietly.
    loads.start(set(), [4096, 4096])
    loads.finish()


def test_the_stager_keeps_each_entrys_layout():
    # A DTensor's save entry carries its mesh rule as a fifth item (TensorPlan.layout); staging its
    # pieces must not drop it, nor break on it.
    layout = ((2,), ((1, 0, 1),), ())
    host = torch.arange(6, dtype=torch.uint8)
    stager = _cuda.Stager(HostPool(), 0, "block")
    stager.add(("w", "uint8", (12,), [((0,), (6,), host)], layout))
    stager.add(("b", "uint8", (6,), [((0,), (6,), host)]))
    assert stager.entries[0][4] == layout and len(stager.entries[1]) == 4
    assert stager.finish() is None  # nothing on a device: the entries go to the core as they are
