"""The background fill of device saves (shardpoint._cuda.Fill, docs/GPU.md) driven by the core
without a GPU: host tensors stand in for the device pieces. The core's I/O threads ask for byte
ranges of each piece as they write them; the ranges must cover every piece exactly, stay within one
write task, and the checkpoint must hold the source's bytes."""

from __future__ import annotations

import threading

import pytest
import torch

import shardpoint as sp
from shardpoint import _core, _cuda

_MIB = 1 << 20


def _entry(name: str, nbytes: int) -> tuple:
    return (name, "uint8", (nbytes,), [((0,), (nbytes,), None)])


@pytest.mark.parametrize("fmt", ["native", "torch-dcp"])
@pytest.mark.parametrize("budget", [1, 256 * _MIB])
def test_the_core_fills_byte_ranges_of_each_piece(tmp_path, fmt, budget):
    gen = torch.Generator().manual_seed(7)
    sizes = {"big": 40 * _MIB + 3, "small": 1000}  # big: two full ranges of 16 MiB and a short one
    sources = {name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for name, n in sizes.items()}
    fill = _cuda.Fill(sources={(0, 0): sources["big"], (1, 0): sources["small"]}, pending=sum(sizes.values()))
    lock = threading.Lock()
    calls: list[tuple[int, int, int, int]] = []
    in_fill = [0, 0]  # now, most at once

    def recording(tensor: int, piece: int, offset: int, out: memoryview) -> None:
        with lock:
            calls.append((tensor, piece, offset, len(out)))
            in_fill[0] += 1
            in_fill[1] = max(in_fill[1], in_fill[0])
        try:
            fill(tensor, piece, offset, out)
        finally:
            with lock:
                in_fill[0] -= 1

    path = str(tmp_path / "ckpt")
    options = _core.SaveOptions(fill=recording, fill_budget_bytes=budget, threads=4, format=fmt)
    _core.save(path, [_entry("big", sizes["big"]), _entry("small", sizes["small"])], [], options)
    assert fill.done.is_set() and fill.pending == 0
    for t, name in enumerate(sizes):
        ranges = sorted((offset, n) for tensor, piece, offset, n in calls if tensor == t and piece == 0)
        assert ranges[0][0] == 0
        assert all(a + m == b for (a, m), (b, _) in zip(ranges, ranges[1:])), ranges
        assert ranges[-1][0] + ranges[-1][1] == sizes[name]
        assert max(n for _, n in ranges) <= 16 * _MIB
    assert len([c for c in calls if c[0] == 0]) == 3
    if budget == 1:
        assert in_fill[1] == 1  # a budget below one range: one range held at a time
    loaded = sp.load_full(path)
    for name, src in sources.items():
        assert torch.equal(loaded[name], src), name


def test_a_failed_range_fails_the_save_and_names_it(tmp_path):
    src = torch.zeros(3 * _MIB, dtype=torch.uint8)
    fill = _cuda.Fill(sources={(0, 0): src[: 2 * _MIB]}, pending=3 * _MIB)  # the source is short
    options = _core.SaveOptions(fill=fill, threads=2)
    with pytest.raises(_core.StatusError, match=r"filling bytes \[0, 3145728\) of piece 0 of tensor entry 0 "
                                                r"failed: .*holds 2097152 bytes, the engine asked for bytes "
                                                r"\[0, 3145728\)"):
        _core.save(str(tmp_path / "ckpt"), [_entry("w", 3 * _MIB)], [], options)
    assert not fill.done.is_set()
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(str(tmp_path / "ckpt"))
