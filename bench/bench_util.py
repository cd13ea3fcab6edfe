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


def fsync_path(path: str) -> None:
    """Makes ``path`` (a file, or a directory's entries) durable: fsync on a descriptor of it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, threads: int = 4, piece: int = 16 << 20,
             evict_first: bool = False, direct: bool = False) -> tuple[int, float]:
    """Reads every file under ``path`` in ``piece``-byte preads on ``threads`` threads (what a
    reader limited only by the disk does), into buffers allocated once; returns the bytes read.

    Two orders, each timed alone: every file front to back by one thread, and the pieces handed
    out round robin across the files (piece k of every file before piece k+1 of any); with
    ``direct``, a third: round robin with O_DIRECT (page-aligned buffers, the last piece of a file
    rounded up to 4 KiB: the read stops at the end of the file), where the file system allows it.
    The fastest is what counts, so the call takes each and ``evict_first`` evicts ``path`` before
    each (pass it when the caller times the call cold). Returns ``(bytes, seconds)`` of the
    fastest order.
    """
    import itertools
    import mmap
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
            buf = local.buf = memoryview(mmap.mmap(-1, piece))  # page-aligned, for O_DIRECT too
        return os.preadv(fd, [buf[:length]], offset)

    def read_direct(fd: int, offset: int, length: int) -> int:
        return read(fd, offset, min(piece, (length + 4095) // 4096 * 4096))

    def pieces(fd: int, size: int) -> list[tuple[int, int, int]]:
        return [(fd, offset, min(piece, size - offset)) for offset in range(0, size, piece)]

    def per_file(job: tuple[int, int]) -> int:
        return sum(read(*p) for p in pieces(*job))

    orders = ["per file", "round robin"]
    if direct and hasattr(os, "O_DIRECT"):
        orders.append("direct")
    best = None
    for order in orders:
        if evict_first:
            evict(path)
        start = time.perf_counter()
        flags = os.O_RDONLY | (os.O_DIRECT if order == "direct" else 0)
        try:
            fds = [(os.open(name, flags), size) for name, size in files]
        except OSError:  # no O_DIRECT on this file system (tmpfs): that order is left out
            continue
        try:
            with ThreadPoolExecutor(threads) as pool:
                if order == "per file":
                    total = sum(pool.map(per_file, fds))
                else:
                    one = read_direct if order == "direct" else read
                    rounds = itertools.zip_longest(*(pieces(fd, size) for fd, size in fds))
                    jobs = [p for k in rounds for p in k if p is not None]
                    total = sum(pool.map(lambda p: one(*p), jobs))
        finally:
            for fd, _ in fds:
                os.close(fd)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[1]:
            best = (total, seconds)
    return best
