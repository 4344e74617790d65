"""megatron-core's own training machinery for a policy: DDP, the (distributed) optimizer, offload.

What Megatron-LM's ``pretrain`` sets up, reduced to what the RL loop needs:

- :func:`wrap_for_training`: the model inside megatron's ``DistributedDataParallel`` (contiguous
  float32 gradient buffers ``param.main_grad``, data-parallel reduction in
  ``finish_grad_sync``; with ``use_distributed_optimizer`` a reduce-scatter so that each DP rank
  holds the reduced gradient of its shard only).
- :func:`build_optimizer`: ``get_megatron_optimizer`` with Adam(W). bf16 models get float32
  master weights (Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.1); with
  ``distributed_optimizer`` the masters and Adam moments are sharded over DP (ZeRO-1, Rajbhandari
  et al. 2020, Sec. 5.1). Gradient clipping (global L2 norm over every model-parallel shard) is the
  optimizer's: ``step()`` returns the norm. Without Transformer Engine or apex (the CPU) megatron
  falls back to ``torch.optim.AdamW``.
- :func:`offload_training_state` / :func:`reload_training_state`: the optimizer state and the
  gradient buffers to host memory while a colocated rollout engine samples, and back
  (NeMo-RL's ``offload_before_refit``, verl's ``offload_megatron_*``).

Gradient semantics. Every micro-batch loss is already its additive share of the GLOBAL loss
(:mod:`quatro_nemo.megatron.loss`), so gradients must be SUMMED over data-parallel ranks, not
averaged: models are built with ``calculate_per_token_loss=True`` (:mod:`.models`), which is
megatron's switch for exactly that (DDP's gradient scaling factor 1, no division by the number of
micro-batches in the schedule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from quatro_nemo.megatron.compat import current_device


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer's hyper-parameters (``trainer.*``)."""

    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0           # global grad-norm clip; 0 disables (the norm is still reported)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without megatron's DDP wrapper (a ``GPTModel`` or its ``Float16Module``)."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def wrap_for_training(model: torch.nn.Module, distributed_optimizer: bool):
    """``model`` (from :func:`quatro_nemo.megatron.models.build_model`) in megatron's DDP.

    Gradients are reduced in float32 (``grad_reduce_in_fp32``), without overlap (the loop has one
    backward per micro-batch and no compute to hide the reduction behind on CPU; on GPUs the
    reduction of a mini-batch is a small part of an RL step). ``model`` keeps working for
    inference (sampling, log-probs): DDP holds the same parameters.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model, settings: OptimizerSettings):
    """megatron's optimizer over ``ddp_model``'s parameters (see the module docstring); it is
    distributed exactly when the DDP wrapper was built for one."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_model.config
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.grad_clip,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(optimizer_config, [ddp_model])


def set_learning_rate(optimizer, lr: float) -> None:
    """Every parameter group's learning rate (megatron keeps per-group ``lr_mult``; ours is 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def warmup_learning_rate(base_lr: float, warmup_steps: int, optimizer_steps_done: int) -> float:
    """Linear warm-up: ``base_lr * min(1, (s + 1) / warmup)`` for optimizer step ``s`` (0-based)."""
    return base_lr * min(1.0, (optimizer_steps_done + 1) / max(warmup_steps, 1))


def optimizer_step(ddp_model, optimizer) -> float:
    """One optimizer step on the finalised gradients; returns the global gradient norm (before
    clipping). Raises if the step was skipped (inf/nan gradients with a loss scaler)."""
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise FloatingPointError("the optimizer skipped a step: non-finite gradients")
    if not optimizer.config.clip_grad > 0.0:  # megatron computes the norm only when it clips
        grad_norm = optimizer.get_grad_norm()
    return float(grad_norm)


def has_gradient(ddp_model) -> bool:
    """Whether any entry of the DDP gradient buffers (``param.main_grad``) is non-zero on any rank
    (one MAX all-reduce over all ranks), after the step's backward passes. False: the loss had no
    gradient at all, and an optimizer step would move the weights by Adam's momentum and weight
    decay alone. (Under the distributed optimizer a rank's buffer outside its shard keeps its own
    unreduced gradient: still all zero exactly when every rank's gradient is.)"""
    nonzero = torch.zeros((), dtype=torch.float32, device=current_device())
    for param in inner_model(ddp_model).parameters():
        grad = getattr(param, "main_grad", None)
        if grad is not None:
            nonzero += torch.count_nonzero(grad).to(nonzero.device, torch.float32).clamp(max=1.0)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(nonzero, op=dist.ReduceOp.MAX)
    return bool(nonzero > 0)


def zero_gradients(ddp_model, optimizer) -> None:
    """Zero the DDP gradient buffers and the optimizer's main gradients before a new step."""
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


def offload_training_state(ddp_model, optimizer) -> None:
    """Optimizer state and gradient buffers to host memory (before a rollout engine wakes).

    No-op without CUDA: there is no device memory to free."""
    if not torch.cuda.is_available():
        return
    optimizer.offload_to_cpu()
    ddp_model.offload_grad_buffers()


def reload_training_state(ddp_model, optimizer) -> None:
    """Inverse of :func:`offload_training_state` (after the rollout engine sleeps)."""
    if not torch.cuda.is_available():
        return
    ddp_model.restore_grad_buffers()
    optimizer.restore_from_cpu()


__all__: List[str] = [
    "OptimizerSettings",
    "build_optimizer",
    "has_gradient",
    "inner_model",
    "offload_training_state",
    "optimizer_step",
    "reload_training_state",
    "set_learning_rate",
    "warmup_learning_rate",
    "wrap_for_training",
    "zero_gradients",
]
