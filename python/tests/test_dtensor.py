"""DTensor state dicts over real gloo process groups: bit-exact round trips across world sizes,
meshes and placements, and failures that reach every rank."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import shardpoint as sp
from distributed import run_ranks

# Stored tensors: uneven sizes, several dtypes, a 0-d tensor (replicated only).
SHAPES = {"w.a": ((16, 8), torch.float32), "w.b": ((10, 7), torch.bfloat16), "w.c": ((5, 3, 4), torch.float64),
          "bias": ((13,), torch.int32), "lists.0": ((9, 6), torch.float16)}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        values = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        out[name] = values.to(dtype)
    out["scalar"] = torch.tensor(3.25, dtype=torch.float32)
    return out


def _indices(length: int, splits: list[tuple[int, int, int]]) -> list[int]:
    """Reference index set of one tensor dim: splits (mesh size, coordinate, split factor) in order."""
    idx = list(range(length))
    for n, c, sf in splits:
        if sf == 1:
            pieces = [list(p) for p in torch.tensor(idx, dtype=torch.long).chunk(n)] if idx else []
            idx = [int(i) for i in pieces[c]] if c < len(pieces) else []
        else:
            outer = [list(p) for p in torch.tensor(idx, dtype=torch.long).chunk(sf)]
            taken = []
            for piece in outer:
                inner = list(torch.tensor(piece, dtype=torch.long).chunk(n))
                taken += [int(i) for i in inner[c]] if c < len(inner) else []
            idx = taken
    return idx


def _placements(spec: list, ndim: int) -> list:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec:
        if p == "R" or ndim == 0:
            out.append(Replicate())
        elif p[0] == "S":
            out.append(Shard(p[1] % ndim))
        else:
            out.append(_StridedShard(p[1] % ndim, split_factor=p[2]))
    return out


def _mesh(spec):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(spec, dict):
        return DeviceMesh("cpu", torch.tensor(spec["ranks"]).reshape(spec["shape"]))
    return init_device_mesh("cpu", tuple(spec))


def make_dtensor(full: torch.Tensor, mesh, spec: list):
    """A DTensor of ``full`` whose local chunk is cut by the reference index sets (not DTensor's)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = _placements(spec, full.dim())
    coordinate = mesh.get_coordinate()
    local = full
    if coordinate is None:
        local = full.new_empty((0,) * full.dim())
    else:
        for d in range(full.dim()):
            splits = [(mesh.size(m), coordinate[m], p.split_factor if isinstance(p, _StridedShard) else 1)
                      for m, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d]
            local = local.index_select(d, torch.tensor(_indices(full.shape[d], splits), dtype=torch.long))
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def state_for(mesh_spec, spec, zeros: bool) -> dict:
    mesh = _mesh(mesh_spec)
    ref = reference()
    tensors = {k: make_dtensor(torch.zeros_like(v) if zeros else v, mesh, spec) for k, v in ref.items()}
    return {"w": {"a": tensors["w.a"], "b": tensors["w.b"], "c": tensors["w.c"]}, "bias": tensors["bias"],
            "lists": [tensors["lists.0"]], "scalar": tensors["scalar"], "step": 0 if zeros else 17,
            "meta": {"name": "" if zeros else "run-1", "betas": (0.0, 0.0) if zeros else (0.9, 0.95)}}


def flat_tensors(state: dict) -> dict:
    return {"w.a": state["w"]["a"], "w.b": state["w"]["b"], "w.c": state["w"]["c"], "bias": state["bias"],
            "lists.0": state["lists"][0], "scalar": state["scalar"]}


def save_cases(rank, world, root, cases):
    for name, mesh_spec, spec in cases:
        sp.save(state_for(mesh_spec, spec, zeros=False), os.path.join(root, name))


def load_cases(rank, world, root, cases):
    mismatches = []
    for name, mesh_spec, spec in cases:
        state = state_for(mesh_spec, spec, zeros=True)
        result = sp.load(state, os.path.join(root, name))
        assert result.missing_keys == [] and result.unexpected_keys == []
        ref = reference()
        for key, value in flat_tensors(state).items():
            full = value.full_tensor()
            if full.dtype != ref[key].dtype or not torch.equal(full.reshape(-1), ref[key].reshape(-1)):
                mismatches.append((name, key))
        if (state["step"], state["meta"]) != (17, {"name": "run-1", "betas": (0.9, 0.95)}):
            mismatches.append((name, "objects"))
    return mismatches


SAVED_AT_4 = [
    ("a_1d", (4,), [("S", 0)]),
    ("b_two_dims_one_tensor_dim", (2, 2), [("S", 0), ("S", 0)]),
    ("d_submesh", {"ranks": [1, 2, 3], "shape": (3,)}, [("S", 0)]),
    ("e_strided", (2, 2), [("SS", 0, 2), ("S", 0)]),
]
SAVED_AT_2 = [("c_replicated", (2,), ["R"])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dtensor"))
    run_ranks(4, save_cases, root, SAVED_AT_4)
    run_ranks(2, save_cases, root, SAVED_AT_2)
    return root


def test_load_at_4_ranks_same_and_other_layouts(checkpoints):
    cases = [("a_1d", (4,), [("S", 0)]),                              # 4 -> 4, same layout
             ("b_two_dims_one_tensor_dim", (1, 2, 2), ["R", ("S", 1), ("S", 0)]),  # 3-D mesh
             ("c_replicated", (2, 2), [("S", 0), ("S", 1)]),          # 2 -> 4
             ("d_submesh", (4,), [("S", 1)]),
             ("e_strided", (2, 2), [("SS", 0, 2), ("S", 0)])]
    assert run_ranks(4, load_cases, checkpoints, cases) == [[]] * 4


def test_load_at_2_and_3_ranks(checkpoints):
    cases2 = [("a_1d", (2,), [("S", 1)]), ("e_strided", (2,), [("S", 0)]), ("d_submesh", (1, 2), ["R", ("S", 0)])]
    assert run_ranks(2, load_cases, checkpoints, cases2) == [[]] * 2
    cases3 = [("a_1d", (3,), [("S", 0)]), ("b_two_dims_one_tensor_dim", (3,), [("S", 1)])]
    assert run_ranks(3, load_cases, checkpoints, cases3) == [[]] * 3


def test_load_at_1_process_and_load_full(checkpoints):
    ref = reference()
    for name, *_ in SAVED_AT_4 + SAVED_AT_2:
        path = os.path.join(checkpoints, name)
        template = {"w": {k: torch.zeros_like(ref["w." + k]) for k in "abc"}, "bias": torch.zeros_like(ref["bias"]),
                    "lists": [torch.zeros_like(ref["lists.0"])], "scalar": torch.zeros(()), "step": 0,
                    "meta": {"name": "", "betas": (0.0, 0.0)}}
        sp.load(template, path)                                       # 4 -> 1
        full = sp.load_full(path)
        for state in (template, full):
            assert torch.equal(state["w"]["b"], ref["w.b"]) and torch.equal(state["lists"][0], ref["lists.0"])
            assert torch.equal(state["w"]["a"], ref["w.a"]) and torch.equal(state["w"]["c"], ref["w.c"])
            assert torch.equal(state["bias"], ref["bias"]) and torch.equal(state["scalar"], ref["scalar"])
            assert state["step"] == 17 and state["meta"]["name"] == "run-1"
        assert template["meta"]["betas"] == (0.9, 0.95) and full["meta"]["betas"] == (0.9, 0.95)
    info = sp.inspect(os.path.join(checkpoints, "b_two_dims_one_tensor_dim"))
    assert info.world_size == 4 and info.tensors["w.b"].shape == (10, 7) and info.tensors["w.b"].dtype == "bfloat16"
    # [S(0), S(0)] over (2, 2) splits 10 rows into 5 | 5, then 3 + 2 each: four row chunks.
    assert sorted(c for c in info.tensors["w.b"].chunks) == [((0, 0), (3, 7)), ((3, 0), (2, 7)),
                                                             ((5, 0), (3, 7)), ((8, 0), (2, 7))]
    assert sp.inspect(os.path.join(checkpoints, "d_submesh")).tensors["w.a"].chunks.__len__() == 3


def _layouts_rank(rank, world):
    from shardpoint._torch import tensor_plan

    out = {}
    for name, mesh_spec, spec in SAVED_AT_4:
        value = make_dtensor(reference()["w.c"], _mesh(mesh_spec), spec)
        out[name] = (tensor_plan("w.c", value, for_load=False).layout,
                     tensor_plan("w.c", value, for_load=True).layout)
    return out


def test_saves_send_the_mesh_and_placements_of_each_dtensor():
    # (mesh shape, placements as (kind, dim, split factor), the mesh's ranks or () for 0..n-1):
    # the core sends these instead of each rank's box (docs/DESIGN.md, save step 2).
    layouts = run_ranks(4, _layouts_rank)
    assert layouts[0]["a_1d"] == (((4,), ((1, 0, 1),), ()), None)
    assert layouts[2]["b_two_dims_one_tensor_dim"] == (((2, 2), ((1, 0, 1), (1, 0, 1)), ()), None)
    assert layouts[1]["d_submesh"] == (((3,), ((1, 0, 1),), (1, 2, 3)), None)
    assert layouts[0]["d_submesh"] == (None, None)  # rank 0 is not in the mesh: it holds nothing
    assert layouts[3]["e_strided"] == (((2, 2), ((2, 0, 2), (1, 0, 1)), ()), None)


def strided_without_shard(rank, world, path):
    mesh = _mesh((2, 2))
    value = make_dtensor(reference()["w.a"], mesh, [("S", 1), ("SS", 0, 2)])
    try:
        sp.save({"x": value}, path)
    except sp.CheckpointArgumentError as e:
        return str(e)
    return None


def test_strided_shard_without_following_shard_is_refused(tmp_path):
    messages = run_ranks(4, strided_without_shard, str(tmp_path / "ckpt"))
    assert all(m is not None and "'x'" in m and "_StridedShard" in m for m in messages)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(str(tmp_path / "ckpt"))


class UnhashablePlacement:
    """A placement of a kind shardpoint cannot store, that cannot be hashed either."""

    __hash__ = None

    def __repr__(self) -> str:
        return "UnhashablePlacement()"


def test_placements_that_cannot_be_stored_are_refused_naming_each_tensor():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    from shardpoint import _torch

    _torch._check_placements("fine", (Shard(0), Replicate()))
    # The check is cached per placements; each tensor's error still names that tensor.
    for name in ("a", "b"):
        with pytest.raises(sp.CheckpointArgumentError, match=f"tensor '{name}': placement P\\(sum\\) cannot be saved"):
            _torch._check_placements(name, (Shard(0), Partial()))
    with pytest.raises(sp.CheckpointArgumentError, match="tensor 'c': placement UnhashablePlacement"):
        _torch._check_placements("c", (Replicate(), UnhashablePlacement()))


def failing_rank(rank, world, path):
    state = {"x": torch.arange(8, dtype=torch.float32) + rank, "obj": object() if rank == 2 else 1}
    try:
        sp.save(state, path)
    except sp.CheckpointError as e:
        return type(e).__name__, e.code, str(e)
    return None


def test_a_rank_failing_mid_save_fails_every_rank(tmp_path):
    results = run_ranks(4, failing_rank, str(tmp_path / "ckpt"))
    assert all(r is not None for r in results)
    assert {r[0] for r in results} == {"CheckpointArgumentError"}
    assert all("rank 2" in r[2] and "'obj'" in r[2] and "allow_pickle" in r[2] for r in results)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(str(tmp_path / "ckpt"))


def inconsistent_rank(rank, world, path):
    # Rank 3 claims a different global shape: the core's plan validation fails on every rank.
    shape = (8,) if rank != 3 else (9,)
    state = {"x": sp.ShardedTensor(torch.ones(2), shape, (2 * rank,))}
    try:
        sp.save(state, path)
    except sp.CheckpointError as e:
        return type(e).__name__, str(e)
    return None


def test_inconsistent_layout_fails_every_rank(tmp_path):
    results = run_ranks(4, inconsistent_rank, str(tmp_path / "ckpt"))
    assert all(r is not None and r[0] == "CheckpointArgumentError" for r in results)
    assert len({r[1] for r in results}) == 1 and "x" in results[0][1]
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(str(tmp_path / "ckpt"))


def _share_reads_rank(rank: int, world: int, path: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {"w": torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96),
            "b": torch.arange(10 * 7 * 9, dtype=torch.float64).reshape(10, 7, 9)}
    sp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, path)
    out = []
    for share in (True, None, False):
        dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
        result = sp.load(dest, path, share_reads=share)
        for k, v in full.items():
            assert torch.equal(dest[k].full_tensor(), v), (k, share)
        out.append(result.bytes_read)
    return out


def test_shared_reads_read_each_stored_byte_once_between_processes(tmp_path):
    """Column-split loads of row-split chunks by three processes of one machine: with share_reads
    (asked for, or by default) one rank reads each chunk and hands the others their columns through
    shared memory, so each stored byte is read once; with share_reads=False each rank reads every
    chunk itself (the chunks are smaller than a checksum block, so each is read whole). Every load
    is bit-exact, and nothing stays in /dev/shm."""
    stored = 64 * 96 * 4 + 10 * 7 * 9 * 8
    per_rank = run_ranks(3, _share_reads_rank, str(tmp_path / "ckpt"))
    shared, default, alone = (sum(r[i] for r in per_rank) for i in range(3))
    assert shared == default == stored
    assert alone == 3 * stored
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shardpoint-")]


def _direct_shared_rank(rank: int, world: int, path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(768, 1024, generator=torch.Generator().manual_seed(5))
    sp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, path)
    dest = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])}
    result = sp.load(dest, path, direct_io=True)
    assert torch.equal(dest["w"].full_tensor(), full)
    return result.bytes_read


