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
import threading
from typing import Any, Callable, Optional


class _Lane:
    """One worker thread that runs one call at a time, handed to it by ``submit``."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Condition()
        self._call: Optional[Callable[[], Any]] = None
        self._done = True
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._call is None and not self._closed:
                    self._ready.wait()
                if self._call is None:
                    return
                call = self._call
            result, error = None, None
            try:
                result = call()
            except BaseException as e:  # handed to the caller by wait()
                error = e
            with self._ready:
                self._call, self._result, self._error, self._done = None, result, error, True
                self._ready.notify_all()

    def submit(self, call: Callable[[], Any]) -> None:
        with self._ready:
            assert self._done, "a lane runs one call at a time"
            self._call, self._done, self._result, self._error = call, False, None, None
            self._ready.notify_all()

    def wait(self) -> Any:
        """The result of the call submitted last, or its error raised."""
        with self._ready:
            while not self._done:
                self._ready.wait()
            if self._error is not None:
                raise self._error
            return self._result

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._thread.join()


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
    workers = [_Lane(f"shardpoint-load-{k}") for k in range(min(lanes, count))]
    inflight: collections.deque = collections.deque()
    try:
        for i in range(count):
            if len(inflight) == len(workers):
                j, prepared = inflight.popleft()
                complete(j, prepared, workers[j % len(workers)].wait())
            lane = i % len(workers)
            prepared = prepare(i, lane)
            workers[lane].submit(lambda lane=lane, prepared=prepared: run(lane, prepared))
            inflight.append((i, prepared))
        while inflight:
            j, prepared = inflight.popleft()
            complete(j, prepared, workers[j % len(workers)].wait())
    finally:
        # After an error: the runs still in flight return before it is raised (their results and
        # errors are dropped: the first error is the one that counts).
        for j, _ in inflight:
            try:
                workers[j % len(workers)].wait()
            except BaseException:
                pass
        for worker in workers:
            worker.close()
