"""shardpoint: fast distributed checkpoints of sharded PyTorch (and numpy) state.

    import shardpoint as sp
    sp.save(state_dict, path)                      # collective over torch.distributed when initialized
    handle = sp.async_save(state_dict, path); ...; handle.wait()
    result = sp.load(state_dict, path)             # in place, any layout; result.missing_keys
    sp.load(model.state_dict(), hf_dir, mapping=sp.mappings.for_model(model))  # renamed / fused keys
    info = sp.inspect(path)                        # tensors, chunks, objects, sizes
    state = sp.load_full(path)                     # whole tensors, no template
    sp.consolidate(path, out_dir, max_shard_size="5GB")  # Hugging Face safetensors shards

shardpoint.dcp (imported on its own: it needs torch) holds StorageWriter / StorageReader, the storage
layer for torch.distributed.checkpoint's save, async_save and load.
"""

from ._api import (
    CheckpointInfo,
    LoadResult,
    ObjectInfo,
    SaveHandle,
    TensorInfo,
    VerifyReport,
    async_save,
    inspect,
    load,
    load_full,
    save,
    verify,
)
from ._core import SavePlanCache
from ._errors import (
    CheckpointArgumentError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from ._consolidate import ConsolidateResult, consolidate
from ._layouts import HyperParallelTensor, ShardedTensor
from ._manager import CheckpointEntry, CheckpointManager
from ._mapping import Cat, Fuse, KeyMapping, Stack
from . import mappings
from ._moe import ExpertShard, mark_experts

__all__ = [
    "save", "async_save", "load", "inspect", "load_full", "verify",
    "SaveHandle", "SavePlanCache", "LoadResult", "CheckpointInfo", "TensorInfo", "ObjectInfo", "VerifyReport",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointExistsError", "CheckpointCorruptError",
    "CheckpointVersionError", "CheckpointArgumentError",
    "HyperParallelTensor", "ShardedTensor", "ExpertShard", "mark_experts",
    "CheckpointManager", "CheckpointEntry",
    "consolidate", "ConsolidateResult",
    "KeyMapping", "Fuse", "Stack", "Cat", "mappings",
]
