"""Steps of a load run with several of their slow parts in flight at once.

A load to CUDA devices runs as one core load per batch (docs/GPU.md). Run one after the other, the
reads of batch i + 1 start only when the last read of batch i has returned, so the storage idles at
every batch boundary (the tail of one load and the start of the next). :func:`pipelined` keeps up
to ``lanes`` of them in flight: step i is prepared on the calling thread, its slow part runs on the
thread of lane i % lanes, and it is completed on the calling thread, in order. A lane runs one step
at a time, so each lane may hold state that only one step may use at a time (a pinned half, a
process group whose collectives must not interleave with another load's).
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def pipelined(count: int, lanes: int, prepare: Callable[[int, int], Any], run: Callable[[int, Any], Any],
              complete: Callable[[int, Any, Any], None]) -> None:
    """Runs ``count`` steps with up to ``lanes`` of their ``run`` parts in flight.

    For step i: ``prepared = prepare(i, lane)`` on the calling thread, with lane = i % lanes; then
    ``run(lane, prepared)`` on that lane's thread; then ``complete(i, prepared, result)`` on the
    calling thread, in the order of the steps. Step i is prepared only after step i - lanes (the
    last one of its lane) has completed, and while the other lanes' runs go on. With one lane (or
    one step) everything runs on the calling thread, one step after the other.

    The first error (of a prepare, a run, or a complete) is raised once every run still in flight
    has returned; steps after it are neither prepared nor completed. Collective steps stay in step
    on every rank: each rank prepares, runs and completes the same steps in the same order, and an
    error that one rank meets in a collective part reaches all of them at the same step.
    """
    if lanes <= 1 or count <= 1:
        for i in range(count):
            prepared = prepare(i, 0)
            complete(i, prepared, run(0, prepared))
        return
    # One thread per lane, so that a lane's runs never overlap.
    workers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shardpoint-load-{k}")
               for k in range(min(lanes, count))]
    inflight: collections.deque = collections.deque()  # (step, prepared, future), oldest first
    try:
        for i in range(count):
            if len(inflight) == len(workers):
                j, prepared, future = inflight.popleft()
                complete(j, prepared, future.result())
            lane = i % len(workers)
            prepared = prepare(i, lane)
            inflight.append((i, prepared, workers[lane].submit(run, lane, prepared)))
        while inflight:
            j, prepared, future = inflight.popleft()
            complete(j, prepared, future.result())
    finally:
        # After an error the runs still in flight return before it is raised (their results and
        # errors are dropped: the first error is the one that counts), and no thread stays.
        for worker in workers:
            worker.shutdown(wait=True)
