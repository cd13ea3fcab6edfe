"""The core's communicator over torch.distributed (shardpoint._dist.TorchComm) on real gloo ranks:
every collective returns exactly the bytes each rank gave, whatever their lengths against the
slots the collectives carry them in, and a payload that fits its slot costs one collective."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from distributed import run_ranks
from shardpoint import _core, _dist

WORLD = 3
INLINE = _dist.rank_slot_bytes(WORLD) - 8
BROADCAST_INLINE = 64 * 1024 - 8
# Lengths around the slots' edges; each case gives each rank a different one, so that some ranks
# overflow their slot while others do not.
CASES = [
    (0, 0, 0),
    (1, 0, 17),
    (INLINE - 1, INLINE, INLINE + 1),
    (INLINE + 1, 5, 0),
    (0, 3 * INLINE + 7, 1),
    (1 << 20, 1 << 20, 1 << 20),
    (BROADCAST_INLINE, BROADCAST_INLINE + 1, 2),
]


def payload(case: int, rank: int, length: int) -> bytes:
    """Bytes that differ with the case, the rank and the position."""
    pattern = bytes((case * 31 + rank * 7 + i) % 251 for i in range(251))
    return (pattern * (length // 251 + 1))[:length]


class CountingDist:
    """torch.distributed with its collectives and point-to-point calls counted."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        target = getattr(dist, name)
        if name not in ("all_gather", "gather", "scatter", "broadcast", "send", "recv", "isend",
                        "irecv", "all_to_all_single", "all_reduce"):
            return target

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args, **kwargs)
        return counted


def check_cases(comm: _dist.TorchComm, cases: list[tuple[int, ...]]) -> list:
    """Every collective of ``comm`` with each root on each case's lengths; the mismatches."""
    failures = []
    rank, world = comm.rank, comm.size
    for case, lengths in enumerate(cases):
        expected = [payload(case, r, lengths[r]) for r in range(world)]
        mine = expected[rank]
        gathered = comm.all_gather(mine)
        if gathered != expected:
            failures.append(("all_gather", case, [len(g) for g in gathered]))
        for root in range(world):
            at_root = comm.gather(mine, root)
            if rank == root and at_root != expected:
                failures.append(("gather", case, root, [len(g) for g in at_root]))
            if rank != root and at_root is not None:
                failures.append(("gather returned data off the root", case, root))
            got = comm.scatter(expected if rank == root else None, root)
            if got != expected[rank]:
                failures.append(("scatter", case, root, len(got)))
            sent = comm.broadcast(expected[root] if rank == root else None, root)
            if sent != expected[root]:
                failures.append(("broadcast", case, root, len(sent)))
    return failures


def exercise(rank: int, world: int) -> list:
    comm = _dist.TorchComm(dist.group.WORLD)
    failures = check_cases(comm, CASES)
    flags = [comm.any_rank(False), comm.any_rank(rank == world - 1), comm.any_rank(True)]
    if flags != [False, True, True]:
        failures.append(("any_rank", flags))
    # A group of the last two ranks: its roots are group ranks, its messages go to global ranks.
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        failures += [("group of ranks 1 and 2",) + f
                     for f in check_cases(_dist.TorchComm(sub), [(0, INLINE + 9), (3 * INLINE, 1), (5, 6)])]
    # A payload within its slot: one collective and nothing else; one past it: a second
    # all-gather / broadcast, or one message per overflowing rank for gather and scatter.
    counting = CountingDist()
    comm._dist = counting
    comm.all_gather(b"x" * INLINE)
    comm.gather(b"x" * INLINE, 0)
    comm.scatter([b"x" * INLINE] * world if rank == 0 else None, 0)
    comm.broadcast(b"x" * BROADCAST_INLINE if rank == 0 else None, 0)
    fitting = dict(counting.calls)
    counting.calls.clear()
    over = b"x" * (INLINE + 1) if rank == 1 else b""
    comm.all_gather(over)
    comm.gather(over, 0)
    comm.scatter([b"", b"x" * (INLINE + 1)] + [b""] * (world - 2) if rank == 0 else None, 0)
    comm.broadcast(b"x" * (BROADCAST_INLINE + 1) if rank == 0 else None, 0)
    return [failures, fitting, dict(counting.calls)]


def test_collectives_return_every_payload_whatever_its_length():
    results = run_ranks(WORLD, exercise)
    for rank, (failures, fitting, overflowing) in enumerate(results):
        assert failures == [], f"rank {rank}"
        assert fitting == {"all_gather": 1, "gather": 1, "scatter": 1, "broadcast": 1}, f"rank {rank}"
        # Rank 1 overflows: a second all-gather everywhere, its tail sent to rank 0 for the
        # gather, rank 0 sending it its scatter tail, and a second broadcast everywhere.
        expected = {"all_gather": 2, "gather": 1, "scatter": 1, "broadcast": 2}
        if rank == 0:
            expected.update(recv=1, send=1)
        if rank == 1:
            expected.update(send=1, recv=1)
        assert overflowing == expected, f"rank {rank}"


