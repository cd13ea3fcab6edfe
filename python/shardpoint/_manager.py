"""CheckpointManager: step checkpoints in one directory, with retention, for a training loop.

    manager = sp.CheckpointManager("ckpt", keep_last=3, keep_every=1000)
    resumed = manager.load_latest(state_dict)        # None on a fresh start
    start = resumed[0] + 1 if resumed else 0
    for step in range(start, steps):
        ...
        if step % 100 == 0:
            manager.save(step, state_dict)          # then old checkpoints are garbage-collected

Checkpoints are saved as ``<directory>/step_<step, 9 digits>``. The directory may also hold step
checkpoints written by other tools: every subdirectory whose name ends in a step number counts (see
``shardpoint list``).

Many ranks, one shared file system: every decision is taken by rank 0 of the process group and
broadcast, so all ranks agree on which checkpoint is the latest, and only rank 0 deletes. Garbage
collection runs only after a save has committed, and never deletes the newest committed checkpoint
or an uncommitted one (which may be a save in progress, or one interrupted by a crash).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

from . import _api, _core, _dist
from ._errors import CheckpointArgumentError, CheckpointNotFoundError, code_of, error_for, translated

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointEntry:
    """One step checkpoint of a managed directory."""

    step: int
    path: str
    nbytes: int
    committed: bool
    format: str  # "native", "torch-dcp", or "" when uncommitted
    latest: bool = False


class CheckpointManager:
    """Saves step checkpoints into ``directory`` and keeps the ``keep_last`` newest committed ones
    plus every one whose step is a multiple of ``keep_every``. Collective over ``process_group``
    (default: the default group when torch.distributed is initialized, else this process alone):
    every rank calls every method.
    """

    def __init__(self, directory: PathLike, keep_last: int = 1, keep_every: Optional[int] = None,
                 process_group: Any = None) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointArgumentError(f"keep_last must be an integer >= 1, got {keep_last!r}",
                                          "INVALID_ARGUMENT")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise CheckpointArgumentError(f"keep_every must be None or an integer >= 1, got {keep_every!r}",
                                          "INVALID_ARGUMENT")
        self.directory = os.fspath(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every or 0
        self.process_group = process_group

    def path_for(self, step: int) -> str:
        """Where :meth:`save` puts the checkpoint of ``step``."""
        return os.path.join(self.directory, f"step_{step:09d}")

    def save(self, step: int, state_dict: Mapping[str, Any], **save_kwargs: Any) -> str:
        """Saves ``state_dict`` as the checkpoint of ``step`` (``save_kwargs`` go to
        :func:`shardpoint.save`), then, once it is committed, deletes the checkpoints the retention
        policy lets go. Returns the checkpoint's path."""
        if not isinstance(step, int) or step < 0:
            raise CheckpointArgumentError(f"step must be an integer >= 0, got {step!r}", "INVALID_ARGUMENT")
        path = self.path_for(step)
        comm = _dist.resolve(self.process_group)
        _api.save(state_dict, path, process_group=self.process_group, **save_kwargs)
        self._decide(comm, lambda: _core.gc(self.directory, keep_last=self.keep_last,
                                            keep_every=self.keep_every)[1])
        return path

    def list(self) -> list[CheckpointEntry]:
        """The step checkpoints of the directory, by step; the same list on every rank."""
        return [CheckpointEntry(**entry) for entry in self._decide(_dist.resolve(self.process_group), self._listing)]

    def latest_step(self) -> Optional[int]:
        """The step of the newest committed checkpoint, or None; the same on every rank."""
        latest = [e for e in self.list() if e.latest]
        return latest[0].step if latest else None

    def load_latest(self, state_dict: Mapping[str, Any], **load_kwargs: Any
                    ) -> Optional[tuple[int, _api.LoadResult]]:
        """Loads the newest committed checkpoint into ``state_dict`` (``load_kwargs`` go to
        :func:`shardpoint.load`). Returns (step, LoadResult), or None when there is none."""
        latest = [e for e in self.list() if e.latest]
        if not latest:
            return None
        result = _api.load(state_dict, latest[0].path, process_group=self.process_group, **load_kwargs)
        return latest[0].step, result

    def _listing(self) -> list[dict[str, Any]]:
        if "://" not in self.directory and not os.path.isdir(self.directory):
            return []
        try:
            with translated():
                listing = _core.list_checkpoints(self.directory)
        except CheckpointNotFoundError:  # an s3:// directory nothing was saved in yet
            return []
        return [{"step": c["step"], "path": c["path"], "nbytes": c["bytes"], "committed": c["committed"],
                 "format": c["format"], "latest": i == listing["latest"]}
                for i, c in enumerate(listing["checkpoints"])]

    @staticmethod
    def _decide(comm: Optional[_dist.TorchComm], fn: Callable[[], T]) -> T:
        """Runs ``fn`` on rank 0 and gives its JSON-able result, or its error, to every rank."""
        if comm is None:
            with translated():
                return fn()
        reply = None
        if comm.rank == 0:
            try:
                with translated():
                    reply = json.dumps({"value": fn()}).encode()
            except Exception as e:  # forwarded to every rank below
                reply = json.dumps({"code": code_of(e), "message": f"rank 0: {e}"}).encode()
        decided = json.loads(comm.broadcast(reply, 0))
        if "value" not in decided:
            raise error_for(decided["code"], decided["message"])
        return decided["value"]
