"""The bound layout functions (shardpoint._core, python/_core/layout_bindings.cc) against plain Python
references on randomized layouts, and their errors as the package raises them."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

import shardpoint as sp
from shardpoint import _core
from shardpoint._layouts import tensor_map_box
from shardpoint._pieces import Box, decompose_flat_range, flat_range_pieces


# ---- references: the conventions of shardpoint/layout/tensor_map.h, written out directly ----

def reference_split(length: int, parts: int, index: int, like_torch_chunk: bool) -> tuple[int, int]:
    """(begin, end) of piece ``index`` of ``length`` over ``parts``."""
    if like_torch_chunk:
        step = -(-length // parts)
        begin = min(index * step, length)
        return begin, min(begin + step, length)
    sizes = [length // parts + (1 if i < length % parts else 0) for i in range(parts)]
    begin = sum(sizes[:index])
    return begin, begin + sizes[index]


def reference_tensor_map(shape, mesh, tensor_map, inner_rank, uneven=()):
    """The box of ``inner_rank`` by enumerating the mesh coordinates row-major."""
    coordinate = list(itertools.product(*[range(n) for n in mesh]))[inner_rank]
    offsets, sizes = [], []
    for dim, entry in enumerate(tensor_map):
        begin, end = 0, shape[dim]
        for m in entry:
            if m == -1:
                continue
            mesh_dim = len(mesh) - 1 - m
            lo, hi = reference_split(end - begin, mesh[mesh_dim], coordinate[mesh_dim], mesh_dim in uneven)
            begin, end = begin + lo, begin + hi
        offsets.append(begin)
        sizes.append(end - begin)
    return tuple(offsets), tuple(sizes)


def random_tensor_map_layout(rng: random.Random):
    mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
    rank = rng.randint(0, 3)
    tensor_map = [[] for _ in range(rank)]
    for m in rng.sample(range(len(mesh)), len(mesh)):
        slot = rng.randint(0, rank)  # == rank: the mesh dim replicates
        if slot < rank:
            tensor_map[slot].append(m)
    tensor_map = [entry or [-1] if rng.random() < 0.5 else entry for entry in tensor_map]
    shape = tuple(rng.randint(0, 13) for _ in range(rank))
    uneven = tuple(d for d in range(len(mesh)) if rng.random() < 0.4)
    return shape, mesh, tensor_map, uneven


def test_tensor_map_chunk_matches_the_reference_on_random_layouts():
    rng = random.Random(14)
    for _ in range(400):
        shape, mesh, tensor_map, uneven = random_tensor_map_layout(rng)
        for inner in range(math.prod(mesh)):
            expected = reference_tensor_map(shape, mesh, tensor_map, inner, uneven)
            got = _core.tensor_map_chunk(shape, mesh, tensor_map, inner, uneven)
            assert got == expected, (shape, mesh, tensor_map, uneven, inner)
            assert tensor_map_box(shape, mesh, tensor_map, inner, uneven) == Box(*expected)


def test_tensor_map_rank_list_matches_the_reference():
    rng = random.Random(15)
    for _ in range(200):
        shape, mesh, tensor_map, uneven = random_tensor_map_layout(rng)
        volume = math.prod(mesh)
        world = volume + rng.randint(0, 3)
        rank_list = rng.sample(range(world), volume) if rng.random() < 0.7 else []
        expected = [None] * world
        for inner, rank in enumerate(rank_list or range(volume)):
            expected[rank] = reference_tensor_map(shape, mesh, tensor_map, inner, uneven)
        assert _core.tensor_map_chunks_per_rank(shape, mesh, tensor_map, world, rank_list, uneven) == expected
        for rank in range(world + 1):
            got = _core.tensor_map_chunk_for_rank(shape, mesh, tensor_map, rank, rank_list, uneven)
            assert got == (expected[rank] if rank < world else None), (mesh, rank_list, rank)


# ---- flat ranges: the reference lists the global coordinates of the range, in row-major order ----

def coordinates(offsets, sizes):
    return [tuple(o + i for o, i in zip(offsets, idx)) for idx in itertools.product(*[range(s) for s in sizes])]


def test_flat_range_functions_match_the_reference_on_random_boxes():
    rng = random.Random(16)
    for _ in range(500):
        rank = rng.randint(0, 4)
        sizes = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 4) for _ in range(rank))
        offsets = tuple(rng.randint(0, 3) for _ in range(rank))
        shape = tuple(o + s + rng.randint(0, 2) for o, s in zip(offsets, sizes))
        volume = math.prod(sizes)
        begin = rng.randint(0, volume)
        end = rng.randint(begin, volume)
        boxes = _core.decompose_flat_range(offsets, sizes, begin, end)
        assert len(boxes) <= max(1, 2 * rank - 1) and all(math.prod(s) > 0 for _, s in boxes)
        assert [c for o, s in boxes for c in coordinates(o, s)] == coordinates(offsets, sizes)[begin:end]
        assert decompose_flat_range(Box(offsets, sizes), begin, end) == [Box(o, s) for o, s in boxes]
        pieces = flat_range_pieces(shape, Box(offsets, sizes), begin, end)
        running = list(itertools.accumulate([0] + [math.prod(s) for _, s in boxes]))[:-1]
        assert pieces == [(Box(o, s), at) for (o, s), at in zip(boxes, running)]


def test_flat_range_pieces_place_a_megatron_shard_bit_exactly():
    full = np.arange(6 * 5 * 4, dtype=np.int32).reshape(6, 5, 4)
    box = Box((1, 1, 0), (4, 3, 4))
    block = full[1:5, 1:4, :].reshape(-1)
    begin, end = 7, 38
    data = block[begin:end]
    rebuilt = np.full_like(full, -1)
    for piece, at in flat_range_pieces(full.shape, box, begin, end):
        region = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
        rebuilt[region] = data[at:at + piece.volume].reshape(piece.sizes)
    expected = np.full_like(full, -1)
    expected_block = expected[1:5, 1:4, :].reshape(-1)
    expected_block[begin:end] = block[begin:end]
    expected[1:5, 1:4, :] = expected_block.reshape(4, 3, 4)
    assert np.array_equal(rebuilt, expected)


# ---- errors: StatusError from the binding, CheckpointArgumentError naming the tensor in the package ----

def test_binding_errors_carry_the_core_message():
    with pytest.raises(_core.StatusError) as raised:
        _core.decompose_flat_range([0, 0], [2, 3], 2, 7)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert raised.value.message == "flat range [2, 7) of box [0:2, 0:3]: expected 0 <= begin <= end <= volume 6"
    with pytest.raises(_core.StatusError, match=r"^flat range box \[2:5\] is out of bounds of shape \[4\]$"):
        _core.flat_range_pieces([4], [2], [3], 0, 1)
    with pytest.raises(ValueError, match=r"box offsets \[0\] and sizes \[1, 2\] differ in rank"):
        _core.decompose_flat_range([0], [1, 2], 0, 1)
    with pytest.raises(sp.CheckpointArgumentError) as raised:
        tensor_map_box((8, 8), (2, 2), [0, 0], 0)
    assert raised.value.message == ("tensor of shape [8, 8] with mesh_shape [2, 2] and tensor_map (0, 0): "
                                    "mesh dim 0 is used more than once")
    with pytest.raises(sp.CheckpointArgumentError, match=r"^inner rank 4 is outside mesh_shape \[2, 2\] of 4 devices$"):
        tensor_map_box((8, 8), (2, 2), [0, 1], 4)


def test_layout_values_name_the_tensor_in_core_errors(tmp_path):
    shard = sp.ShardedTensor(np.zeros(4), (6, 5), (0, 0), local_shape=(6, 5), flattened_range=(28, 32))
    with pytest.raises(sp.CheckpointArgumentError) as raised:
        sp.save({"m": shard}, tmp_path / "c")
    assert raised.value.message == ("tensor 'm': flat range [28, 32) of box [0:6, 0:5]: expected 0 <= begin <= "
                                    "end <= volume 30")
    hp = sp.HyperParallelTensor(np.zeros((2, 4)), (2,), [0, -1], rank_list=[0, 0], global_shape=(4, 4))
    with pytest.raises(sp.CheckpointArgumentError) as raised:
        sp.save({"h": hp}, tmp_path / "c")
    assert raised.value.message == "tensor 'h': rank_list holds rank 0 twice"