def peers_of(world: int, pattern: int) -> list[list[int]]:
    """Who sends to whom in each pattern of the exchange test: rank s sends to the ranks in
    ``peers_of(...)[s]``."""
    if pattern == 0:
        return [[(s + 1) % world] for s in range(world)]  # a ring
    if pattern == 1:
        return [list(range(world)) for _ in range(world)]  # everyone, itself included
    return [[0] if s else [] for s in range(world)]  # all to rank 0, which sends nothing


def exchange(rank: int, world: int) -> list:
    comm = _dist.TorchComm(dist.group.WORLD)
    failures = []
    for pattern in range(3):
        to = peers_of(world, pattern)
        for lengths in ((0, 1, 5), (1 << 20, 3, 0)):
            sends = [(q, bytearray(payload(pattern * 10 + q, rank, lengths[(rank + q) % 3])))
                     for q in to[rank]]
            sources = [s for s in range(world) if rank in to[s]]
            got = comm.exchange_with_peers(sends, sources)
            expected = [payload(pattern * 10 + rank, s, lengths[(s + rank) % 3]) for s in sources]
            if [bytes(g) for g in got] != expected:
                failures.append((pattern, lengths, [len(g) for g in got]))
    # A ring: two point-to-point messages to one peer and two from another (lengths, then data),
    # no collective.
    counting = CountingDist()
    comm._dist = counting
    comm.exchange_with_peers([((rank + 1) % world, bytearray(b"abc"))], [(rank - 1) % world])
    return [failures, dict(counting.calls)]


def test_exchange_with_peers_moves_bytes_between_the_peers_alone():
    for rank, (failures, calls) in enumerate(run_ranks(WORLD, exchange)):
        assert failures == [], f"rank {rank}"
        assert calls == {"isend": 2, "irecv": 2}, f"rank {rank}"


def load_between_machines(rank: int, world: int, path: str, budget: int) -> tuple:
    """Saves row blocks of a tensor, then loads column blocks while each rank's host is another:
    the load shares its reads through the comm's exchange_with_peers, counted here; a ``budget``
    (bytes, 0 for the default) small enough cuts the exchange into rounds, read unverified."""
    _dist._hosts = lambda comm: [b"node-%d" % r for r in range(comm.size)]
    comm = _dist.TorchComm(dist.group.WORLD)
    peers = comm.exchange_with_peers
    calls = []
    comm.exchange_with_peers = lambda sends, sources: calls.append(len(sources)) or peers(sends, sources)
    full = np.arange(96 * 48, dtype=np.float32).reshape(96, 48)
    rows, cols = 96 // world, 48 // world
    block = np.ascontiguousarray(full[rank * rows:(rank + 1) * rows])
    _core.save(path, [("w", "float32", full.shape, [((rank * rows, 0), block.shape, block)])], [],
               _core.SaveOptions(comm=comm))
    out = np.zeros((96, cols), dtype=np.float32)
    options = _core.LoadOptions(comm=comm)
    if budget:
        # Unverified, so that bands of rows need not begin on the checksum blocks (of 1 MiB, and
        # so one a chunk here).
        options.memory_budget_bytes = budget
        options.verify_checksums = False
    result = _core.load(path, [("w", "float32", full.shape, [((0, rank * cols), out.shape, out)])], [],
                        options)
    exact = out.tobytes() == np.ascontiguousarray(full[:, rank * cols:(rank + 1) * cols]).tobytes()
    return exact, result[3], calls


@pytest.mark.parametrize("budget", [0, 3 * 4096])
def test_a_load_between_machines_sends_the_shared_regions_between_peers(tmp_path, budget):
    """3 gloo processes told they run on three machines: each stored row block is read by one of
    them and its columns sent to the other two, point to point; every byte read once. With a
    budget of 12 KiB (4 KiB of exchange a round) the 6 KiB blocks go in bands of rows over
    several rounds."""
    results = run_ranks(WORLD, load_between_machines, str(tmp_path / "ckpt"), budget)
    assert [exact for exact, _, _ in results] == [True] * WORLD
    assert sum(read for _, read, _ in results) == 96 * 48 * 4
    # The same rounds on every rank, each a call.
    calls = [c for _, _, c in results]
    assert calls[0] and all(len(c) == len(calls[0]) for c in calls), calls
    if budget:
        assert len(calls[0]) > 2, calls
    else:
        # One round, in which each rank receives from the two others.
        assert calls == [[WORLD - 1]] * WORLD, calls


def test_slots_shrink_with_the_group():
    assert _dist.rank_slot_bytes(1) == 64 * 1024
    assert _dist.rank_slot_bytes(16) == 64 * 1024
    assert _dist.rank_slot_bytes(64) == 16 * 1024
    assert _dist.rank_slot_bytes(1 << 20) == 256
