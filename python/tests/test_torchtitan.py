"""torchtitan's ``CheckpointManager`` over shardpoint's DCP storage adapters (torchtitan 0.3.0, CPU,
gloo).

The job is torchtitan's llama3 "debugmodel" (``llama3_debugmodel()``: its model, AdamW
``OptimizersContainer``, warmup/decay ``LRSchedulersContainer`` and ``CheckpointManager`` configs),
shrunk to 2 of its 6 layers and a 512-token vocabulary, built piece by piece as ``Trainer.__init__``
builds it: ``ParallelDims`` (FSDP over every rank), the model on the meta device, torchtitan's own
``parallelize_llama`` (``apply_fsdp_to_decoder``: ``fully_shard`` per block, bf16 parameters, fp32
reductions, gradient division off), ``init_weights``, optimizers and schedulers from their configs, a
``ParallelAwareDataloader`` (torchdata's ``StatefulDataLoader``) over a Stateful token dataset, and
the ``CheckpointManager`` with ``{"train_state": ...}`` (``step``, ``ntokens_seen``) as the trainer
gives it. A step is ``Trainer.train_step`` for this configuration: forward without the lm_head, the
debugmodel's ``ChunkedLossWrapper`` (lm_head and ``CrossEntropyLoss`` per sequence chunk, divided by
the global token count), backward, ``clip_grad_norm_``, optimizer and scheduler steps, and the
logged loss summed over the ranks.

A job of 4 ranks trains ``STEPS`` steps; the manager saves step ``SAVE_AT`` asynchronously
(``async_mode="async"``: ``dcp.async_save`` on the manager's gloo group) while training goes on. A
fresh job of 2 ranks loads that step through ``CheckpointManager.load``, trains to ``STEPS`` and saves
its last step (``dcp.save``). Its losses must equal the 4-rank job's bit for bit. That holds because
every rank reads the same batches (the dataloader is built for one data-parallel rank), so the data
parallel reductions add copies of one value, and AdamW is elementwise. The one sum whose order depends
on the world size is the gradient norm over the shards; the job's ``max_norm`` is set above the norms
it reaches (about 2), so clipping multiplies by exactly 1. The dataloader's state, which torchtitan
keys by data-parallel rank and refuses to load at another data-parallel degree, loads at 2 ranks too.

Patched in the test only (each rank is a fresh process, so nothing leaks into other tests):
- ``torchtitan.distributed.minimal_async_ep.kernels`` imports Triton, which CPU builds of torch lack,
  and every model imports it; a stand-in module that raises when a kernel is called takes its place.
- torchtitan picks ``cuda`` as its device type when no accelerator is present: ``device_type`` and
  ``device_module`` are set to the CPU where torchtitan imported them.
- The debugmodel's FlexAttention cannot run backward on a CPU (torch raises), so its layers use
  torchtitan's own ``ScaledDotProductAttention`` (causal). Every sample is one whole document
  (positions ``0..n-1``), for which FlexAttention's block-causal document mask is the causal mask.
- ``spmd_backend="partial_dtensor"``: with the default ``"spmd_types"``, torchtitan passes
  ``dp_mesh_dims`` to ``fully_shard`` with plain annotated parameters, which torch 2.13's
  ``fully_shard`` rejects ("all parameters must be DTensors on the full SPMD mesh").
- torchtitan disables FSDP's gradient division (factor 1.0, which FSDP sends as ``PREMUL_SUM``);
  gloo has no ``PREMUL_SUM``, so the FSDP modules are set to the plain sums this amounts to.
- torchtitan 0.3.0 calls ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with a ``checkpoint_id``
  only: the checkpoint module's ``dcp`` is replaced by one that adds a ``shardpoint.dcp``
  ``StorageWriter`` / ``StorageReader`` for the same path (and the manager's process group).

Not covered: ``CheckpointManager.load()`` without a step looks for the latest step by DCP's
``.metadata`` file, which a shardpoint checkpoint does not have (its commit point is
``shardpoint.metadata``), so it finds none; a job resumes by naming the step
(``checkpoint.load_step``), and the test pins that the search finds nothing.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import shardpoint as sp
from distributed import run_ranks

torchtitan = pytest.importorskip("torchtitan")

STEPS, SAVE_AT = 5, 3
SEQ_LEN, LOCAL_BATCH, VOCAB, LAYERS = 32, 2, 512, 2
MAX_NORM = 100.0  # above the gradient norms of this job (see the module docstring)


class _NeedsTriton(types.ModuleType):
    """Stands in for a module of Triton GPU kernels: importing it works, calling a kernel raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a Triton GPU kernel (not on this CPU)")
        return kernel


