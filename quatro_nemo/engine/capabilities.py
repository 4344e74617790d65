"""What the engine can run: the rules a config must meet for the loop and its backends to work,
whatever the memory (which is :mod:`quatro_nemo.engine.memory_plan`'s business).

One rule, one function; each raises :class:`~quatro_nemo.validation.ConfigError` naming the key.
:func:`check_engine_support` applies the config-level ones to a validated run config
(``quatro_nemo.engine.config.validate``, every run); the planner applies them to the layout it
plans; the vLLM backend applies :func:`check_vllm_layout` once the process groups exist, and the
loop :func:`quatro_nemo.validation.check_mini_batches` with the data-parallel size.

The engine's choices of device and rollout backend (:class:`Device`, :class:`RolloutBackendName`)
are declared here, below both the run config (``trainer.device``, ``rollout.backend``) and the
memory planner (:class:`quatro_nemo.engine.memory_plan.Runtime`), which read them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from quatro_nemo.validation import Choice, ConfigError

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ExperimentConfig


class Device(Choice):
    """``trainer.device``: where the policy trains (auto: cuda when available)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class RolloutBackendName(Choice):
    """``rollout.backend``: megatron (the trained model samples) | vllm (a colocated vLLM engine)."""

    megatron = "megatron"
    vllm = "vllm"


def check_params_dtype(params_dtype: str) -> None:
    """float16 needs a loss scaler, which the engine's megatron optimizer runs without."""
    if params_dtype == "float16":
        raise ConfigError("model.params_dtype=float16: the engine's megatron optimizer runs without a loss "
                          "scaler; use bfloat16 (GPU) or float32")


def check_sequence_parallel(sequence_parallel: bool) -> None:
    """Megatron's sequence parallelism needs sequences padded to a multiple of TP; the loop pads
    rollouts to their longest sequence."""
    if sequence_parallel:
        raise ConfigError("model.extra.sequence_parallel=true: the loop pads rollouts to their longest sequence, "
                          "not to a multiple of parallel.tensor, which megatron's sequence parallelism needs; remove it")


def check_tensor_split(ffn_hidden_size: int, tensor: int) -> None:
    """Megatron splits the MLP's columns evenly over the tensor-parallel ranks."""
    if ffn_hidden_size % tensor:
        raise ConfigError(f"parallel.tensor={tensor} does not divide model.ffn_hidden_size={ffn_hidden_size} "
                          "(megatron splits the MLP columns evenly)")


def check_vllm_layout(pipeline: int, tensor: int, vllm_tensor: int) -> None:
    """The vLLM backend builds its engines inside one megatron tensor-parallel group
    (``quatro_nemo.engine.vllm_backend``): no pipeline stages, whole engines per group."""
    if pipeline != 1:
        raise ConfigError(f"parallel.pipeline={pipeline} with rollout.backend=vllm: the vLLM backend builds its "
                          "engines inside a tensor-parallel group and needs parallel.pipeline=1")
    if tensor % vllm_tensor:
        raise ConfigError(f"vllm.tensor_parallel={vllm_tensor} does not divide parallel.tensor={tensor} "
                          "(each vLLM engine lives inside one megatron tensor-parallel group)")


def check_rollout_executor(executor: str, backend: str, tensor: int, pipeline: int) -> None:
    """``rollout.pipeline.executor=process`` runs megatron's sampler on a TP=1, PP=1 copy of the
    policy in a worker process (``quatro_nemo.engine.rollout_worker``), fed the trainer's whole
    parameters: the trainer must hold them whole, and the vLLM engine does not run there yet."""
    if executor != "process":
        return
    if backend != RolloutBackendName.megatron:
        raise ConfigError(f"rollout.pipeline.executor=process with rollout.backend={backend}: the rollout worker "
                          "runs megatron's sampler only (use rollout.backend=megatron, or executor=inline)")
    if tensor != 1 or pipeline != 1:
        raise ConfigError(f"rollout.pipeline.executor=process needs parallel.tensor=1 and parallel.pipeline=1 (got "
                          f"{tensor} and {pipeline}): the worker is fed the trainer's whole parameters")


def check_engine_support(cfg: "ExperimentConfig") -> None:
    """The rules above that a run config alone decides (the data-parallel size is known once the
    processes start: the loop checks the mini-batches' split then)."""
    model, tensor = cfg.model, cfg.parallel.tensor
    check_params_dtype(model.params_dtype)
    check_sequence_parallel(bool((model.extra or {}).get("sequence_parallel", False)))
    check_tensor_split(model.ffn_hidden_size, tensor)
    if cfg.rollout.backend == RolloutBackendName.vllm:
        check_vllm_layout(cfg.parallel.pipeline, tensor, cfg.vllm.tensor_parallel)
    check_rollout_executor(cfg.rollout.pipeline.executor, cfg.rollout.backend, tensor, cfg.parallel.pipeline)


__all__ = ["Device", "RolloutBackendName", "check_engine_support", "check_params_dtype", "check_rollout_executor",
           "check_sequence_parallel", "check_tensor_split", "check_vllm_layout"]
