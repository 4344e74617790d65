"""Sharded training checkpoints with megatron-core's ``dist_checkpointing``.

One checkpoint is a folder written by every rank in parallel (``torch_dist`` backend). It holds

- the model's ``sharded_state_dict()``: every tensor with its global shape and this rank's
  offsets, so the weights saved at one TP x PP x DP layout load into any other;
- the optimizer's ``sharded_state_dict`` in one of megatron's two distributed-optimizer formats
  (``DistributedOptimizer.sharded_state_dict`` in ``optimizer/distrib_optimizer.py``):

  * ``dp_reshardable`` (:data:`ROUTINE_FORMAT`, every save of a training run): each rank's own
    shard of the float32 masters and Adam moments as it lies in megatron's gradient buckets, one
    tensor per bucket and TP x PP domain. No gather, no copy: every rank writes and reads only
    its shard. It reloads at any data-parallel size, but only at the TP and PP sizes that saved it
    (the bucket layout is that of the model shard);
  * ``fully_reshardable`` (:data:`RESHARDABLE_FORMAT`, written by
    ``recipes/convert_checkpoint.py reshard`` before a run changes TP or PP): the same state in
    model space (one tensor per parameter, shaped like it), which loads at any layout. Saved in
    megatron's memory-efficient mode (``distrib_optim_fully_reshardable_mem_efficient``: each DP
    group's shards gathered over gloo on its first rank only); a load makes every rank hold its
    whole TP x PP shard's state in host memory before it keeps its own slice;
- ``common``: small picklable state that is the same on every rank (loop position, optimizer
  step count), saved once;
- megatron's ``content_metadata``: the optimizer format and the TP and PP sizes that saved it, read
  before a load to refuse, with the way out, a ``dp_reshardable`` checkpoint at other TP/PP sizes.

Saves and loads go through megatron's ``FullyParallelSaveStrategyWrapper`` and
``FullyParallelLoadStrategyWrapper`` over the data-parallel group (with context parallelism), as
Megatron-LM's ``training/checkpointing.py`` does by default: tensors replicated over DP ranks (the
model weights) are written by one rank each, spread evenly, and read by one rank each and
exchanged (broadcast) instead of read by every rank. A ``fully_reshardable`` optimizer state is
loaded without the load wrapper (:func:`_load_strategy`).

megatron-core 0.16.1 to 0.19.2 need small fixes on the path a machine without Transformer Engine or apex
takes (the CPU); they live in :mod:`quatro_nemo.megatron.mcore_fixes`.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Dict

from quatro_nemo.megatron import mcore_fixes, parallel
from quatro_nemo.megatron.training import inner_model

ROUTINE_FORMAT = "dp_reshardable"
RESHARDABLE_FORMAT = "fully_reshardable"
OPTIMIZER_FORMATS = (ROUTINE_FORMAT, RESHARDABLE_FORMAT)
# What the content metadata says of a non-distributed optimizer: megatron keeps its state per
# parameter, in model space, which loads at any layout.
MODEL_SPACE = "model_space"
# A checkpoint written before content metadata existed: the format every save used then.
_FORMAT_WITHOUT_METADATA = RESHARDABLE_FORMAT


class ReshardRequired(ValueError):
    """A ``dp_reshardable`` checkpoint asked to load at other TP/PP sizes than the ones that saved
    it; ``saved_tensor`` and ``saved_pipeline`` are those sizes."""

    def __init__(self, message: str, saved_tensor: int, saved_pipeline: int):
        super().__init__(message)
        self.saved_tensor = saved_tensor
        self.saved_pipeline = saved_pipeline


def _is_distributed(ddp_model) -> bool:
    return bool(ddp_model.ddp_config.use_distributed_optimizer)


def _model_parallel_sizes() -> Dict[str, int]:
    return {"tensor": parallel.tp_size(), "pipeline": parallel.pp_size()}


def _content_metadata(ddp_model, optimizer_format: str) -> Dict[str, Any]:
    """What :func:`load_sharded` checks before it builds the state to load into."""
    return {"optimizer_format": optimizer_format if _is_distributed(ddp_model) else MODEL_SPACE,
            **_model_parallel_sizes()}


def _sharded_state_dict(ddp_model, optimizer, is_loading: bool, optimizer_format: str) -> Dict[str, Any]:
    model_state = inner_model(ddp_model).sharded_state_dict()
    if is_loading:
        mcore_fixes.before_optimizer_load(optimizer)
    else:
        mcore_fixes.ensure_optimizer_state(optimizer)
    # The mem-efficient flag is read by the fully_reshardable format only (distrib_optimizer.py,
    # sharded_param_state_fully_reshardable).
    metadata = {"distrib_optim_sharding_type": optimizer_format,
                "distrib_optim_fully_reshardable_mem_efficient": True}
    optimizer_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    return {"model": model_state, "optimizer": optimizer_state}


def _data_parallel_group():
    """The group the fully-parallel wrappers spread the work over: the ranks that hold the same
    model shard (Megatron-LM's ``get_data_parallel_group(with_context_parallel=True)``)."""
    return parallel.dp_group(with_context_parallel=True)


def _save_strategy():
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), _data_parallel_group())


