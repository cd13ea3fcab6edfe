"""Expert parallelism: experts saved as slices of the global expert tensor, loaded at other EP sizes."""

from __future__ import annotations

import os

import torch
from torch import nn

import shardpoint as sp
from distributed import run_ranks

EXPERTS = 8


class MoE(nn.Module):
    def __init__(self, local_experts: int):
        super().__init__()
        self.gate = nn.Linear(6, EXPERTS, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.zeros(local_experts, 6, 4))
        self.experts.w2 = nn.Parameter(torch.zeros(local_experts, 4, 6))


def global_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"gate.weight": torch.randn(EXPERTS, 6, generator=g), "experts.w1": torch.randn(EXPERTS, 6, 4, generator=g),
            "experts.w2": torch.randn(EXPERTS, 4, 6, generator=g)}


def build(ep_rank: int, ep_size: int, filled: bool) -> MoE:
    n = EXPERTS // ep_size
    model = MoE(n)
    if filled:
        ref = global_weights()
        with torch.no_grad():
            model.gate.weight.copy_(ref["gate.weight"])
            model.experts.w1.copy_(ref["experts.w1"][ep_rank * n:(ep_rank + 1) * n])
            model.experts.w2.copy_(ref["experts.w2"][ep_rank * n:(ep_rank + 1) * n])
    return model


def save_moe(rank, world, path):
    model = build(rank, world, filled=True)
    state = sp.mark_experts({"model": model.state_dict()}, ep_group=torch.distributed.group.WORLD,
                            predicate=lambda key: ".experts." in key)
    sp.save(state, path)


def load_moe(rank, world, path):
    model = build(rank, world, filled=False)
    state = sp.mark_experts({"model": model.state_dict()}, ep_rank=rank, ep_size=world, model=model,
                            modules=[model.experts])
    assert isinstance(state["model"]["experts.w1"], sp.ExpertShard)
    assert not isinstance(state["model"]["gate.weight"], sp.ExpertShard)
    sp.load(state, path)
    expected = build(rank, world, filled=True).state_dict()
    return all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_expert_parallel_resize(tmp_path):
    at4, at2, at8 = str(tmp_path / "ep4"), str(tmp_path / "ep2"), str(tmp_path / "ep8")
    run_ranks(4, save_moe, at4)
    info = sp.inspect(at4)
    assert info.tensors["model.experts.w1"].shape == (EXPERTS, 6, 4)
    assert sorted(info.tensors["model.experts.w1"].chunks) == [((2 * r, 0, 0), (2, 6, 4)) for r in range(4)]
    assert run_ranks(2, load_moe, at4) == [True, True]                  # EP 4 -> 2
    run_ranks(2, save_moe, at2)
    assert run_ranks(4, load_moe, at2) == [True] * 4                    # EP 2 -> 4
    run_ranks(8, save_moe, at8)
    assert run_ranks(4, load_moe, at8) == [True] * 4                    # EP 8 -> 4
    ref = global_weights()
    full = sp.load_full(at4)                                             # EP 4 -> 1, no template
    assert all(torch.equal(full["model"][k], v) for k, v in ref.items())
    model = build(0, 1, filled=False)
    sp.load(sp.mark_experts({"model": model.state_dict()}, ep_rank=0, ep_size=1, predicate=lambda k: "experts" in k), at2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