def test_shared_reads_between_processes_with_direct_io(tmp_path):
    """Three processes load row blocks of 1 MiB as columns with direct I/O: each block is read
    whole by one process into its slots in shared memory (through its staging buffers where the
    disk takes shorter requests into shared memory's small pages), and every process copies its
    columns out. Bit-exact, each stored byte read once."""
    per_rank = run_ranks(3, _direct_shared_rank, str(tmp_path / "ckpt"))
    assert sum(per_rank) == 768 * 1024 * 4
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shardpoint-")]


def _metadata_part_rank(rank: int, world: int, path: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {"w": torch.arange(60 * 8, dtype=torch.float32).reshape(60, 8),
            "b": torch.arange(30, dtype=torch.int64)}
    sp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, path)
    out = []
    for placement, keys, share in ((Shard(0), ("w", "b"), None), (Shard(1), ("w",), None),
                                   (Shard(0), ("w",), False)):
        dest = {k: distribute_tensor(torch.zeros_like(full[k]), mesh, [placement]) for k in keys}
        result = sp.load(dest, path, share_reads=share, strict=False)
        for k in keys:
            assert torch.equal(dest[k].full_tensor(), full[k]), (k, placement)
        out.append(result.metadata_chunks)
    return out


def test_each_process_keeps_only_the_chunks_its_boxes_reach(tmp_path):
    """Three processes load a checkpoint of two row-split tensors (3 chunks each). The coordinator
    (rank 0) decodes every chunk of the metadata; each other process keeps only the chunks its own
    boxes reach: its row block of each tensor in the layout of the save (with shared reads or
    without), every row block of "w" and none of "b" when it loads columns of "w" alone. Every
    load is bit-exact."""
    per_rank = run_ranks(3, _metadata_part_rank, str(tmp_path / "ckpt"))
    assert per_rank[0] == [6, 6, 6]
    assert per_rank[1] == per_rank[2] == [2, 3, 1]


