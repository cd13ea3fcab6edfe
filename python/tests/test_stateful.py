"""Stateful values (``state_dict()`` / ``load_state_dict()``) in sp.save / sp.load / sp.async_save and
the CheckpointManager, handled as torch.distributed.checkpoint handles them: at the top level only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpoint as sp


class TrainState:
    """A Stateful holding plain values and a tensor, like a trainer's step counter."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.losses = [0.5 * step]
        self.rng = torch.arange(4, dtype=torch.int64) * step
        self.loaded_with: dict | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "losses": list(self.losses), "rng": self.rng}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded_with = state_dict
        self.step = state_dict["step"]
        self.losses = state_dict["losses"]
        self.rng = state_dict["rng"].clone()


class OptimizerState:
    """An optimizer as a Stateful with FQN keys (as torchtitan's OptimizersContainer): a raw
    ``optimizer.state_dict()`` has int keys, which neither DCP's nor shardpoint's keys can hold."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _assert_same(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for p in sa["state"]:
        for k in sa["state"][p]:
            assert torch.equal(sa["state"][p][k], sb["state"][p][k]), (p, k)


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Another model whose optimizer has state (a template needs the state's tensors, as with DCP)."""
    return _trained(seed=7)


def test_top_level_stateful_round_trip(tmp_path):
    model, optimizer, scheduler = _trained(seed=0)
    sp.save({"model": model, "optim": OptimizerState(model, optimizer), "sched": scheduler, "train_state": TrainState(5), "epoch": 2},
            tmp_path / "ckpt")
    info = sp.inspect(tmp_path / "ckpt")
    assert {"model.0.weight", "optim.state.0.weight.exp_avg", "train_state.rng"} <= set(info.tensors)
    assert {"train_state.step", "sched.last_epoch", "optim.param_groups.0.lr"} <= set(info.objects)

    model2, optimizer2, scheduler2 = _fresh()
    state = TrainState(0)
    target = {"model": model2, "optim": OptimizerState(model2, optimizer2), "sched": scheduler2, "train_state": state, "epoch": 0}
    result = sp.load(target, tmp_path / "ckpt")
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same(model, model2, optimizer, optimizer2)
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert target["model"] is model2 and target["train_state"] is state  # Stateful values stay in place
    assert target["epoch"] == 2
    assert state.step == 5 and state.losses == [2.5] and torch.equal(state.rng, torch.arange(4) * 5)
    assert set(state.loaded_with) == {"step", "losses", "rng"}


def test_stateful_key_is_found_by_load(tmp_path):
    """Regression: sp.load said "key 'train_state' is not in the checkpoint" although
    train_state.step was stored."""
    sp.save({"train_state": TrainState(3)}, tmp_path / "ckpt")
    assert set(sp.inspect(tmp_path / "ckpt").objects) == {"train_state.step", "train_state.losses"}
    state = TrainState(0)
    sp.load({"train_state": state}, tmp_path / "ckpt")
    assert state.step == 3
    full = sp.load_full(tmp_path / "ckpt")
    assert full["train_state"]["step"] == 3 and torch.equal(full["train_state"]["rng"], torch.arange(4) * 3)


def test_nested_stateful_is_not_unwrapped(tmp_path):
    """As dcp.save: only top-level values are asked for their state_dict(); a Stateful deeper down is
    an object like any other (so it needs pickle)."""
    with pytest.raises(sp.CheckpointArgumentError, match=r"'trainer.state' holds a test_stateful.TrainState"):
        sp.save({"trainer": {"state": TrainState(1)}}, tmp_path / "ckpt")
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(tmp_path / "ckpt")


def test_async_save_of_stateful(tmp_path):
    model, optimizer, _ = _trained(seed=0)
    sp.async_save({"model": model, "optim": OptimizerState(model, optimizer), "train_state": TrainState(4)}, tmp_path / "ckpt").wait()
    model2, optimizer2, _ = _fresh()
    state = TrainState(0)
    sp.load({"model": model2, "optim": OptimizerState(model2, optimizer2), "train_state": state}, tmp_path / "ckpt")
    _assert_same(model, model2, optimizer, optimizer2)
    assert state.step == 4


def test_checkpoint_manager_with_stateful(tmp_path):
    manager = sp.CheckpointManager(tmp_path / "run", keep_last=2)
    model, optimizer, scheduler = _trained(seed=0)
    for step in (10, 20, 30):
        manager.save(step, {"model": model, "optim": OptimizerState(model, optimizer), "sched": scheduler, "train_state": TrainState(step)})
    assert [e.step for e in manager.list()] == [20, 30]
    model2, optimizer2, scheduler2 = _fresh()
    state = TrainState(0)
    step, result = manager.load_latest({"model": model2, "optim": OptimizerState(model2, optimizer2), "sched": scheduler2,
                                        "train_state": state})
    assert step == 30 and result.missing_keys == []
    assert state.step == 30
    _assert_same(model, model2, optimizer, optimizer2)
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_failed_load_leaves_stateful_untouched(tmp_path):
    sp.save({"train_state": {"step": 1}}, tmp_path / "ckpt")
    state = TrainState(9)
    with pytest.raises(sp.CheckpointNotFoundError, match=r"train_state\.(losses|rng)"):
        sp.load({"train_state": state}, tmp_path / "ckpt")
    assert state.step == 9 and state.loaded_with is None
