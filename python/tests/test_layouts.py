"""hyper_parallel tensor_map layouts and explicit sharded tensors (flat ranges) as state-dict values."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest
import torch

import shardpoint as sp
from distributed import run_ranks
from shardpoint._layouts import tensor_map_box
from shardpoint._pieces import Box, decompose_flat_range


def test_tensor_map_worked_example_and_uneven_splits():
    # mesh (2, 4), tensor_map {{1}, {0}} on [8, 8]: inner rank 6 = (1, 2) holds rows 4..7, columns 4..5.
    assert tensor_map_box((8, 8), (2, 4), [1, 0], 6) == Box((4, 4), (4, 2))
    # balanced: 10 over 4 -> 3, 3, 2, 2; like torch.chunk on uneven mesh dims -> 3, 3, 3, 1.
    assert [tensor_map_box((10,), (4,), [0], r).sizes[0] for r in range(4)] == [3, 3, 2, 2]
    assert [tensor_map_box((10,), (4,), [0], r, uneven_mesh_dims=[0]).sizes[0] for r in range(4)] == [3, 3, 3, 1]
    # one tensor dim split by two mesh dims: first by mesh dim 1 (listed first: size 2), then by mesh dim 0.
    boxes = [tensor_map_box((8, 3), (2, 2), [[1, 0], -1], r) for r in range(4)]
    assert [b.offsets[0] for b in boxes] == [0, 2, 4, 6] and all(b.sizes == (2, 3) for b in boxes)
    with pytest.raises(sp.CheckpointArgumentError):
        tensor_map_box((8, 8), (2, 2), [0, 0], 0)


def test_flat_range_decomposition_matches_a_reference():
    rng = random.Random(5)
    for _ in range(300):
        rank = rng.randint(0, 4)
        sizes = tuple(rng.randint(1, 4) for _ in range(rank))
        offsets = tuple(rng.randint(0, 3) for _ in range(rank))
        box = Box(offsets, sizes)
        begin = rng.randint(0, box.volume)
        end = rng.randint(begin, box.volume)
        pieces = decompose_flat_range(box, begin, end)
        assert len(pieces) <= max(1, 2 * rank - 1) and all(p.volume > 0 for p in pieces)
        # Reference: the global coordinates of flat elements [begin, end) in row-major order.
        expected = [tuple(o + i for o, i in zip(offsets, idx))
                    for idx in itertools.islice(itertools.product(*[range(s) for s in sizes]), begin, end)]
        got = [idx for p in pieces for idx in itertools.product(*[range(o, o + s) for o, s in zip(p.offsets, p.sizes)])]
        assert got == expected, (box, begin, end, pieces)


GLOBAL = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12) * 0.5
FLAT_GLOBAL = torch.arange(6 * 5, dtype=torch.int64).reshape(6, 5) - 7
FLAT_CUTS = [0, 7, 15, 22, 30]


def layout_state(rank, zeros: bool):
    box = tensor_map_box((8, 12), (2, 2), [1, 0], rank)
    local = GLOBAL[box.offsets[0]:box.offsets[0] + box.sizes[0], box.offsets[1]:box.offsets[1] + box.sizes[1]].clone()
    begin, end = FLAT_CUTS[rank], FLAT_CUTS[rank + 1]
    data = FLAT_GLOBAL.reshape(-1)[begin:end].clone().numpy()
    if zeros:
        local.zero_()
        data[:] = 0
    return {"hp": sp.HyperParallelTensor(local, mesh_shape=(2, 2), tensor_map=[1, 0]),
            "megatron": sp.ShardedTensor(data, (6, 5), (0, 0), local_shape=(6, 5), flattened_range=slice(begin, end))}


def save_layouts(rank, world, path):
    sp.save(layout_state(rank, zeros=False), path)


def load_layouts(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"hp": distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)]),
             "megatron": distribute_tensor(torch.zeros(6, 5, dtype=torch.int64), mesh, [Shard(0)])}
    sp.load(state, path)
    return torch.equal(state["hp"].full_tensor(), GLOBAL) and torch.equal(state["megatron"].full_tensor(), FLAT_GLOBAL)


def reload_layouts(rank, world, path):
    state = layout_state(rank, zeros=True)
    sp.load(state, path)
    expected = layout_state(rank, zeros=False)
    return (torch.equal(state["hp"].local, expected["hp"].local)
            and np.array_equal(state["megatron"].data, expected["megatron"].data))


def test_layouts_round_trip_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(4, save_layouts, path)
    full = sp.load_full(path)
    assert torch.equal(full["hp"], GLOBAL) and torch.equal(full["megatron"], FLAT_GLOBAL)
    assert run_ranks(3, load_layouts, path) == [True] * 3
    assert run_ranks(4, reload_layouts, path) == [True] * 4


def test_layout_shape_errors_name_the_tensor(tmp_path):
    with pytest.raises(sp.CheckpointArgumentError, match="'m'.*flattened_range"):
        sp.save({"m": sp.ShardedTensor(np.zeros(5), (6, 5), (0, 0), local_shape=(6, 5), flattened_range=(0, 4))},
                tmp_path / "c")
    with pytest.raises(sp.CheckpointArgumentError, match="'h'.*local shape"):
        sp.save({"h": sp.HyperParallelTensor(torch.zeros(3, 3), (1, 1), [0, 1], global_shape=(4, 4))}, tmp_path / "c")
