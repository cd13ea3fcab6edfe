"""Helpers shared by the Python benchmarks (run as scripts from this directory's parent)."""

from __future__ import annotations

import os


def evict(path: str) -> bool:
    """Syncs every file under ``path`` and drops it from the page cache, so the next read is cold.

    Returns False (and does nothing) where posix_fadvise is not available.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def raw_read(path: str, threads: int = 4, piece: int = 16 << 20,
             evict_first: bool = False) -> tuple[int, float]:
    """Reads every file under ``path`` in ``piece``-byte preads on ``threads`` threads (what a
    reader limited only by the disk does), into buffers allocated once; returns the bytes read.

    Two orders, each timed alone: every file front to back by one thread, and the pieces handed
    out round robin across the files (piece k of every file before piece k+1 of any); the faster
    is what counts, so the call takes both and ``evict_first`` evicts ``path`` before each (pass
    it when the caller times the call cold). Returns ``(bytes, seconds)`` of the faster order.
    """
    import itertools
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    files = []
    for root, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(root, name)
            files.append((full, os.path.getsize(full)))
    local = threading.local()

    def read(fd: int, offset: int, length: int) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(piece))
        return os.preadv(fd, [buf[:length]], offset)

    def pieces(fd: int, size: int) -> list[tuple[int, int, int]]:
        return [(fd, offset, min(piece, size - offset)) for offset in range(0, size, piece)]

    def per_file(job: tuple[int, int]) -> int:
        return sum(read(*p) for p in pieces(*job))

    best = None
    for order in ("per file", "round robin"):
        if evict_first:
            evict(path)
        start = time.perf_counter()
        fds = [(os.open(name, os.O_RDONLY), size) for name, size in files]
        try:
            with ThreadPoolExecutor(threads) as pool:
                if order == "per file":
                    total = sum(pool.map(per_file, fds))
                else:
                    rounds = itertools.zip_longest(*(pieces(fd, size) for fd, size in fds))
                    jobs = [p for k in rounds for p in k if p is not None]
                    total = sum(pool.map(lambda p: read(*p), jobs))
        finally:
            for fd, _ in fds:
                os.close(fd)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[1]:
            best = (total, seconds)
    return best
