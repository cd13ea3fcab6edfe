"""Writes testdata/megatron/: a megatron-core 0.16.1 torch_dist checkpoint saved by 4 gloo ranks.

Regenerate (from the repository root, with the project's venv):
    build/venv/bin/python shardpoint/format/torch_dcp/testdata/make_megatron_testdata.py \
        shardpoint/format/torch_dcp/testdata/megatron

Layout: tensor parallel 2 x data parallel 2. "model.w" (8x6 float32, seeded randn) is split in
two along dim 0 (one chunk per TP rank, DP replicas not written); "model.b" (int64 0..9) is
replicated on all ranks. common.pt holds {"iteration": 7, "args": argparse.Namespace(lr=0.1),
"nested": {"x": [1, 2], "s": "hi"}}. megatron-core on CPU needs torch.cuda.synchronize and
torch.cuda.current_device replaced; that is done here, in the generator only.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def entry(rank: int, world_size: int, rendezvous: str, path: str) -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, dp = rank % 2, rank // 2
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    state = {
        "w": ShardedTensor.from_rank_offsets("model.w", w[tp * 4:(tp + 1) * 4].clone(), (0, tp, 2), replica_id=dp),
        "b": ShardedTensor.from_rank_offsets("model.b", torch.arange(10), replica_id=rank),
        "iteration": 7, "args": argparse.Namespace(lr=0.1), "nested": {"x": [1, 2], "s": "hi"},
    }
    dist_checkpointing.save(state, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(entry, args=(4, os.path.join(tmp, "rdv"), out), nprocs=4, join=True,
                           start_method="spawn")
