"""The collectives the engine needs, over megatron-core's process groups: data-parallel sums and
gathers, a gather of every rank's small objects, barriers. The engine calls these and never
``torch.distributed`` itself (the layering contract in ``pyproject.toml``)."""
from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.compat import current_device


def barrier() -> None:
    """Wait for every rank of the default group (nothing to wait for without one)."""
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj: Any) -> List[Any]:
    """Every rank's picklable ``obj`` in global-rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def dp_all_gather(tensor: torch.Tensor) -> List[torch.Tensor]:
    """Every DP rank's `tensor` (same shape on all ranks), in DP-rank order."""
    size = parallel.dp_size()
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel.dp_group())
    return parts


def dp_all_gather_objects(obj: Any) -> List[Any]:
    """Every DP rank's picklable ``obj``, in DP-rank order."""
    if parallel.dp_size() == 1:
        return [obj]
    out: List[Any] = [None] * parallel.dp_size()
    dist.all_gather_object(out, obj, group=parallel.dp_group())
    return out


def dp_sum_in_place(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed element-wise over the data-parallel ranks, in place; returns it."""
    if dist.is_initialized() and parallel.dp_size() > 1:
        dist.all_reduce(tensor, group=parallel.dp_group())
    return tensor


def dp_sum(value: torch.Tensor) -> float:
    """Sum of a scalar over data-parallel ranks."""
    return float(dp_sum_in_place(value.detach().double().reshape(1).clone().to(current_device())))


def tp_all_gather_objects(obj: Any) -> List[Any]:
    """Every tensor-parallel rank's picklable ``obj``, in TP-rank order."""
    gathered: List[Any] = [None] * parallel.tp_size()
    dist.all_gather_object(gathered, obj, group=parallel.tp_group())
    return gathered