def _load_strategy(folder: str, optimizer_format: str = ROUTINE_FORMAT):
    """The fully-parallel load for everything but a ``fully_reshardable`` optimizer state. That
    format's load template is every rank's whole TP x PP shard in host buffers
    (``get_parameter_state_dp_zero(empty_data=True, return_on_all_ranks=True)``), and the
    wrapper's exchange of host tensors goes through the device and back into a new host tensor
    (``exchange_utils.exchange_loaded_tensors_broadcast``: ``.cuda()``, broadcast,
    ``.to(orig_device)``), a second host copy of that state while the first is alive: each rank
    reads the whole shard itself instead (docs/cluster.md, "Checkpoints")."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(folder)
    if optimizer_format == RESHARDABLE_FORMAT:
        return strategy
    return FullyParallelLoadStrategyWrapper(strategy, _data_parallel_group())


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
    imports torch to unpickle the first write result. Python's first spawn also starts its
    resource tracker, and unblocks SIGINT and SIGTERM once that is started
    (``multiprocessing/resource_tracker.py``, ``ensure_running``: ``SIG_UNBLOCK`` after its own
    spawn), which would leave the Manager spawned next open to SIGTERM: the tracker is started
    before the mask is set. (megatron-core 0.16.1 forks the writer's own
    worker processes on every device; 0.19 writes from threads.) A forked process keeps the
    blocked mask too."""
    import multiprocessing
    from multiprocessing import resource_tracker

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from quatro_nemo.megatron.compat import cpu_compat_needed

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    if not cpu_compat_needed():
        resource_tracker.ensure_running()
    preemption_signals = {signal.SIGUSR1, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, preemption_signals)
    try:
        if cpu_compat_needed():
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        else:
            _megatron_write_results_queue(filesystem_async)()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _megatron_write_results_queue(filesystem_async):
    """megatron's function that starts the writer's Manager (spawned) and returns its queue:
    ``get_write_results_queue`` in megatron-core 0.19, ``_get_write_results_queue`` in 0.16.1."""
    return getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue


def save_sharded(folder: str, ddp_model, optimizer, common: Dict[str, Any],
                 optimizer_format: str = ROUTINE_FORMAT) -> None:
    """Save model + optimizer shards and ``common`` into ``folder`` (collective; every rank), the
    distributed optimizer's state in ``optimizer_format`` (module docstring)."""
    from megatron.core import dist_checkpointing

    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format={optimizer_format!r}: expected one of {OPTIMIZER_FORMATS}")
    os.makedirs(folder, exist_ok=True)  # megatron asks for an existing, empty folder
    _start_writer_manager_deaf_to_preemption()
    state = _sharded_state_dict(ddp_model, optimizer, is_loading=False, optimizer_format=optimizer_format)
    state["common"] = common
    dist_checkpointing.save(state, folder, sharded_strategy=_save_strategy(),
                            content_metadata=_content_metadata(ddp_model, optimizer_format))
    _release_pinned_staging()


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _release_pinned_staging() -> None:
    """megatron copies every tensor a rank writes to host memory before writing it
    (``FileSystemWriterAsync.preload_tensors``: ``tensor.to("cpu", non_blocking=True)``), and a
    non-blocking copy from the GPU pins its destination (aten's ``_to_copy``: ``pin_out``) through
    torch's caching host allocator, which keeps the blocks, each rounded up to a power of two,
    once they are freed. Hand them back after the save, so that the staging (about the bytes this
    rank writes) does not stay pinned through the rollouts beside the offloaded optimizer state.
    Nothing to do without CUDA."""
    import torch

    if _cuda_initialized():
        torch._C._host_emptyCache()