def _patch_for_cpu() -> None:
    """Points torchtitan at the CPU (see the module docstring)."""
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    sys.modules.setdefault(kernels, _NeedsTriton(kernels))
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils

    for module in (tool_utils, parallel_dims, dist_utils):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def _sum_reductions_for_gloo(model: torch.nn.Module) -> None:
    """torchtitan turns FSDP's gradient division off (a factor of 1.0, which FSDP sends as
    ``PREMUL_SUM(1.0)``); gloo has no ``PREMUL_SUM``, so the reductions are made the plain sums
    they amount to, as torchtitan's own symmetric-memory option does."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _route_dcp_through_shardpoint(calls: list) -> None:
    """Makes the checkpoint module's ``dcp`` calls use shardpoint's storage adapters."""
    import torch.distributed.checkpoint as torch_dcp
    from torchtitan.components.checkpointer import dcp as checkpointer

    import shardpoint.dcp as spdcp

    def save(state_dict, *, checkpoint_id, storage_writer=None, **kwargs):
        assert storage_writer is None, "torchtitan passed its own storage writer"
        calls.append(("save", checkpoint_id))
        writer = spdcp.StorageWriter(checkpoint_id)
        return torch_dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, **kwargs)

    def async_save(state_dict, *, checkpoint_id, storage_writer=None, process_group=None, **kwargs):
        assert storage_writer is None, "torchtitan passed its own storage writer"
        calls.append(("async_save", checkpoint_id))
        writer = spdcp.StorageWriter(checkpoint_id, process_group=process_group)
        return torch_dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                    process_group=process_group, **kwargs)

    def load(state_dict, *, checkpoint_id, storage_reader=None, **kwargs):
        assert storage_reader is None, "torchtitan passed its own storage reader"
        calls.append(("load", checkpoint_id))
        reader = spdcp.StorageReader(checkpoint_id)
        return torch_dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id, **kwargs)

    checkpointer.dcp = types.SimpleNamespace(save=save, async_save=async_save, load=load)


class TokenDataset(torch.utils.data.IterableDataset):
    """Endless samples of random tokens, each seeded by its index, shaped as torchtitan's text
    datasets yield them (``{"input", "positions"}``, labels); its state is the next sample's index."""

    def __init__(self) -> None:
        self.sample = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 + self.sample)
            tokens = torch.randint(0, VOCAB, (SEQ_LEN + 1,), generator=g)
            self.sample += 1
            yield {"input": tokens[:-1], "positions": torch.arange(SEQ_LEN)}, tokens[1:]

    def state_dict(self) -> dict:
        return {"sample": self.sample}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sample = state_dict["sample"]


class TrainState:
    """The trainer's own Stateful part, as ``Trainer.state_dict`` gives it."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def _job_config(dump_folder: str):
    """torchtitan's llama3 debugmodel job, shrunk, with checkpointing every ``SAVE_AT`` steps."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:LAYERS]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = VOCAB
    config.loss.loss_fn.global_vocab_size = VOCAB
    config.optimizer.implementation = "foreach"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len, config.training.local_batch_size = SEQ_LEN, LOCAL_BATCH
    config.training.steps = STEPS
    config.training.max_norm = MAX_NORM
    config.dump_folder = dump_folder
    config.debug.seed = 0
    config.checkpoint.enable = True
    config.checkpoint.interval = SAVE_AT
    return config


def _build_model(config, dims):
    """The model as ``Trainer.__init__`` builds it: on the meta device, parallelized by the model's
    ``parallelize_fn``, then materialized on the CPU and initialized."""
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    _sum_reductions_for_gloo(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


class Job:
    """The pieces of a torchtitan training job on ``world`` gloo ranks, built from the job config as
    ``Trainer.__init__`` builds them."""

    def __init__(self, world: int, dump_folder: str, async_saves: bool) -> None:
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils

        config = self.config = _job_config(dump_folder)
        config.checkpoint.async_mode = "async" if async_saves else "disabled"
        dims = self.parallel_dims = ParallelDims.from_config(config.parallelism, world)
        dims.build_mesh()
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        dist_utils.set_determinism(dims, torch.device("cpu"), config.debug, distinct_seed_mesh_dims=["pp"])
        self.model = model = _build_model(config, dims)
        self.loss_fn = config.loss.build(compile_config=config.compile)
        self.loss_fn.set_lm_head(model.lm_head)  # the chunked loss applies the lm_head itself
        model._skip_lm_head = True
        self.optimizers = config.optimizer.build(model_parts=[model])
        self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, training_steps=STEPS)
        self.train_state = TrainState()
        self.dataloader = ParallelAwareDataloader(TokenDataset(), dp_rank=0, dp_world_size=1,
                                                  batch_size=LOCAL_BATCH)
        self.checkpointer = config.checkpoint.build(
            dataloader=self.dataloader, model_parts=[model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state},
            sd_adapter=None, base_folder=dump_folder)
        self.batches = None  # made on the first step, after a load, as Trainer.train does
        self.grad_norms: list[float] = []

    def train_step(self) -> float:
        """One step of torchtitan's ``Trainer.train_step`` for this configuration; the logged loss."""
        from torchtitan.distributed import utils as dist_utils

        from torchtitan.components.loss import IGNORE_INDEX

        if self.batches is None:
            self.batches = iter(self.dataloader)
        self.optimizers.zero_grad()
        input_dict, labels = next(self.batches)
        dims = self.parallel_dims
        global_tokens = dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), dims.get_mesh("batch"))
        positions = input_dict["positions"]
        self.train_state.ntokens_seen += labels.numel()
        with dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)():
            pred = self.model(input_dict["input"], positions=positions)
            loss, _ = self.loss_fn(pred, labels, global_tokens, positions=positions)
            loss.backward()
        norm = dist_utils.clip_grad_norm_(list(self.model.parameters()), self.config.training.max_norm, foreach=True)
        self.grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.step += 1
        return dist_utils.dist_sum(loss.detach(), dims.get_optional_mesh("loss"))

    def train(self, final_save: bool) -> list[float]:
        """Trains to ``STEPS`` as ``Trainer.train`` does, the manager saving after each step (at its
        interval, and at the last step when ``final_save``); the losses."""
        losses = []
        while self.train_state.step < STEPS:
            losses.append(self.train_step())
            step = self.train_state.step
            self.checkpointer.save(step, last_step=final_save and step == STEPS)
        self.checkpointer.maybe_wait_for_saving()
        return losses


