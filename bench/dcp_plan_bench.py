"""Save planning at scale: torch DCP's planner against shardpoint's PlanSave, same layout, one run.

For each size RANKSxTENSORS it builds the local save plans of the 3-D parallel job that
bench/plan_bench.cc plans (tensors of RANKS*4 x 1024 bf16 on a (dp, fsdp, tp) mesh of tp 8: row
shards over every rank, TP columns replicated over FSDP, FSDP rows x TP columns, replicated
tensors, and one tensor in ten cut irregularly into row bands split at a varying column), as
DCP's ranks send them to its coordinator: one ``SavePlan`` per rank with a ``WriteItem`` per
tensor. It then times, in a child process of its own, what DCP's ``DefaultSavePlanner`` does
with them on the coordinator (``_create_global_plan``): ``dedup_save_plans`` (balanced by
bytes), ``create_default_global_save_plan`` and ``_validate_global_plan`` (bounds, overlaps,
coverage). In the same run, ``plan_bench RANKS TENSORS --plan-save-only`` times shardpoint's
PlanSave, which does the same work (dedup with balanced ownership, the proof that the chunks
tile every tensor) and lays out every rank's files and writes besides: on every rank's whole plan
(the boxes, as DCP receives them) and on the ruled plans a save sends (the layouts' rules), as a
native save plans them (grid tensors held as their cells, not as a chunk each). The
bench checks that both find the same stored chunks (their count and bytes, and up to about a
million chunks a digest of every chunk's box) and that DCP's validation finds no error; it exits
with 1 when they differ.

Sizes run in the order given; once DCP does not finish a size (building its plans or one
planning pass longer than --limit seconds, or out of memory under --memory-gib), larger ones are
skipped for DCP and only shardpoint runs them. DCP's times are medians of --runs passes (the
plans are built once per size, outside the timing); shardpoint's are medians of 5 (plan_bench).
Wall seconds.

    python bench/dcp_plan_bench.py                      # 1024x500, 2048x1000, 4096x1000, 8192x1000
    python bench/dcp_plan_bench.py --sizes 1024x500 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time

TP = 8  # as plan_bench.cc


def layout_box(t: int, rank: int, ranks: int, shape: tuple[int, int]) -> tuple[list, list]:
    """The box (offsets, sizes) rank ``rank`` holds of tensor ``t``: plan_bench.cc's LayoutBox."""
    fsdp = ranks // 128 * 16
    tp_rank, fsdp_rank = rank % TP, (rank // TP) % fsdp
    offsets, sizes = [0, 0], list(shape)
    if t % 10 == 9:  # irregular: ranks 2k and 2k + 1 split band k of 8 rows at a varying column
        band = rank // 2
        cut = 256 + (band * 37 + t) % 512
        offsets[0], sizes[0] = band * 8, 8
        offsets[1] = 0 if rank % 2 == 0 else cut
        sizes[1] = cut if rank % 2 == 0 else shape[1] - cut
        return offsets, sizes
    kind = t % 4
    if kind in (0, 2):  # rows over every rank, or over FSDP
        parts, index = (ranks, rank) if kind == 0 else (fsdp, fsdp_rank)
        sizes[0] = shape[0] // parts
        offsets[0] = sizes[0] * index
    if kind in (1, 2):  # columns over TP
        sizes[1] = shape[1] // TP
        offsets[1] = sizes[1] * tp_rank
    return offsets, sizes


def build_plans(ranks: int, tensors: int) -> list:
    """Every rank's DCP ``SavePlan`` of the layout: one SHARD ``WriteItem`` per tensor, each with
    objects of its own, as the coordinator holds them once the gathered plans are unpickled."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    shape = (ranks * 4, 1024)
    names = [f"model.layers.{t // 8}.w{t % 8}" for t in range(tensors)]
    plans = []
    for rank in range(ranks):
        items = []
        for t, name in enumerate(names):
            offsets, sizes = layout_box(t, rank, ranks, shape)
            offsets = torch.Size(offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(name, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(sizes)),
                        properties=TensorProperties(dtype=torch.bfloat16),
                        size=torch.Size(shape),
                    ),
                )
            )
        plans.append(SavePlan(items))
    return plans


def chunk_digest(state_dict_metadata: dict) -> int:
    """plan_bench.cc's ChunkDigest over DCP's metadata: FNV-1a over the tensors in name order,
    each name's bytes and then its chunks in (offsets, sizes) order, 8 bytes little-endian each."""
    h = 14695981039346656037
    for name in sorted(state_dict_metadata):
        data = bytearray(name.encode())
        for key in sorted(tuple(c.offsets) + tuple(c.sizes)
                          for c in state_dict_metadata[name].chunks):
            for v in key:
                data += (v & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
        for byte in data:
            h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def dcp_child(ranks: int, tensors: int, runs: int, limit: float, check_digest: bool) -> None:
    """Plans one size with DCP's planner and prints one JSON line per event (built, each pass,
    or the reason it stopped), so that the parent keeps what finished."""
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    def emit(**fields) -> None:
        print(json.dumps(fields), flush=True)

    def on_alarm(signum, frame):
        raise TimeoutError

    signal.signal(signal.SIGALRM, on_alarm)
    validate = getattr(default_planner, "_validate_global_plan", None)
    phase = "building its plans"
    try:
        start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, limit)
        plans = build_plans(ranks, tensors)
        phase = "one planning pass"
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit(event="built", seconds=time.perf_counter() - start,
             items=sum(len(p.items) for p in plans))
        first = True
        for _ in range(runs):
            signal.setitimer(signal.ITIMER_REAL, limit)
            t0 = time.perf_counter()
            deduped = dedup_save_plans(plans, False)
            t1 = time.perf_counter()
            global_plan, metadata = default_planner.create_default_global_save_plan(deduped)
            t2 = time.perf_counter()
            errors = validate(global_plan, metadata) if validate is not None else []
            t3 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, 0)
            chunks = chunk_bytes = 0
            for md in metadata.state_dict_metadata.values():
                chunks += len(md.chunks)
                for c in md.chunks:
                    chunk_bytes += 2 * c.sizes[0] * c.sizes[1]
            # The digest is hashed in Python, byte by byte: at the first pass of small sizes
            # only, where it is quick, to check the layout against plan_bench's.
            digest = (chunk_digest(metadata.state_dict_metadata)
                      if first and check_digest else None)
            first = False
            emit(event="pass", dedup_s=t1 - t0, global_s=t2 - t1,
                 validate_s=(t3 - t2) if validate is not None else None,
                 chunks=chunks, chunk_bytes=chunk_bytes, errors=len(errors), digest=digest,
                 peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            del deduped, global_plan, metadata
    except TimeoutError:
        emit(event="timeout", limit=limit, phase=phase)
    except MemoryError:
        emit(event="memory")


def run_dcp(ranks: int, tensors: int, runs: int, limit: float, memory_gib: float) -> dict:
    """Runs dcp_child in a process of its own, its address space capped at ``memory_gib``."""
    cap = int(memory_gib * (1 << 30))

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    # The layouts' digests are compared where hashing them in Python is quick (under about a
    # million chunks); above, the chunks' count and bytes are.
    check_digest = ranks * tensors <= 1 << 20
    command = [sys.executable, __file__, "--dcp-child", f"{ranks}x{tensors}", "--runs",
               str(runs), "--limit", str(limit)] + (["--check-digest"] if check_digest else [])
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=limit_memory, timeout=limit * (runs + 1) + 120)
    except subprocess.TimeoutExpired as e:  # stuck where its own timer could not stop it
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(command, None, out, "")
        proc.stdout += json.dumps({"event": "timeout", "limit": limit,
                                   "phase": "planning, nor exit"}) + "\n"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result = {"passes": [e for e in events if e["event"] == "pass"]}
    built = [e for e in events if e["event"] == "built"]
    result["built_s"] = built[0]["seconds"] if built else None
    result["items"] = built[0]["items"] if built else None
    stop = [e for e in events if e["event"] in ("timeout", "memory")]
    if stop:
        result["stopped"] = (f"did not finish {stop[0]['phase']} in {limit:g} s"
                             if stop[0]["event"] == "timeout"
                             else f"out of memory under {memory_gib:g} GiB")
    elif proc.returncode == -signal.SIGKILL:  # the kernel's out-of-memory killer, most likely
        result["stopped"] = "killed by SIGKILL (out of memory?)"
    elif proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        result["stopped"] = "failed: " + tail[0]
    return result