def saved_optimizer_format(folder: str) -> Dict[str, Any]:
    """``{"optimizer_format", "tensor", "pipeline"}`` as :func:`save_sharded` recorded them
    (``tensor``/``pipeline`` None for a checkpoint older than that record)."""
    from megatron.core import dist_checkpointing

    content = dist_checkpointing.load_content_metadata(folder) or {}
    return {"optimizer_format": content.get("optimizer_format", _FORMAT_WITHOUT_METADATA),
            "tensor": content.get("tensor"), "pipeline": content.get("pipeline")}


def _check_layout(folder: str, saved: Dict[str, Any], ddp_model) -> None:
    if saved["optimizer_format"] != ROUTINE_FORMAT:
        return
    if not _is_distributed(ddp_model):
        raise ValueError(f"{folder}: saved by the distributed optimizer in megatron's {ROUTINE_FORMAT} format; "
                         f"resume with scale.distributed_optimizer=true")
    current = _model_parallel_sizes()
    if (saved["tensor"], saved["pipeline"]) != (current["tensor"], current["pipeline"]):
        raise ReshardRequired(
            f"{folder}: the distributed optimizer's state was saved in megatron's {ROUTINE_FORMAT} format at "
            f"parallel.tensor={saved['tensor']}, parallel.pipeline={saved['pipeline']}, which reloads at any "
            f"data-parallel size but only at those TP/PP sizes; this run has parallel.tensor={current['tensor']}, "
            f"parallel.pipeline={current['pipeline']}. Rewrite it in the {RESHARDABLE_FORMAT} format first",
            saved["tensor"], saved["pipeline"])


def load_sharded(folder: str, ddp_model, optimizer) -> Dict[str, Any]:
    """Load ``folder`` into the model and optimizer of the current layout (collective); returns
    ``common``. Raises :class:`ReshardRequired` for a ``dp_reshardable`` optimizer state saved at
    other TP/PP sizes."""
    from megatron.core import dist_checkpointing

    saved = saved_optimizer_format(folder)
    _check_layout(folder, saved, ddp_model)
    # (a non-distributed optimizer, MODEL_SPACE, ignores the format asked for)
    optimizer_format = RESHARDABLE_FORMAT if saved["optimizer_format"] == RESHARDABLE_FORMAT else ROUTINE_FORMAT
    state = _sharded_state_dict(ddp_model, optimizer, is_loading=True, optimizer_format=optimizer_format)
    state["common"] = None
    loaded = dist_checkpointing.load(state, folder, sharded_strategy=_load_strategy(folder, optimizer_format),
                                     strict="assume_ok_unexpected")
    inner_model(ddp_model).load_state_dict(loaded["model"])
    mcore_fixes.load_optimizer_state(optimizer, loaded["optimizer"])
    return loaded["common"]


def load_model(folder: str, model) -> None:
    """Only the model weights of ``folder`` into ``model`` (DDP-wrapped or not; collective)."""
    from megatron.core import dist_checkpointing

    inner = inner_model(model)
    loaded = dist_checkpointing.load({"model": inner.sharded_state_dict()}, folder,
                                     sharded_strategy=_load_strategy(folder), strict="assume_ok_unexpected")
    inner.load_state_dict(loaded["model"])
