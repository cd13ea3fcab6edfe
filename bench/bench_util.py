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
