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
        return block


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
