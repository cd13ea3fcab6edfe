"""FSDP2 (fully_shard) model and Adam state saved at 4 ranks, resumed at 2: training continues to the
losses of an uninterrupted run."""

from __future__ import annotations

import pytest

import shardpoint as sp
from distributed import run_ranks
from fsdp_util import fsdp_setup
from fsdp_util import train as fsdp_train

STEPS, SAVE_AT = 6, 3


def train(rank, world, path, phase):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, batches = fsdp_setup(world, dims=(16, 33, 8), batch=32, steps=STEPS)
    if phase == "uninterrupted":
        return fsdp_train(model, optimizer, batches)
    if phase == "save":
        losses = fsdp_train(model, optimizer, batches[:SAVE_AT])
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sp.save({"model": model_sd, "optim": optim_sd, "step": SAVE_AT}, path)
        return losses
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    result = sp.load(state, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return fsdp_train(model, optimizer, batches[state["step"]:])


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
