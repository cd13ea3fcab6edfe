"""Consolidation to Hugging Face safetensors: sp.consolidate vs what users do today, in one run.

A checkpoint of about --gib GiB is written once by --ranks gloo ranks (DTensors sharded on dim 0),
by torch.distributed.checkpoint (--source-format dcp, the default) or by sp.save (sp). Then, median
of --runs runs each, in fresh child processes with the source evicted from the page cache first:
  shardpoint  sp.consolidate(source, out, max_shard_size)
  baseline    torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dcp_source, file.pt),
              torch.load, then safetensors.torch.save_file per shard (size-based, like
              save_pretrained) plus model.safetensors.index.json
(the baseline always reads the DCP copy, which is written beside an sp source). Both sides fsync
their outputs, so the times are durable writes. Reported: wall seconds inside the child (imports
excluded), GB/s of tensor bytes, the child's peak RSS (its VmHWM), and the ratios. The last
run's outputs are compared tensor by tensor.

    python bench/consolidate_bench.py --dir /mnt/fast/bench --gib 2 --runs 3
    python bench/consolidate_bench.py --gib 0.05 --hidden 256 --runs 1      # a quick smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_util import evict


def layer_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    return {"attn.wq": (hidden, hidden), "attn.wk": (hidden, hidden), "attn.wv": (hidden, hidden),
            "attn.wo": (hidden, hidden), "mlp.w1": (2 * hidden, hidden), "mlp.w2": (hidden, 2 * hidden),
            "mlp.w3": (2 * hidden, hidden)}


def state_shapes(gib: float, hidden: int) -> dict[str, tuple[int, int]]:
    """float32 tensor shapes of about ``gib`` GiB: an embedding and transformer layers."""
    per_layer = sum(r * c for r, c in layer_shapes(hidden).values()) * 4
    layers = max(1, round((gib * (1 << 30) - 8 * hidden * hidden * 4) / per_layer))
    shapes = {"model.embed.weight": (8 * hidden, hidden)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes(hidden).items()})
    return shapes


def _write_rank(rank: int, world: int, rendezvous: str, args: argparse.Namespace, targets: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for i, (name, (rows, cols)) in enumerate(state_shapes(args.gib, args.hidden).items()):
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.randn(rows // world, cols, generator=g)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    for target in targets:
        if target.endswith("dcp"):
            dcp.save(state, checkpoint_id=target)
        else:
            import shardpoint as sp

            sp.save(state, target)
    dist.barrier()
    dist.destroy_process_group()


def write_sources(args: argparse.Namespace, dcp_dir: str, sp_dir: str) -> None:
    import torch.multiprocessing as mp

    targets = [dcp_dir] + ([sp_dir] if args.source_format == "sp" else [])
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_write_rank, args=(args.ranks, os.path.join(tmp, "rdv"), args, targets),
                           nprocs=args.ranks, join=True, start_method="spawn")


# ---- children -----------------------------------------------------------------------------------

def _fsync_all(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def child_shardpoint(source: str, out: str, max_shard: str, threads: int) -> float:
    import shardpoint as sp

    start = time.perf_counter()
    sp.consolidate(source, out, max_shard_size=max_shard, threads=threads or None)
    return time.perf_counter() - start


def child_baseline(source: str, out: str, max_shard: str, _threads: int) -> float:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import shardpoint as sp

    limit = sp._core.parse_byte_size(max_shard)
    start = time.perf_counter()
    os.makedirs(out)
    full = os.path.join(out, "full.pt")
    dcp_to_torch_save(source, full)
    state = torch.load(full, weights_only=True)
    os.remove(full)
    shards, size = [[]], 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n].contiguous() for n in names}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    _fsync_all(out)
    return time.perf_counter() - start


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM; its own address space only), 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(method: str, source: str, out: str, args: argparse.Namespace) -> tuple[float, int]:
    """Runs one consolidation in a fresh process; returns (seconds inside it, peak RSS bytes).

    The child reports its own VmHWM: wait4's ru_maxrss would also count the parent's pages
    between fork and exec (the parent has torch loaded). ru_maxrss is the fallback."""
    env = dict(os.environ, SHARDPOINT_QUIET="1")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", method, source, out,
                             args.max_shard_size, str(args.threads)], stdout=subprocess.PIPE, env=env, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} child failed with exit status {proc.returncode}")
    secs, hwm = output.strip().splitlines()[-1].split()
    return float(secs), int(hwm) or usage.ru_maxrss * 1024


def compare(a: str, b: str) -> int:
    import torch
    from safetensors.torch import load_file

    def read(d: str) -> dict:
        out = {}
        for name in os.listdir(d):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, name)))
        return out

    x, y = read(a), read(b)
    assert set(x) == set(y), sorted(set(x) ^ set(y))[:5]
    for k in x:
        assert torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)), k
    return len(x)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        method, source, out, max_shard, threads = sys.argv[2:7]
        fn = child_shardpoint if method == "shardpoint" else child_baseline
        secs = fn(source, out, max_shard, int(threads))
        print(secs, peak_rss())
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one under the cwd)")
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--hidden", type=int, default=2048, help="model width (sets tensor sizes)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--source-format", choices=["dcp", "sp"], default="dcp")
    p.add_argument("--max-shard-size", default="500MB")
    p.add_argument("--threads", type=int, default=0, help="sp.consolidate threads (0: its default)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    if args.hidden % args.ranks:
        p.error("--hidden must be a multiple of --ranks")

    work = args.dir or tempfile.mkdtemp(prefix="consolidate_bench.", dir=os.getcwd())
    os.makedirs(work, exist_ok=True)
    dcp_dir, sp_dir = os.path.join(work, "source.dcp"), os.path.join(work, "source.sp")
    try:
        t = time.perf_counter()
        write_sources(args, dcp_dir, sp_dir)
        total = sum(r * c * 4 for r, c in state_shapes(args.gib, args.hidden).values())
        print(f"source: {total / 2**30:.2f} GiB of float32 in {len(state_shapes(args.gib, args.hidden))} tensors, "
              f"{args.ranks} ranks, {args.source_format} (written in {time.perf_counter() - t:.1f} s); "
              f"shards of {args.max_shard_size}")
        source = dcp_dir if args.source_format == "dcp" else sp_dir
        results: dict[str, list[tuple[float, int]]] = {"shardpoint": [], "baseline": []}
        for run in range(args.runs):
            for method, src in (("shardpoint", source), ("baseline", dcp_dir)):
                out = os.path.join(work, f"out.{method}")
                shutil.rmtree(out, ignore_errors=True)
                evict(src)
                results[method].append(run_child(method, src, out, args))
                secs, rss = results[method][-1]
                print(f"  run {run + 1} {method:10s} {secs:7.2f} s  {total / secs / 1e9:6.2f} GB/s  "
                      f"peak RSS {rss / 2**20:8.1f} MiB", flush=True)
        print(f"outputs equal: {compare(os.path.join(work, 'out.shardpoint'), os.path.join(work, 'out.baseline'))} "
              "tensors, bit for bit")
        med = {m: (statistics.median(s for s, _ in r), statistics.median(m_ for _, m_ in r))
               for m, r in results.items()}
        print(f"\nmedian of {args.runs} run(s):")
        for m, (secs, rss) in med.items():
            print(f"  {m:10s} {secs:7.2f} s  {total / secs / 1e9:6.2f} GB/s  peak RSS {rss / 2**20:8.1f} MiB")
        print(f"  speed-up {med['baseline'][0] / med['shardpoint'][0]:.2f}x, "
              f"peak memory {med['baseline'][1] / med['shardpoint'][1]:.2f}x lower with shardpoint")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:
            for name in ("source.dcp", "source.sp", "out.shardpoint", "out.baseline"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)


if __name__ == "__main__":
    main()