def run_shardpoint(plan_bench: str, ranks: int, tensors: int, threads: int | None) -> dict:
    """plan_bench's PlanSave medians for the size, parsed from its --plan-save-only line."""
    command = [plan_bench, str(ranks), str(tensors), "--plan-save-only"]
    if threads:
        command += ["--threads", str(threads)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("plan_save "))
    fields = dict(item.split("=") for item in line.split()[1:])
    return {k: (float(v) if k.endswith("_s") else int(v)) for k, v in fields.items()}


def seconds(value: float) -> str:
    return f"{value:.4f} s" if value < 0.1 else f"{value:.3f} s"


def parse_size(text: str) -> tuple[int, int]:
    ranks, _, tensors = text.partition("x")
    ranks, tensors = int(ranks), int(tensors)
    if ranks < 128 or ranks % 128 or tensors < 1:
        raise argparse.ArgumentTypeError(f"size {text!r}: RANKS (a multiple of 128) x TENSORS")
    return ranks, tensors


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024x500,2048x1000,4096x1000,8192x1000",
                        help="comma-separated RANKSxTENSORS, smallest first")
    parser.add_argument("--runs", type=int, default=3, help="DCP planning passes per size")
    parser.add_argument("--limit", type=float, default=600.0,
                        help="seconds one DCP pass (or building its plans) may take")
    parser.add_argument("--memory-gib", type=float, default=20.0,
                        help="address space of the DCP process, GiB")
    parser.add_argument("--plan-bench",
                        default=os.path.join(here, "..", "build", "bench", "plan_bench"))
    parser.add_argument("--threads", type=int, default=None,
                        help="plan_bench's pool (default: the engine's default pool size)")
    parser.add_argument("--dcp-child", type=parse_size, help=argparse.SUPPRESS)
    parser.add_argument("--check-digest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dcp_child:
        dcp_child(*args.dcp_child, args.runs, args.limit, args.check_digest)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    import torch

    print(f"dcp_plan_bench: torch {torch.__version__}, DCP passes: median of {args.runs}, "
          f"shardpoint: median of 5, wall seconds")
    header = ("| ranks x tensors | chunks | DCP dedup | DCP global plan | DCP validation "
              "| DCP total | sp PlanSave, whole plans | sp PlanSave, ruled plans (grid cells) "
              "| DCP / sp whole | DCP / sp ruled |")
    rows = []
    dcp_stopped = None
    failed = False
    for ranks, tensors in sizes:
        sp_times = run_shardpoint(args.plan_bench, ranks, tensors, args.threads)
        size = f"{ranks:,} x {tensors:,}"
        print(f"{size}: shardpoint PlanSave {seconds(sp_times['whole_s'])} on whole plans, "
              f"{seconds(sp_times['ruled_cells_s'])} on ruled plans, grid tensors as cells "
              f"({sp_times['chunks']:,} chunks, "
              f"{sp_times['threads']} threads)", flush=True)
        dcp = None if dcp_stopped else run_dcp(ranks, tensors, args.runs, args.limit,
                                               args.memory_gib)
        cells = [size, f"{sp_times['chunks']:,}"]
        if dcp is None:
            cells += ["not run: " + dcp_stopped, "", "", ""]
        elif not dcp["passes"]:
            dcp_stopped = f"{dcp['stopped']} at {size}"
            failed = failed or dcp["stopped"].startswith("failed")
            print(f"{size}: DCP {dcp['stopped']} (building its {dcp['items'] or '?'} items took "
                  f"{dcp['built_s'] if dcp['built_s'] is not None else '?'} s)", flush=True)
            cells += [dcp["stopped"], "", "", ""]
        else:
            passes = dcp["passes"]
            med = {k: statistics.median(p[k] for p in passes)
                   for k in ("dedup_s", "global_s")}
            has_validation = passes[0]["validate_s"] is not None
            med["validate_s"] = (statistics.median(p["validate_s"] for p in passes)
                                 if has_validation else 0.0)
            total = statistics.median(p["dedup_s"] + p["global_s"] + (p["validate_s"] or 0.0)
                                      for p in passes)
            same = all(p["chunks"] == sp_times["chunks"]
                       and p["chunk_bytes"] == sp_times["chunk_bytes"]
                       and p["digest"] in (None, sp_times["digest"])
                       and p["errors"] == 0 for p in passes)
            if not same:
                failed = True
                print(f"{size}: DCP and shardpoint disagree: DCP {passes[0]['chunks']} chunks, "
                      f"{passes[0]['chunk_bytes']} bytes, digest {passes[0]['digest']}, "
                      f"{passes[0]['errors']} validation errors; shardpoint "
                      f"{sp_times['chunks']} chunks, {sp_times['chunk_bytes']} bytes, digest "
                      f"{sp_times['digest']}", flush=True)
            print(f"{size}: DCP {total:.3f} s (dedup {med['dedup_s']:.3f}, global plan "
                  f"{med['global_s']:.3f}, validation "
                  f"{med['validate_s']:.3f}; {len(passes)} passes; its {dcp['items']:,} items "
                  f"built in {dcp['built_s']:.1f} s; peak resident set "
                  f"{max(p['peak_mib'] for p in passes):,.0f} MiB)", flush=True)
            cells += [seconds(med["dedup_s"]), seconds(med["global_s"]),
                      seconds(med["validate_s"]) if has_validation else "n/a", seconds(total)]
            if "stopped" in dcp:
                dcp_stopped = f"{dcp['stopped']} at {size}"
                cells[-1] += f" ({len(passes)} of {args.runs} passes; then {dcp['stopped']})"
        cells += [seconds(sp_times["whole_s"]), seconds(sp_times["ruled_cells_s"])]
        if dcp and dcp["passes"]:
            cells += [f"{total / sp_times['whole_s']:.1f}x",
                      f"{total / sp_times['ruled_cells_s']:.1f}x"]
        else:
            cells += ["", ""]
        rows.append("| " + " | ".join(cells) + " |")
    print()
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for row in rows:
        print(row)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
