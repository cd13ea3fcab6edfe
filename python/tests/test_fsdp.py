"""FSDP2 (fully_shard) model and Adam state saved at 4 ranks, resumed at 2: training continues to the
losses of an uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardpoint as sp
from distributed import run_ranks

STEPS, SAVE_AT = 6, 3


def _setup(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8))  # 33: uneven shards
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)) for _ in range(STEPS)]
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

    model, optimizer, batches = _setup(world)
    if phase == "uninterrupted":
        return [_step(model, optimizer, b) for b in batches]
    if phase == "save":
        losses = [_step(model, optimizer, b) for b in batches[:SAVE_AT]]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sp.save({"model": model_sd, "optim": optim_sd, "step": SAVE_AT}, path)
        return losses
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    result = sp.load(state, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [_step(model, optimizer, b) for b in batches[state["step"]:]]


def test_fsdp2_adam_saved_at_4_resumed_at_2(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(4, train, path, "uninterrupted")[0]
    first = run_ranks(4, train, path, "save")[0]
    info = sp.inspect(path)
    assert info.world_size == 4
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in info.tensors)
    assert len(info.tensors["model.0.weight"].chunks) == 4
    resumed = run_ranks(2, train, path, "resume")
    assert resumed[0] == resumed[1]
    assert first == pytest.approx(uninterrupted[:SAVE_AT], rel=1e-6)
    assert resumed[0] == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5)
    full = sp.load_full(path, keys=["optim.param_groups"])
    assert full["optim"]["param_groups"][0]["lr"] == 1e-2
