"""Build the rollout backend a run's config names (``rollout.backend``): above both backends,
:mod:`quatro_nemo.engine.rollout` (megatron) and :mod:`quatro_nemo.engine.vllm_backend` (vLLM),
which both build on the former's :class:`~quatro_nemo.engine.rollout.RolloutBatch`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from quatro_nemo.engine.capabilities import RolloutBackendName
from quatro_nemo.engine.rollout import MegatronRolloutBackend, RolloutBackend
from quatro_nemo.engine.vllm_backend import VllmRolloutBackend
from quatro_nemo.validation import check_choice

if TYPE_CHECKING:
    from quatro_nemo.engine.config import ExperimentConfig


def build_rollout_backend(cfg: "ExperimentConfig", model, model_config, task) -> RolloutBackend:
    """The backend ``cfg.rollout.backend`` names, built for the policy ``model`` (this rank's
    stage), its ``model_config`` (:class:`~quatro_nemo.megatron.models.ModelConfig`) and the
    ``task`` (:class:`~quatro_nemo.tasks.base.Task`: end and pad tokens)."""
    name = check_choice("rollout.backend", cfg.rollout.backend, RolloutBackendName)
    if name is RolloutBackendName.megatron:
        return MegatronRolloutBackend(model, stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
    return VllmRolloutBackend(model, model_config, engine=cfg.vllm,
                              stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)


def hand_over_training_state(backend: RolloutBackend, cfg: "ExperimentConfig", policy_ddp, optimizer) -> None:
    """Give the backend the training state it moves off the device around its sampling calls
    (rollouts and evaluation): a colocated vLLM engine needs the memory the optimizer state and
    gradients hold, with ``scale.offload_optimizer_in_rollout`` (the memory plan's phases). The
    megatron backend samples with the trained model itself and keeps everything in place."""
    if cfg.scale.offload_optimizer_in_rollout and isinstance(backend, VllmRolloutBackend):
        backend.manage_training_state(policy_ddp, optimizer)
