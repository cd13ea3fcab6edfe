"""A small FSDP2 (``fully_shard``) model, its Adam optimizer and a fixed series of batches, shared by
the tests that save, resume and compare training runs."""

from __future__ import annotations

import torch
from torch import nn


def fsdp_setup(world: int, dims: tuple[int, int, int] = (12, 35, 6), batch: int = 16, steps: int = 6):
    """Linear(dims[0], dims[1]) - ReLU - Linear(dims[1], dims[2]), fully sharded over a 1-D mesh of
    ``world`` ranks (an odd hidden size gives uneven shards), Adam, and ``steps`` batches; all from
    fixed seeds, so every run starts the same."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2]))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, dims[0], generator=g), torch.randn(batch, dims[2], generator=g))
               for _ in range(steps)]
    return model, optimizer, batches


def train(model, optimizer, batches) -> list[float]:
    """One optimizer step per batch (MSE loss); the losses."""
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
