"""FSDP2 over tensor parallelism on a 2-D (dp, tp) mesh, as torchtitan builds it: the parameters are
DTensors whose tensor-parallel dim is also sharded by FSDP (``_StridedShard`` on dp, ``Shard`` on tp).
Saved at 4 ranks, read back whole and into a plain 1-D layout at 2 ranks, bit-exact against
``full_tensor()``, and resumed on the same mesh to the losses of an uninterrupted run."""

from __future__ import annotations

import os

import torch
from torch import nn

import shardpoint as sp
from distributed import run_ranks

STEPS, SAVE_AT = 4, 2


def _setup():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 36), nn.ReLU(), nn.Linear(36, 12))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 12, generator=g)) for _ in range(STEPS)]
    return model, optimizer, batches


def _step(model, optimizer, batch) -> float:
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train(rank, world, path, phase):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor.placement_types import _StridedShard

    model, optimizer, batches = _setup()
    if phase == "uninterrupted":
        return [_step(model, optimizer, b) for b in batches]
    if phase == "save":
        losses = [_step(model, optimizer, b) for b in batches[:SAVE_AT]]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        strided = sorted(k for k, v in model_sd.items() if any(isinstance(p, _StridedShard) for p in v.placements))
        full = {k: v.full_tensor() for k, v in model_sd.items()}
        sp.save({"model": model_sd, "optim": optim_sd, "step": SAVE_AT}, path)
        return losses, strided, full
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    result = sp.load(state, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [_step(model, optimizer, b) for b in batches[state["step"]:]]


def load_1d(rank, world, path, shapes):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in shapes.items()}
    sp.load({"model": state}, path, strict=False)
    return {k: v.full_tensor() for k, v in state.items()}


def test_fsdp_over_tp_strided_shards_round_trip_and_resume(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(4, train, path, "uninterrupted")[0]
    saved = run_ranks(4, train, path, "save")
    losses, strided, full = saved[0]
    assert strided, "FSDP over TP produced no _StridedShard placement: the test would prove nothing"
    whole = sp.load_full(path, keys=["model"])["model"]
    for key, tensor in full.items():
        assert torch.equal(whole[key], tensor), key
    reloaded = run_ranks(2, load_1d, path, {k: tuple(v.shape) for k, v in full.items()})[1]
    for key, tensor in full.items():
        assert torch.equal(reloaded[key], tensor), key
    resumed = run_ranks(4, train, path, "resume")[0]
    assert losses + resumed == uninterrupted
