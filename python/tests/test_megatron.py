"""Megatron-Core torch_dist checkpoints, both directions, with megatron-core 0.16.1 on CPU.

megatron.core.dist_checkpointing.save writes a checkpoint at 4 gloo ranks (tensor parallel 2 x data
parallel 2: TP-split tensors whose DP replicas are not written, a replicated tensor, an
optimizer-style tensor split over all ranks, ShardedObjects, and a common state with an
argparse.Namespace); shardpoint inspects, verifies and loads it at 2 and 3 ranks into other layouts,
bit for bit. Then shardpoint saves with format="megatron" at 3 ranks and megatron-core loads that at
2 ranks. megatron-core on CPU calls torch.cuda.synchronize and torch.cuda.current_device; the
ranks replace both (here, in the test, never in the product).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

import shardpoint as sp
import distributed
from torch_dcp_util import CLI, bit_equal

pytest.importorskip("megatron.core.dist_checkpointing")

TP = 2
COMMON = {"iteration": 7, "args": argparse.Namespace(lr=0.1, tensor_model_parallel_size=TP),
          "config": {"x": [1, 2], "name": "gpt"}, "checkpoint_version": 3.0}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return {"model.w": torch.randn(8, 6, generator=g),
            "model.emb": torch.randn(6, 4, generator=g).to(torch.bfloat16),
            "model.b": torch.arange(10, dtype=torch.int64) * 3 - 7,
            "optimizer.exp_avg": torch.randn(12, generator=g, dtype=torch.float64)}


def _cpu_megatron() -> None:
    """megatron-core's CPU gaps, patched in this rank's process only."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """distributed.run_ranks with megatron-core imported once by the fork server and its CPU gaps
    patched in each rank."""
    return distributed.run_ranks(world, fn, *args, preload=["megatron.core.dist_checkpointing"], setup=_cpu_megatron)


def _megatron_save(rank: int, world: int, path: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    ref = reference()
    tp, dp = rank % TP, rank // TP
    state = {
        "w": ShardedTensor.from_rank_offsets("model.w", ref["model.w"][tp * 4:(tp + 1) * 4].clone(), (0, tp, TP),
                                             replica_id=dp),
        "emb": ShardedTensor.from_rank_offsets("model.emb", ref["model.emb"][:, tp * 2:(tp + 1) * 2].clone(),
                                               (1, tp, TP), replica_id=dp),
        "b": ShardedTensor.from_rank_offsets("model.b", ref["model.b"].clone(), replica_id=rank),
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets(
            "optimizer.exp_avg", ref["optimizer.exp_avg"][rank * 3:(rank + 1) * 3].clone(), (0, rank, world))},
        "rng": ShardedObject("rng_state", {"seed": 100 + rank}, (world,), (rank,), replica_id=0),
        **COMMON,
    }
    dist_checkpointing.save(state, path)


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    os.makedirs(path)
    run_ranks(4, _megatron_save, path)
    assert sorted(os.listdir(path))[:2] == [".metadata", "__0_0.distcp"]
    assert {"common.pt", "metadata.json"} <= set(os.listdir(path))
    return path


def test_inspect_verify_and_load_full(megatron_ckpt: str) -> None:
    ref = reference()
    info = sp.inspect(megatron_ckpt)
    assert {k: (t.dtype, t.shape) for k, t in info.tensors.items()} == {
        "model.w": ("float32", (8, 6)), "model.emb": ("bfloat16", (6, 4)), "model.b": ("int64", (10,)),
        "optimizer.exp_avg": ("float64", (12,))}
    # Only the main replicas were written: 2 chunks of w, 2 of emb, 1 of b, 4 of exp_avg.
    assert [len(info.tensors[k].chunks) for k in ("model.w", "model.emb", "model.b", "optimizer.exp_avg")] == [2, 2, 1, 4]
    common = {"iteration", "args", "config.x", "config.name", "checkpoint_version"}
    rng = {f"rng_state/shard_{r}_4" for r in range(4)}
    assert set(info.objects) == common | rng
    # Plain data (common.pt's entries) is stored exactly and read without pickle; the Namespace stays
    # a torch.save archive; the ShardedObjects' DCP items are not read by inspect (docs/TORCH_DCP.md).
    assert {k: o.encoding for k, o in info.objects.items()} == {k: "torch-save" if k == "args" or k in rng
                                                                else "plain" for k in common | rng}
    assert {k: v for k, v in info.attributes.items() if k.startswith("megatron.")} == {
        "megatron.sharded_backend": "torch_dist", "megatron.sharded_backend_version": "1",
        "megatron.common_backend": "torch", "megatron.common_backend_version": "1"}
    report = sp.verify(megatron_ckpt)
    assert report.ok, report.defects
    full = sp.load_full(megatron_ckpt, allow_pickle=True)
    for key, want in ref.items():
        head, leaf = key.split(".")
        got = full[key] if key in full else full[head][leaf]
        assert bit_equal(got, want), key
    assert full["iteration"] == 7 and full["checkpoint_version"] == 3.0
    assert full["args"] == COMMON["args"]
    assert full["config"] == {"x": [1, 2], "name": "gpt"}
    # megatron-core stores a ShardedObject as torch.save([data]) (a list of its local objects).
    assert [full[f"rng_state/shard_{r}_4"] for r in range(4)] == [[{"seed": 100 + r}] for r in range(4)]
    # A Namespace is a Python object: loading it runs code, so it needs the opt-in.
    # megatron-core registers argparse.Namespace as a torch safe global, so in its processes the
    # Namespace loads through torch.load(weights_only=True); elsewhere it needs the opt-in.
    assert sp.load_full(megatron_ckpt, keys=["args"])["args"] == COMMON["args"]
    script = ("import shardpoint as sp, sys\n"
              "try:\n    sp.load_full(sys.argv[1], keys=['args'])\n"
              "except sp.CheckpointArgumentError as e:\n    print(e)\n")
    refused = subprocess.run([sys.executable, "-c", script, megatron_ckpt], capture_output=True, text=True, timeout=120)
    assert re.search(r"object 'args' needs global 'argparse.Namespace'.*allow_pickle=True", refused.stdout), refused
    plain = sp.load_full(megatron_ckpt, keys=["iteration", "config", "checkpoint_version", "rng_state/shard_1_4"])
    assert plain == {"iteration": 7, "checkpoint_version": 3.0, "config": {"x": [1, 2], "name": "gpt"},
                     "rng_state/shard_1_4": [{"seed": 101}]}


def _load_at_two(rank: int, world: int, path: str) -> dict:
    """Rows of w by column halves, emb whole, b by halves, exp_avg as a flattened range."""
    state = {
        "model.w": sp.ShardedTensor(torch.full((8, 3), -1.0), (8, 6), (0, rank * 3)),
        "model.emb": torch.zeros(6, 4, dtype=torch.bfloat16),
        "model.b": sp.ShardedTensor(torch.zeros(5, dtype=torch.int64), (10,), (rank * 5,)),
        "optimizer.exp_avg": sp.ShardedTensor(torch.zeros(6, dtype=torch.float64), (12,), (0,), local_shape=(12,),
                                              flattened_range=(rank * 6, rank * 6 + 6)),
        "iteration": 0, "config": {"x": [0, 0], "name": ""},
    }
    result = sp.load(state, path)  # common.pt's plain entries need no allow_pickle
    assert result.missing_keys == []
    return {k: (v.data if isinstance(v, sp.ShardedTensor) else v) for k, v in state.items()}


def _load_at_three(rank: int, world: int, path: str) -> dict:
    """DTensors: w by rows (uneven), emb by columns, b replicated; exp_avg in explicit thirds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "model.w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]),
        "model.emb": distribute_tensor(torch.zeros(6, 4, dtype=torch.bfloat16), mesh, [Shard(1)]),
        "model.b": distribute_tensor(torch.zeros(10, dtype=torch.int64), mesh, [Replicate()]),
        "optimizer.exp_avg": sp.ShardedTensor(torch.zeros(4, dtype=torch.float64), (12,), (rank * 4,)),
    }
    sp.load(state, path)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.data for k, v in state.items()}


