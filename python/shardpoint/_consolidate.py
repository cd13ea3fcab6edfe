"""Consolidation: a checkpoint of any layout and format written as whole tensors for serving tools.

    import shardpoint as sp
    sp.consolidate("ckpt/step_1000", "export/", max_shard_size="5GB", dtype=torch.bfloat16)

writes ``model.safetensors`` (or ``model-0000K-of-0000N.safetensors`` shards and
``model.safetensors.index.json``) exactly as Hugging Face's ``save_pretrained`` lays them out.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ._errors import translated
from ._mapped_load import consolidation_mapping
from ._progress import Progress

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class ConsolidateResult:
    """What :func:`consolidate` wrote into ``out_dir``."""

    out_dir: str
    files: list[str] = field(default_factory=list)  # data files, in shard order
    index_file: Optional[str] = None                 # None when everything is in one file
    tensors: int = 0
    total_bytes: int = 0                             # tensor bytes written (the index's total_size)
    bytes_read: int = 0                              # bytes read from the source checkpoint
    selection: str = ""                              # what was exported and what was left out


def _dtype_name(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype
    name = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"; numpy dtypes print their name
    return name.removeprefix("torch.")


def _rename_pairs(rename: Union[None, Mapping[str, str], Iterable[Sequence[str]]]) -> list[tuple[str, str]]:
    if rename is None:
        return []
    items = rename.items() if isinstance(rename, Mapping) else rename
    pairs = []
    for item in items:
        old, new = item
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise ValueError(f"rename expects (old_prefix, new_prefix) strings with a non-empty old_prefix, "
                             f"got {item!r}")
        pairs.append((old, new))
    return pairs


def _names(value: Union[None, str, Iterable[str]], what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    names = list(value)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{what} must be non-empty strings, got {names!r}")
    return names


def _byte_size(size: Union[int, str], what: str) -> int:
    from . import _core

    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{what} must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"{what} must be positive, got {size}")
        return size
    with translated():
        return int(_core.parse_byte_size(size))


def consolidate(path: PathLike, out_dir: PathLike, max_shard_size: Union[int, str, None] = None,
                dtype: Any = None, keys: Union[None, str, Iterable[str]] = None,
                rename: Union[None, Mapping[str, str], Iterable[Sequence[str]]] = None,
                format: str = "safetensors", overwrite: bool = False, threads: Optional[int] = None, *,
                prefixes: Union[None, str, Iterable[str]] = None,
                memory_budget: Union[int, str, None] = None, all_tensors: bool = False,
                mapping: Any = None, allow_external_links: bool = False) -> ConsolidateResult:
    """Writes the tensors of the checkpoint at ``path`` as whole tensors into ``out_dir``.

    The source may be any checkpoint shardpoint reads (its own, PyTorch DCP, Hugging Face
    safetensors), saved by any number of ranks in any layout. Outputs follow Hugging Face's
    ``save_pretrained``: ``model.safetensors`` when everything fits in ``max_shard_size``, else
    ``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``; with
    ``format="torch"``, ``pytorch_model.bin`` or ``pytorch_model-0000K-of-0000N.bin`` plus its index.
    Non-tensor objects of the checkpoint are not written.

    Without ``keys`` or ``prefixes``, a training checkpoint exports its model weights alone when it
    clearly separates them from the training state: tensors under a first name component such as
    ``optimizer``, ``optim``, ``lr_scheduler``, ``dataloader`` or ``train_state`` are left out, and
    when every other tensor is under ``model.`` that prefix is removed (``sp.save({"model": ...,
    "optimizer": ...})`` exports the model's own names). ``result.selection`` says what was picked
    and is printed on stderr unless ``SHARDPOINT_QUIET`` is set; ``all_tensors=True`` exports
    every tensor.

    Args:
        max_shard_size: bytes, or a string like "5GB", "500MB", "2GiB" (default: Hugging Face's,
            5GB).
        dtype: convert floating-point tensors (float16, bfloat16, float32, float64) to this dtype
            (``torch.bfloat16``, "bf16", ...) with torch's rounding; other tensors keep theirs.
        keys: tensor names; each selects that tensor and the tensors under it ("model.layers.0"
            selects "model.layers.0.mlp.w1"). ``prefixes`` select by plain string prefix. A key or
            prefix that selects nothing is an error. Default: the model weights of a training
            checkpoint (see above), else every tensor.
        rename: ``{old_prefix: new_prefix}`` (or pairs), applied in order, first match wins.
        overwrite: replace existing outputs of this format in ``out_dir``; otherwise they are an error.
        threads: I/O threads (default: max(4, cores)).
        memory_budget: memory for tensor data in flight (default: 256MiB); peak memory stays near
            it whatever the size of the checkpoint or of its tensors.
        mapping: a :class:`~shardpoint.KeyMapping`; tensors are written under its target names, fused
            ones whole (``keys``, ``prefixes``, ``rename`` and the default selection then apply to
            target names). A fused target is streamed slab by slab straight from the stored tensors
            it is made of, like any other tensor: ``memory_budget`` bounds it too, and each stored
            byte is read once, with its checksums verified.
        allow_external_links: read files of the source that symbolic links lead outside its
            directory (refused by default; docs/FORMAT.md §1.1).

    Files appear under their final names only once complete. Call it from one process.
    Raises CheckpointNotFoundError (no checkpoint; a key that selects nothing), CheckpointExistsError
    (outputs already there), CheckpointArgumentError (bad options), CheckpointCorruptError (a
    damaged source).
    """
    from . import _core

    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    bar: dict[str, Progress] = {}

    def progress(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = Progress("consolidate", total)
        bar["bar"].advance(done - bar["bar"].done)

    # Options left out keep the core's defaults (shardpoint/manage/consolidate.h).
    given = {"max_shard_bytes": None if max_shard_size is None else _byte_size(max_shard_size, "max_shard_size"),
             "memory_budget_bytes": None if memory_budget is None else _byte_size(memory_budget, "memory_budget"),
             "threads": threads}
    placements, renames = ([], {}) if mapping is None else consolidation_mapping(
        os.fspath(path), mapping, allow_external_links)
    with translated():
        options = _core.ConsolidateOptions(
            format=format, dtype=_dtype_name(dtype), keys=_names(keys, "keys"), prefixes=_names(prefixes, "prefixes"),
            rename=_rename_pairs(rename), overwrite=bool(overwrite), all_tensors=bool(all_tensors),
            progress=progress if Progress("consolidate", 0).enabled else None, placements=placements,
            mapped_renames=renames, allow_external_links=bool(allow_external_links),
            **{k: v for k, v in given.items() if v is not None})
        result = _core.consolidate(os.fspath(path), os.fspath(out_dir), options)
    if "bar" in bar:
        bar["bar"].finish()
    if keys is None and prefixes is None and not all_tensors and not os.environ.get("SHARDPOINT_QUIET"):
        print(f"shardpoint consolidate: {result.selection}", file=sys.stderr)
    return ConsolidateResult(os.fspath(out_dir), result.files, result.index_file, result.tensors, result.total_bytes,
                             result.bytes_read, result.selection)
