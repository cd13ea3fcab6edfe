"""Progress on a terminal: a bar while work is counted, one summary line at the end.

Quiet when stderr is not a terminal, on ranks other than 0, or when SHARDPOINT_QUIET is set.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

_WIDTH = 30


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """A byte-counting progress bar for one operation (``label``) of ``total`` bytes."""

    def __init__(self, label: str, total: int, *, rank: int = 0, stream: Optional[TextIO] = None) -> None:
        self.label = label
        self.total = max(int(total), 0)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (rank == 0 and not os.environ.get("SHARDPOINT_QUIET")
                        and hasattr(self.stream, "isatty") and self.stream.isatty())
        self.start = time.monotonic()

    def advance(self, nbytes: int) -> None:
        """Counts ``nbytes`` more bytes as done and redraws the bar."""
        self.done += int(nbytes)
        if self.enabled and self.total:
            filled = min(_WIDTH, _WIDTH * self.done // self.total)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
                              f"{_format_bytes(self.done)} / {_format_bytes(self.total)}")
            self.stream.flush()

    def finish(self, nbytes: Optional[int] = None) -> None:
        """Replaces the bar with a summary: bytes, seconds and throughput."""
        if not self.enabled:
            return
        seconds = max(time.monotonic() - self.start, 1e-9)
        n = self.total if nbytes is None else nbytes
        self.stream.write(f"\r{self.label}: {_format_bytes(n)} in {seconds:.2f} s "
                          f"({n / seconds / 1e9:.2f} GB/s){' ' * 20}\n")
        self.stream.flush()
