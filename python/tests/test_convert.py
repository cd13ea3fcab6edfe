"""shardpoint convert SRC DST --to native|torch-dcp, the command-line tool as installed.

Round trips native -> torch-dcp -> native and (torch-written, 4 ranks) DCP -> native -> torch-dcp,
compared bit for bit through sp.load_full and torch's dcp_to_torch_save; Hugging Face safetensors
directories; --files; the errors and exit codes; and the peak memory of converting a checkpoint
much larger than the memory budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardpoint as sp
from distributed import run_ranks
from torch_dcp_util import CLI, cli, differences, random_tensor, torch_metadata, writer


def convert(*args: str) -> subprocess.CompletedProcess:
    return cli("convert", *args)


def converted(src: str, dst: str, to: str, *extra: str) -> dict:
    """Runs a conversion that must succeed; returns its --json report."""
    run = convert(src, dst, "--to", to, "--json", *extra)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _ordered(value):
    """``value`` with every dict's keys sorted (the formats keep different key orders)."""
    if isinstance(value, dict):
        return {k: _ordered(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


def same(actual, expected) -> list[str]:
    return differences(_ordered(actual), _ordered(expected))


def torch_save_of(path: str, out: str) -> dict:
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _chunks(path: str) -> dict:
    return {k: sorted(t.chunks) for k, t in sp.inspect(path).tensors.items()}


# ---------------------------------------------------------------------------------------------
# native -> torch-dcp -> native

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]


def _native_state() -> dict:
    return {
        "model": {"layers": [{"w": random_tensor((6, 5), torch.bfloat16, 1), "cfg": {"act": "gelu", "k": 3}},
                             {"w": random_tensor((6, 5), torch.bfloat16, 2), "cfg": {"act": "relu", "k": 4}}],
                  "norm": random_tensor((5,), torch.float32, 3)},
        "dtypes": {str(d).removeprefix("torch."): random_tensor((3, 4), d, 10 + i) for i, d in enumerate(DTYPES)},
        "scalar": random_tensor((), torch.float64, 4),
        "empty": random_tensor((0, 3), torch.int32, 5),
        "big": random_tensor((300, 1024), torch.float32, 6),  # 1.2 MiB: read in more than one window
        "step": 42,
        "names": ["a", "ü ✓"],
        "flags": {"on": True, "off": None, "ratio": 0.125},
    }


@pytest.fixture(scope="module")
def native_source(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("convert") / "native")
    sp.save(_native_state(), path)
    return path


def test_native_to_torch_dcp_to_native(native_source, tmp_path):
    original = _native_state()
    as_dcp, back = str(tmp_path / "dcp"), str(tmp_path / "back")
    report = converted(native_source, as_dcp, "torch-dcp")
    tensors = sp.inspect(native_source).tensors
    assert (report["from"], report["to"], report["tensors"], report["objects"]) == ("native", "torch-dcp",
                                                                                    len(tensors), 9)
    assert report["bytes"] == sum(t.nbytes for t in tensors.values())
    assert os.path.exists(os.path.join(as_dcp, ".metadata"))
    md = torch_metadata(as_dcp)
    assert md.state_dict_metadata["dtypes.float8_e8m0fnu"].properties.dtype == torch.float8_e8m0fnu
    assert md.planner_data["model.layers.1.cfg.act"] == ("model", "layers", 1, "cfg", "act")
    assert same(torch_save_of(as_dcp, str(tmp_path / "dcp.pt")), original) == []
    layers = [{"w": torch.zeros(6, 5, dtype=torch.bfloat16), "cfg": {"act": "", "k": 0}} for _ in range(2)]
    template = {"model": {"layers": layers, "norm": torch.zeros(5)}, "big": torch.zeros(300, 1024), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.load(template, checkpoint_id=as_dcp, no_dist=True)
    assert same(template, {k: original[k] for k in ("model", "big", "step")}) == []

    report = converted(as_dcp, back, "native")
    assert (report["from"], report["to"]) == ("torch-dcp", "native")
    assert same(sp.load_full(back, allow_pickle=True), original) == []
    assert _chunks(back) == _chunks(native_source)
    assert sp.verify(back).ok


# ---------------------------------------------------------------------------------------------
# DCP written by torch at 4 ranks -> native -> torch-dcp

def _torch_state(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    full = _torch_full()
    d = lambda k, m, p: distribute_tensor(full[k], m, p, src_data_rank=None)  # noqa: E731
    return {"rows": d("rows", mesh, [Shard(0)]), "cols": d("cols", mesh, [Shard(1)]),
            "grid": d("grid", mesh2, [Shard(0), Shard(1)]), "rep": d("rep", mesh, [Replicate()]),
            "plain": full["plain"], "meta": {"step": 9, "lr": 0.5, "tags": ["x", "y"]}}


def _torch_full() -> dict:
    return {"rows": random_tensor((13, 4), torch.float32, 50), "cols": random_tensor((3, 10), torch.bfloat16, 51),
            "grid": random_tensor((7, 9), torch.int64, 52), "rep": random_tensor((5,), torch.float16, 53),
            "plain": random_tensor((2, 2), torch.uint8, 54)}


def torch_writes(rank, world, path):
    dcp.save(_torch_state(world), storage_writer=writer(path))


def test_torch_written_dcp_to_native_to_torch_dcp(tmp_path):
    source, native, again = str(tmp_path / "torch"), str(tmp_path / "native"), str(tmp_path / "again")
    run_ranks(4, torch_writes, source)
    expected = dict(_torch_full(), meta={"step": 9, "lr": 0.5, "tags": ["x", "y"]})
    assert len(torch_metadata(source).state_dict_metadata["grid"].chunks) == 4
    report = converted(source, native, "native")
    assert (report["from"], report["chunks"]) == ("torch-dcp", 4 + 4 + 4 + 1 + 1)
    # torch's objects hold plain data: stored as "plain" objects, read back with no allow_pickle.
    assert {o.encoding for o in sp.inspect(native).objects.values()} == {"plain"}
    assert same(sp.load_full(native), expected) == []
    assert _chunks(native) == _chunks(source)
    converted(native, again, "torch-dcp")
    theirs = torch_save_of(source, str(tmp_path / "theirs.pt"))
    ours = torch_save_of(again, str(tmp_path / "ours.pt"))
    assert same(ours, theirs) == [] and same(ours, expected) == []
    chunks = lambda p: {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)  # noqa: E731
                        for k, v in torch_metadata(p).state_dict_metadata.items() if hasattr(v, "chunks")}
    assert chunks(again) == chunks(source)


# ---------------------------------------------------------------------------------------------
# --files, Hugging Face sources, --overwrite

def test_files_option_spreads_the_chunks(native_source, tmp_path):
    native, as_dcp = str(tmp_path / "native"), str(tmp_path / "dcp")
    converted(native_source, native, "native", "--files", "3", "--threads", "1")  # reads and writes share one thread
    files = sp.inspect(native).files
    assert len(files) == 3 and all(f["bytes"] > 0 for f in files)
    assert sorted(f for f in os.listdir(native) if f.endswith(".safetensors")) == sorted(f["name"] for f in files)
    assert same(sp.load_full(native), _native_state()) == []
    converted(native_source, as_dcp, "torch-dcp", "--files", "3")
    names = sorted(f for f in os.listdir(as_dcp) if f != ".metadata")
    assert names == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp"]  # 3 for tensors, 1 for objects
    assert same(torch_save_of(as_dcp, str(tmp_path / "d.pt")), _native_state()) == []


def test_hugging_face_directory_to_native(tmp_path):
    from safetensors.torch import save_file

    hf, native = tmp_path / "hf", str(tmp_path / "native")
    hf.mkdir()
    tensors = {"model.embed.weight": random_tensor((11, 8), torch.bfloat16, 60),
               "model.layers.0.w": random_tensor((8, 8), torch.float32, 61),
               "model.layers.1.w": random_tensor((8, 8), torch.float32, 62),
               "lm_head.weight": random_tensor((11, 8), torch.float16, 63)}
    shards = {"model-00001-of-00002.safetensors": ["model.embed.weight", "model.layers.0.w"],
              "model-00002-of-00002.safetensors": ["model.layers.1.w", "lm_head.weight"]}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(hf / name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: name for name, keys in shards.items() for k in keys}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    report = converted(str(hf), native, "native")
    assert (report["from"], report["tensors"], report["objects"]) == ("safetensors", 4, 0)
    assert same(sp.load_full(native), tensors) == []  # no nested paths in the source: dotted keys
    assert sp.verify(native).ok


def test_existing_destination_needs_overwrite(native_source, tmp_path):
    dst = str(tmp_path / "dst")
    sp.save({"old": torch.ones(2)}, dst)
    run = convert(native_source, dst, "--to", "torch-dcp")
    assert run.returncode == 1 and dst in run.stderr and "overwrite" in run.stderr
    assert same(sp.load_full(dst), {"old": torch.ones(2)}) == []  # untouched
    converted(native_source, dst, "torch-dcp", "--overwrite")
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]  # no stale native files
    assert same(torch_save_of(dst, str(tmp_path / "d.pt")), _native_state()) == []


# ---------------------------------------------------------------------------------------------
# Errors and exit codes

def test_missing_source_is_exit_1_naming_it(tmp_path):
    missing = str(tmp_path / "nothing-here")
    run = convert(missing, str(tmp_path / "dst"), "--to", "native")
    assert run.returncode == 1 and missing in run.stderr, run.stderr
    assert not os.path.exists(tmp_path / "dst")


def test_same_source_and_destination_is_refused(native_source):
    for dst in (native_source, native_source + "/", native_source + "/./"):
        run = convert(native_source, dst, "--to", "torch-dcp", "--overwrite")
        assert run.returncode == 1 and "source and the destination" in run.stderr, (dst, run.stderr)
    assert sorted(os.listdir(native_source))[-1] == "shardpoint.metadata"
    assert same(sp.load_full(native_source), _native_state()) == []


@pytest.mark.parametrize("args", [["--to", "safetensors"], ["--to", "bogus"], [], ["--to", "native", "--files", "0"],
                                  ["--to", "native", "--memory-budget-mib", "x"], ["--to", "native", "--frobnicate"]])
def test_bad_arguments_are_exit_2_with_usage(native_source, tmp_path, args):
    run = convert(native_source, str(tmp_path / "dst"), *args)
    assert run.returncode == 2 and "usage: shardpoint convert" in run.stderr, run.stderr
    assert not os.path.exists(tmp_path / "dst")


def test_missing_destination_argument_is_exit_2(native_source):
    run = convert(native_source, "--to", "native")
    assert run.returncode == 2 and "expected SRC and DST" in run.stderr


# ---------------------------------------------------------------------------------------------
# Bounded memory: the peak RSS of a conversion of 608 MiB in 16 MiB chunks.

CHUNK_MIB, CHUNKS = 16, 38
MAKE_BIG = """
import sys, numpy as np, shardpoint as sp
sp.save({f"t{i}": np.full((%d,), i, dtype=np.float32) for i in range(%d)}, sys.argv[1])
""" % (CHUNK_MIB << 18, CHUNKS)
MEASURE = """
import resource, subprocess, sys
run = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(run.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, run.stderr.replace("\\n", " "))
"""


def peak_rss_mib(*args: str) -> float:
    """Runs the CLI from a fresh interpreter, so that its RUSAGE_CHILDREN peak is the CLI's own."""
    out = subprocess.run([sys.executable, "-c", MEASURE, CLI, *args], capture_output=True, text=True, timeout=120)
    code, kib, stderr = out.stdout.split(" ", 2)
    assert code == "0", stderr
    return int(kib) / 1024


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("big") / "native")
    subprocess.run([sys.executable, "-c", MAKE_BIG, path], check=True, timeout=120)  # not in this process
    return path