def run_job(rank: int, world: int, dump_folder: str, resume: bool) -> dict:
    """A job of ``world`` ranks: the first trains from scratch with asynchronous saves and stops
    after ``STEPS`` (as if cut off); a resumed one loads step ``SAVE_AT`` through the manager,
    trains to ``STEPS`` and saves its last step synchronously."""
    _patch_for_cpu()
    calls: list = []
    _route_dcp_through_shardpoint(calls)
    job = Job(world, dump_folder, async_saves=not resume)
    manager = type(job.checkpointer)
    out: dict = {"calls": calls, "manager": f"{manager.__module__}.{manager.__qualname__}"}
    try:
        if resume:
            out["discovered_step"] = job.checkpointer._find_load_step()
            out["loaded"] = job.checkpointer.load(step=SAVE_AT)
            out["train_state_at_load"] = job.train_state.state_dict()
            out["lr_at_load"] = [s.last_epoch for s in job.lr_schedulers]
        out["losses"] = job.train(final_save=resume)
        out["samples_read"] = job.dataloader.dataset.sample
        out["grad_norms"] = job.grad_norms
        return out
    finally:
        job.checkpointer.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The 4-rank job, then the 2-rank job resumed from its step ``SAVE_AT``."""
    folder = str(tmp_path_factory.mktemp("titan"))
    first = run_ranks(4, run_job, folder, False)
    resumed = run_ranks(2, run_job, folder, True)
    return os.path.join(folder, "checkpoint"), first, resumed


def test_resumed_at_2_ranks_with_the_losses_of_the_uninterrupted_run(jobs):
    _, first, resumed = jobs
    uninterrupted = first[0]["losses"]
    assert len(uninterrupted) == STEPS and all(r["losses"] == uninterrupted for r in first)
    for r in resumed:
        assert r["loaded"]
        assert r["train_state_at_load"] == {"step": SAVE_AT, "ntokens_seen": SAVE_AT * SEQ_LEN * LOCAL_BATCH}
        assert r["lr_at_load"] == [SAVE_AT]
        assert r["losses"] == uninterrupted[SAVE_AT:]  # bit-identical, not approximately equal
        assert r["samples_read"] == STEPS * LOCAL_BATCH  # the dataloader went on from its saved position
    assert 0 < max(n for r in first + resumed for n in r["grad_norms"]) < MAX_NORM  # clipping multiplied by 1


def test_manager_went_through_shardpoint(jobs):
    path, first, resumed = jobs
    step = os.path.join(path, f"step-{SAVE_AT}")
    last = os.path.join(path, f"step-{STEPS}")
    for r in first + resumed:
        assert r["manager"] == "torchtitan.components.checkpointer.dcp.CheckpointManager"
    for r in first:
        assert r["calls"] == [("async_save", step)]
    for r in resumed:
        assert r["calls"] == [("load", step), ("save", last)]
        # The manager finds its latest step by DCP's ".metadata" file, which a shardpoint checkpoint
        # does not have: a job resumes from one by naming its step (checkpoint.load_step).
        assert r["discovered_step"] == -1
    assert sorted(os.listdir(path)) == [f"step-{SAVE_AT}", f"step-{STEPS}"]
    assert not os.path.exists(os.path.join(step, ".metadata"))


def test_manager_checkpoints_are_native(jobs):
    path, _, _ = jobs
    for step, world in ((SAVE_AT, 4), (STEPS, 2)):
        checkpoint = os.path.join(path, f"step-{step}")
        report = sp.verify(checkpoint)
        assert report.ok, report.defects
        info = sp.inspect(checkpoint)
        assert info.world_size == world
        assert len(info.tensors["layers.0.feed_forward.w1.weight"].chunks) == world
        assert len(info.tensors["optimizer.state.layers.0.feed_forward.w1.weight.exp_avg"].chunks) == world
        assert info.objects["train_state.step"].encoding == "json"
        assert info.objects["dataloader.dp_rank_0"].encoding == "bytes"  # torchtitan pickles it itself
        assert not any(o.encoding == "pickle" for o in info.objects.values())
        train_state = TrainState()
        sp.load({"train_state": train_state}, checkpoint)
        assert train_state.state_dict() == {"step": step, "ntokens_seen": step * SEQ_LEN * LOCAL_BATCH}
