"""Writes the torch 2.13 fixtures of shardpoint/format/torch_dcp's tests.

Regenerate (from the repository root, with the project's venv that has torch 2.13 CPU):
    build/venv/bin/python shardpoint/format/torch_dcp/testdata/make_testdata.py \
        shardpoint/format/torch_dcp/testdata

Outputs (all small):
  plain/            dcp.save of a flat state dict: tensors (f32, bf16, int8, a 0-d f64, an empty
                    tensor) and BYTE_IO items (int, str, float, list, tuple)
  sharded/          dcp.save by 2 gloo ranks of a nested state dict: DTensors sharded on dim 0
                    and dim 1 (two chunks per key), a replicated tensor, optimizer-like BYTE_IO
                    entries with list indexes in planner_data
  zstd/             dcp.save with the ZStandard stream transform
  metadata_p2.metadata, metadata_p5.metadata
                    the plain checkpoint's Metadata pickled with protocols 2 and 5
  tensor_f32.pt, tensor_u16.pt, tensor_transposed.pt, tensor_empty.pt, tensor_scalar.pt,
  state_dict.pt (nn.Linear state dict), object.pt (plain data)
                    torch.save into a buffer (archive folder "archive/")
Saved data is deterministic; `.metadata` files embed a random save_id.
"""
import io
import os
import pickle
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def save_buffer(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def make_plain(out):
    state = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "i8": torch.tensor([-3, 7, 127], dtype=torch.int8),
        "scalar": torch.tensor(2.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "step": 5,
        "name": "run-1",
        "lr": 0.125,
        "ids": [1, 2, 3],
        "betas": (0.9, 0.999),
    }
    dcp.save(state, checkpoint_id="plain")
    with open("plain/.metadata", "rb") as f:
        md = pickle.load(f)
    for protocol in (2, 5):
        with open(f"metadata_p{protocol}.metadata", "wb") as f:
            pickle.dump(md, f, protocol=protocol)


def sharded_worker(rank, out):
    os.chdir(out)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:29517")
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    rows = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cols = (torch.arange(12, dtype=torch.float32) / 4).reshape(2, 6).to(torch.bfloat16)
    state = {
        "model": {
            "layers": [{"w": distribute_tensor(rows, mesh, [Shard(0)])},
                       {"w": distribute_tensor(cols, mesh, [Shard(1)])}],
            "bias": torch.tensor([0.5, 1.5, 2.5]),
        },
        "optim": {"step": 3, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]},
    }
    dcp.save(state, checkpoint_id="sharded")
    dist.destroy_process_group()


def make_zstd(out):
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.arange(64, dtype=torch.int64).reshape(8, 8), "note": "compressed"}
    writer = dcp.FileSystemWriter("zstd", _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer)


def make_torch_save(out):
    save_buffer(torch.arange(6, dtype=torch.float32).reshape(2, 3), "tensor_f32.pt")
    save_buffer(torch.tensor([1, 2, 65535], dtype=torch.uint16), "tensor_u16.pt")
    save_buffer(torch.arange(6, dtype=torch.int32).reshape(2, 3).t(), "tensor_transposed.pt")
    save_buffer(torch.zeros(0, 3), "tensor_empty.pt")
    save_buffer(torch.tensor(7, dtype=torch.int64), "tensor_scalar.pt")
    torch.manual_seed(0)
    save_buffer(torch.nn.Linear(2, 3).state_dict(), "state_dict.pt")
    save_buffer({"lr": 0.1, "n": None, "ok": True, "big": 2**40, "neg": -3, "t": (1, "a"),
                 "l": [1.5, "x"], "b": b"\x00\xff"}, "object.pt")


def main():
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    os.chdir(out)
    for d in ("plain", "sharded", "zstd"):
        shutil.rmtree(d, ignore_errors=True)
    make_plain(out)
    torch.multiprocessing.spawn(sharded_worker, args=(out,), nprocs=2)
    make_zstd(out)
    make_torch_save(out)


if __name__ == "__main__":
    main()