def _corrupt_shared_load_rank(rank: int, world: int, path: str) -> list:
    import glob
    import struct

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(96 * 256, dtype=torch.float32).reshape(96, 256)
    sp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, path)
    # Rank 1's rows go to every rank as whole rows through shared memory; one byte of them flips.
    [data] = glob.glob(os.path.join(path, "*-r00001-*.safetensors"))
    with open(data, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    at = 8 + header + 4000

    def flip() -> None:
        if rank == 0:
            with open(data, "r+b") as f:
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x40]))
        dist.barrier()

    flip()
    out = []
    dest = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])}
    try:
        sp.load(dest, path)
        out.append(None)
    except sp.CheckpointError as e:
        out.append((type(e).__name__, str(e)))
    dist.barrier()
    flip()  # the byte back: the same load succeeds
    dest = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])}
    sp.load(dest, path)
    out.append(torch.equal(dest["w"].full_tensor(), full))
    return out


def test_a_corrupt_chunk_fails_every_process_of_a_shared_load(tmp_path):
    """Three gloo processes load row chunks as columns, sharing their reads through shared memory
    (each chunk read once, as whole rows that every rank copies its columns from): a flipped byte
    fails every rank with the same error, the reader's checksum mismatch naming the file, and
    nobody waits for the rank that stopped. With the byte back, the same load is bit-exact, and
    nothing stays in /dev/shm."""
    per_rank = run_ranks(3, _corrupt_shared_load_rank, str(tmp_path / "ckpt"))
    failures = [r[0] for r in per_rank]
    assert all(f is not None and f[0] == "CheckpointCorruptError" for f in failures), failures
    assert len({f[1] for f in failures}) == 1, failures
    message = failures[0][1]
    assert message.startswith("rank ") and "checksum mismatch in tensor 'w'" in message, message
    assert "-r00001-" in message, message
    assert [r[1] for r in per_rank] == [True, True, True]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shardpoint-")]