@pytest.mark.parametrize("to,budget_mib,threads", [("native", 64, 0), ("torch-dcp", 64, 0), ("native", 1, 8)])
def test_peak_memory_stays_within_largest_chunk_plus_budget(big_source, tmp_path, to, budget_mib, threads):
    # Regression (budget 1, 8 threads): chunk buffers freed to the heap stayed in the allocator's
    # per-thread arenas, so the peak grew to a chunk per thread (120 MiB) whatever the budget.
    allowance_mib = 96  # the program, its libraries, thread stacks, metadata
    tiny = str(tmp_path / "tiny")
    sp.save({"t": torch.zeros(4)}, tiny)
    baseline = peak_rss_mib("convert", tiny, str(tmp_path / "tiny-out"), "--to", to)
    dst = str(tmp_path / "out")
    peak = peak_rss_mib("convert", big_source, dst, "--to", to, "--memory-budget-mib", str(budget_mib),
                        "--threads", str(threads))
    total_mib = CHUNK_MIB * CHUNKS
    assert peak < CHUNK_MIB + budget_mib + allowance_mib < total_mib / 3, (peak, baseline)
    assert peak - baseline < max(CHUNK_MIB, budget_mib) + CHUNK_MIB, (peak, baseline)
    info = sp.inspect(dst)
    assert info.total_bytes == total_mib << 20 and len(info.tensors) == CHUNKS
    t37 = sp.load_full(dst, keys=["t37"])["t37"]
    assert t37.shape == (CHUNK_MIB << 18,) and bool((t37 == 37).all())
