"""Start and stop torch.distributed + megatron-core model parallelism, and small rank helpers.

One process per rank. ``initialize_parallel`` reads the usual ``env://`` variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; torchrun and our SLURM templates export them);
without ``WORLD_SIZE`` it makes a one-process group over a private ``tcp://`` rendezvous (nothing
exported for child processes to inherit), so the same code runs single-process.
The backend is gloo without CUDA (with :mod:`quatro_nemo.megatron.compat` applied) and nccl with.

Layout of the ranks is megatron-core's: TP innermost, then DP, then PP
(``world = TP * DP * PP``).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from quatro_nemo.megatron.compat import apply_cpu_compat, cpu_compat_needed


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates, e.g. for ``world.json``."""

    world_size: int
    rank: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


# What torchrun / the SLURM launcher export to describe a rank of a process group.
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK")


def standalone_environment() -> dict:
    """os.environ without the rendezvous variables (torchrun's TORCHELASTIC_* included: with
    TORCHELASTIC_USE_AGENT_STORE a child would wait forever for the parent's agent store), with one
    thread: for a child process that must start its own group rather than join this one."""
    env = {k: v for k, v in os.environ.items()
           if k not in RENDEZVOUS_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it): a private rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_cuda_device(rank: int) -> int:
    """This rank's GPU among the visible ones: ``LOCAL_RANK`` (else ``rank``) modulo the visible
    count. All of a node's GPUs visible (one rank per GPU): the local rank's own GPU; one GPU per
    task (SLURM ``--gpus-per-task=1`` or binding, ``CUDA_VISIBLE_DEVICES`` of one device): 0."""
    return int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()


def _timeout_minutes() -> int:
    """The same timeout in whole minutes for megatron's own groups (its default 30 when unset)."""
    timeout = process_group_timeout()
    return max(1, int(timeout.total_seconds() // 60)) if timeout else 30


def process_group_timeout() -> Optional[timedelta]:
    """``QUATRO_DIST_TIMEOUT_MIN``: minutes a collective may wait before the ranks abort (a rank
    writing a checkpoint to a slow filesystem holds the others at a barrier); slurm/lib/common.sh
    exports 30. Unset: torch's default (10 minutes for NCCL)."""
    minutes = os.environ.get("QUATRO_DIST_TIMEOUT_MIN")
    if not minutes:
        return None
    try:
        value = float(minutes)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"QUATRO_DIST_TIMEOUT_MIN={minutes!r} must be a positive number of minutes")
    return timedelta(minutes=value)


def initialize_parallel(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 1234,
    backend: Optional[str] = None,
) -> ParallelLayout:
    """Initialise torch.distributed, megatron's parallel groups and the model-parallel RNG.

    Args:
        tensor_parallel: TP size; must divide the world size.
        pipeline_parallel: PP size; ``tensor_parallel * pipeline_parallel`` must divide the world
            size, the quotient is the data-parallel size.
        seed: base seed. The CPU generator gets ``seed`` on every rank (so
            ``use_cpu_initialization`` weights agree across ranks), the TP tracker
            ``seed + 2718 + tp_rank`` (megatron's ``model_parallel_cuda_manual_seed``).
        backend: ``"gloo"`` or ``"nccl"``; default gloo without CUDA, nccl with.

    Returns the rank's :class:`ParallelLayout`. Raises ``ValueError`` on sizes that do not
    divide the world, naming them.
    """
    apply_cpu_compat()   # first: without CUDA it is what imports megatron-core (workaround 7)
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    if backend is None:
        backend = "gloo" if cpu_compat_needed() else "nccl"

    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            init_method = "env://"
        else:
            # one process: a private rendezvous, without exporting MASTER_* to child processes
            world_size, rank = 1, 0
            init_method = f"tcp://127.0.0.1:{free_port()}"
        if backend == "nccl":
            torch.cuda.set_device(local_cuda_device(rank))
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=process_group_timeout())

    world_size = dist.get_world_size()
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} and pipeline_parallel={pipeline_parallel} must be >= 1"
        )
    if world_size % (tensor_parallel * pipeline_parallel) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel={tensor_parallel} x "
            f"pipeline_parallel={pipeline_parallel}"
        )

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron's default also creates gloo twins of the DP groups, which its optimizers need.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        distributed_timeout_minutes=_timeout_minutes(),
    )
    mcore_tp.model_parallel_cuda_manual_seed(seed)
    return parallel_layout()


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def parallel_layout() -> ParallelLayout:
    """This rank's coordinates in the current megatron layout."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        data_parallel=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def is_first_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def dp_group(with_context_parallel: bool = False):
    """The data-parallel group; with its context-parallel ranks too where asked (the ranks that
    hold the same model shard, over which checkpoints spread their work)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=with_context_parallel)


def tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def pp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def last_stage_global_rank() -> int:
    """Global rank of the last pipeline stage in this rank's pipeline group (same TP/DP rank)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_last_rank()


def previous_stage_global_rank() -> int:
    """Global rank of the pipeline stage before this one (same TP/DP rank)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_prev_rank()


def next_stage_global_rank() -> int:
    """Global rank of the pipeline stage after this one (same TP/DP rank)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_next_rank()


def model_parallel_initialized() -> bool:
    """Whether megatron's model-parallel groups exist (:func:`initialize_parallel` ran)."""
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized()


def is_distributed() -> bool:
    """Whether this process belongs to a torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if is_distributed() else 1


def is_rank_zero() -> bool:
    """Global rank 0 (or no process group at all): the rank that writes logs and reports."""
    return global_rank() == 0


def model_parallel_rng_states() -> Optional[dict]:
    """States of megatron's model-parallel RNG tracker (seeded by :func:`initialize_parallel`);
    None while it is not initialised."""
    try:
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # tracker not initialised (no model-parallel seed set)
        return None


def set_model_parallel_rng_states(states: dict) -> None:
    """Restore states saved by :func:`model_parallel_rng_states`."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(states)