def _gate_rank(rank, world, path):
    sp.save(state_for((world,), [("S", 0)], zeros=False), path)
    gates, exact = [], []
    for options in ({"share_reads": False}, {"share_reads": False, "machine_read_gate": False},
                    {"share_reads": False, "io_depth": 2}, {}):
        state = state_for((world,), [("S", 0)], zeros=True)
        result = sp.load(state, path, **options)
        gates.append(result.read_gate_ranks)
        ref = reference()
        exact.append(all(torch.equal(v.full_tensor().view(-1), ref[k].view(-1))
                         for k, v in flat_tensors(state).items()))
    return gates, exact


def test_processes_of_one_machine_read_through_one_gate(tmp_path):
    """Three gloo ranks on one host, each reading its own: their loads put every read through one
    gate in shared memory (read_gate_ranks 3); with machine_read_gate=False or a fixed io_depth,
    each process has its own (1). Sharing their reads through shared memory (the default here:
    some tensors are replicated), each byte has one reader and each process tunes its own gate
    (1). The loads are bit-exact either way, and nothing stays in /dev/shm."""
    per_rank = run_ranks(3, _gate_rank, str(tmp_path / "ckpt"))
    assert [gates for gates, _ in per_rank] == [[3, 1, 1, 1]] * 3
    assert [exact for _, exact in per_rank] == [[True] * 4] * 3
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shardpoint-io-")]