def test_load_at_two_ranks(megatron_ckpt: str) -> None:
    ref = reference()
    for rank, got in enumerate(run_ranks(2, _load_at_two, megatron_ckpt)):
        assert bit_equal(got["model.w"], ref["model.w"][:, rank * 3:(rank + 1) * 3])
        assert bit_equal(got["model.emb"], ref["model.emb"])
        assert bit_equal(got["model.b"], ref["model.b"][rank * 5:(rank + 1) * 5])
        assert bit_equal(got["optimizer.exp_avg"], ref["optimizer.exp_avg"][rank * 6:(rank + 1) * 6])
        assert got["iteration"] == 7 and got["config"] == {"x": [1, 2], "name": "gpt"}


def test_load_at_three_ranks(megatron_ckpt: str) -> None:
    ref = reference()
    for rank, got in enumerate(run_ranks(3, _load_at_three, megatron_ckpt)):
        for key in ("model.w", "model.emb", "model.b"):
            assert bit_equal(got[key], ref[key]), (rank, key)
        assert bit_equal(got["optimizer.exp_avg"], ref["optimizer.exp_avg"][rank * 4:(rank + 1) * 4])


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The shardpoint tool installed with the package under test (pip --target puts it in bin/ beside
    the package), else the one beside the interpreter."""
    beside = os.path.join(os.path.dirname(os.path.dirname(sp.__file__)), "bin", "shardpoint")
    tool = beside if os.path.exists(beside) else CLI
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_cli_inspect_and_verify(megatron_ckpt: str) -> None:
    shown = _cli("inspect", megatron_ckpt)
    assert shown.returncode == 0, shown.stderr
    assert "megatron.sharded_backend" in shown.stdout and "torch_dist" in shown.stdout
    assert "config.name" in shown.stdout
    checked = _cli("verify", megatron_ckpt)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_other_backends_are_refused(megatron_ckpt: str, tmp_path) -> None:
    path = str(tmp_path / "zarr")
    shutil.copytree(megatron_ckpt, path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "zarr", "sharded_backend_version": 1}, f)
    with pytest.raises(sp.CheckpointError, match=r"metadata.json: sharded_backend 'zarr' version 1 is not supported"):
        sp.inspect(path)
    os.remove(os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    with pytest.raises(sp.CheckpointCorruptError, match=r"common.pt is missing"):
        sp.inspect(path)


# ---------------------------------------------------------------------------------------------
# shardpoint writes (format="megatron"), megatron-core reads.

SAVED_COMMON = {"iteration": 11, "config": {"lr": 0.5, "name": "gpt", "layers": [1, 2]}, "opt": {"step": 3}}


def _sp_save(rank: int, world: int, path: str) -> None:
    ref = reference()
    rows = [(0, 3), (3, 6), (6, 8)][rank]
    state = {
        "model.w": sp.ShardedTensor(ref["model.w"][rows[0]:rows[1]].clone(), (8, 6), (rows[0], 0)),
        "model.b": ref["model.b"].clone(),
        "optimizer.exp_avg": sp.ShardedTensor(ref["optimizer.exp_avg"][rank * 4:(rank + 1) * 4].clone(), (12,),
                                              (rank * 4,)),
        **SAVED_COMMON,
    }
    sp.save(state, path, format="megatron")


def _megatron_load(rank: int, world: int, path: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sharded = {
        "w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(4, 6), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("model.b", torch.zeros(10, dtype=torch.int64), replica_id=rank),
        "exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", torch.zeros(6, dtype=torch.float64),
                                                   (0, rank, world)),
    }
    return dist_checkpointing.load(sharded, path)


def test_sp_save_megatron_then_megatron_load(tmp_path) -> None:
    path = str(tmp_path / "sp_megatron")
    run_ranks(3, _sp_save, path)
    assert {"metadata.json", "common.pt", ".metadata"} <= set(os.listdir(path))
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f) == {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                "common_backend": "torch", "common_backend_version": 1}
    # What megatron-core's load reads as the common state (weights_only, as torch 2.13 defaults).
    assert torch.load(os.path.join(path, "common.pt"), weights_only=True) == SAVED_COMMON
    ref = reference()
    for rank, got in enumerate(run_ranks(2, _megatron_load, path)):
        assert bit_equal(got["w"], ref["model.w"][rank * 4:(rank + 1) * 4])
        assert bit_equal(got["b"], ref["model.b"])
        assert bit_equal(got["exp_avg"], ref["optimizer.exp_avg"][rank * 6:(rank + 1) * 6])
        assert {k: got[k] for k in SAVED_COMMON} == SAVED_COMMON
    # And shardpoint reads its own Megatron checkpoint back, objects from common.pt only.
    info = sp.inspect(path)
    assert set(info.objects) == {"iteration", "config.lr", "config.name", "config.layers", "opt.step"}
    full = sp.load_full(path)  # plain data: no allow_pickle
    assert {k: full[k] for k in SAVED_COMMON} == SAVED_COMMON


def test_cli_convert_to_and_from_megatron(megatron_ckpt: str, tmp_path) -> None:
    src, dst, native = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "native")
    w = reference()["model.w"]
    sp.save({"model": {"w": w}, "step": 5, "cfg": {"a": [1, 2], "name": "x"}}, src)
    converted = _cli("convert", src, dst, "--to", "megatron")
    assert converted.returncode == 0, converted.stderr
    assert torch.load(os.path.join(dst, "common.pt"), weights_only=True) == {"step": 5, "cfg": {"a": [1, 2], "name": "x"}}
    full = sp.load_full(dst)
    assert bit_equal(full["model"]["w"], w) and full["cfg"] == {"a": [1, 2], "name": "x"}
    # From Megatron to native: the common.pt objects are carried, the megatron.* attributes are not.
    converted = _cli("convert", megatron_ckpt, native, "--to", "native")
    assert converted.returncode == 0, converted.stderr
    info = sp.inspect(native)
    assert "config.name" in info.objects and not any(k.startswith("megatron.") for k in info.attributes)


def test_plain_save_over_megatron_removes_its_files(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    w = reference()["model.w"]
    sp.save({"model.w": w, "iteration": 1}, path, format="megatron")
    assert set(sp.inspect(path).objects) == {"iteration"}
    sp.save({"model.w": w, "step": 2}, path, format="torch-dcp", overwrite=True)
    assert not {"metadata.json", "common.pt"} & set(os.listdir(path))
    info = sp.inspect(path)
    assert set(info.objects) == {"step"} and not any(k.startswith("megatron.") for k in info.attributes)
