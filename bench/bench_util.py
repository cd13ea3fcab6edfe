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


def raw_read(path: str, threads: int = 4, piece: int = 16 << 20) -> int:
    """Reads every file under ``path`` in ``piece``-byte preads spread over ``threads`` threads
    (what a reader limited only by the disk does); returns the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            size = os.path.getsize(full)
            jobs += [(full, offset, min(piece, size - offset)) for offset in range(0, size, piece)]

    def read(job: tuple[str, int, int]) -> int:
        name, offset, length = job
        fd = os.open(name, os.O_RDONLY)
        try:
            return len(os.pread(fd, length, offset))
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, jobs))
