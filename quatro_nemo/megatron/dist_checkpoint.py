"""Sharded training checkpoints with megatron-core's ``dist_checkpointing``.

One checkpoint is a folder written by every rank in parallel (``torch_dist`` backend: each rank
writes the shards it owns, rank 0 the metadata). It holds

- the model's ``sharded_state_dict()``: every tensor with its global shape and this rank's
  offsets, so a checkpoint saved at one TP x PP x DP layout loads into another;
- the optimizer's ``sharded_state_dict`` in the ``fully_reshardable`` format (megatron's
  model-space form of the distributed optimizer's float32 masters and Adam moments: on save each
  DP group gathers its shards, on load each rank takes its slice of the new layout);
- ``common``: small picklable state that is the same on every rank (loop position, optimizer
  step count), saved once.

megatron-core 0.16.1 to 0.19.2 need small fixes on the path a machine without Transformer Engine or apex
takes (the CPU); they live in :mod:`quatro_nemo.megatron.mcore_fixes`.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Dict

from quatro_nemo.megatron import mcore_fixes
from quatro_nemo.megatron.training import inner_model

OPTIMIZER_SHARDING = "fully_reshardable"


def _sharded_state_dict(ddp_model, optimizer, is_loading: bool) -> Dict[str, Any]:
    model_state = inner_model(ddp_model).sharded_state_dict()
    if is_loading:
        mcore_fixes.before_optimizer_load(optimizer)
    else:
        mcore_fixes.ensure_optimizer_state(optimizer)
    optimizer_state = optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
    return {"model": model_state, "optimizer": optimizer_state}


def _start_writer_manager_deaf_to_preemption() -> None:
    """The torch_dist writer reports through a ``multiprocessing`` Manager, a process it spawns at
    the first save. A spawned process starts with default signal actions, so the SIGUSR1/SIGTERM
    that SLURM sends to every process of a job step to ask for a checkpoint would kill it, and the
    checkpoint with it (seen in tests/slurm: EOFError from the Manager). Start it here with those
    signals blocked: the mask is inherited across exec, so the Manager never receives them, while
    this process gets them as soon as the mask is restored (blocked signals stay pending).

    Without CUDA the Manager is forked instead of spawned. megatron spawns it because a forked
    child of a process that has initialised CUDA cannot use CUDA; on the CPU there is nothing to
    protect, and a spawned Manager costs ~2 s of CPU per process: it starts an interpreter and
    imports torch to unpickle the first write result. (The writer's own worker processes are
    forked by megatron on every device.) A forked process keeps the blocked mask too."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from quatro_nemo.megatron.compat import cpu_compat_needed

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    preemption_signals = {signal.SIGUSR1, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, preemption_signals)
    try:
        if cpu_compat_needed():
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        else:
            filesystem_async._get_write_results_queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def save_sharded(folder: str, ddp_model, optimizer, common: Dict[str, Any]) -> None:
    """Save model + optimizer shards and ``common`` into ``folder`` (collective; every rank)."""
    from megatron.core import dist_checkpointing

    os.makedirs(folder, exist_ok=True)  # megatron asks for an existing, empty folder
    _start_writer_manager_deaf_to_preemption()
    state = _sharded_state_dict(ddp_model, optimizer, is_loading=False)
    state["common"] = common
    dist_checkpointing.save(state, folder)


def load_sharded(folder: str, ddp_model, optimizer) -> Dict[str, Any]:
    """Load ``folder`` into the model and optimizer of the current layout (collective); returns
    ``common``."""
    from megatron.core import dist_checkpointing

    state = _sharded_state_dict(ddp_model, optimizer, is_loading=True)
    state["common"] = None
    loaded = dist_checkpointing.load(state, folder, strict="assume_ok_unexpected")
    inner_model(ddp_model).load_state_dict(loaded["model"])
    mcore_fixes.load_optimizer_state(optimizer, loaded["optimizer"])
    return loaded["common"]


def load_model(folder: str, model) -> None:
    """Only the model weights of ``folder`` into ``model`` (DDP-wrapped or not; collective)."""
    from megatron.core import dist_checkpointing

    inner = inner_model(model)
    loaded = dist_checkpointing.load({"model": inner.sharded_state_dict()}, folder,
                                     strict="assume_ok_unexpected")
    inner.load_state_dict(loaded["model"])
