"""The training step's side of a rollout sampled by older weights (docs/quatro-math.md Sec. 9.2-9.6).

:func:`correct_stale_rollout` runs after the trainer recomputed ``log pi_prox`` (the batch's
``old_logprobs``) and before the advantages: it builds the step's global importance weights from
mu's log-probs (the rollout's ``engine_logprobs``) and applies the configured correction to the
batch the K inner loops train on:

- ``proximal``: ``is_weights`` = ``N w̄_i`` on every token of response i (each sample's gradient
  weighted, Sec. 9.5), and the weights go to the advantage estimator (QUATRO's dual) and to the
  achieved-KL measurement;
- ``behaviour``: ``old_logprobs`` := mu's log-probs (pi_old := mu; unweighted);
- ``none``: nothing (the control arm).

``async/ess_frac`` (the mean effective sample fraction of the step's groups) is logged whatever
the correction. Rollouts sampled by the current weights never come here (Sec. 9.1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

import torch

from quatro_nemo.algos.off_policy import OffPolicyCorrection, SampleWeights, behaviour_log_weights
from quatro_nemo.engine.pipeline import PipelineConfig
from quatro_nemo.engine.rollout import RolloutBatch


@dataclass
class OffPolicyStep:
    """What a stale rollout's correction hands the rest of the step: the importance weights when
    they enter the dual and the achieved KL (``proximal``), and the step's metrics."""

    sample_weights: Optional[SampleWeights] = None
    metrics: Dict[str, float] = field(default_factory=dict)


def correct_stale_rollout(pipeline: PipelineConfig, rollout: RolloutBatch, batch: Dict[str, torch.Tensor],
                          slots: Sequence[int], to_global: Callable[[torch.Tensor], torch.Tensor],
                          correct: bool = True) -> OffPolicyStep:
    """Weights and correction of this rank's ``rollout`` (module docstring), ``batch`` updated in
    place. ``slots``: this rank's global prompt slots; ``to_global``: [B_local, N] -> [B, N] in
    global prompt order (collective over data-parallel ranks). ``correct=False`` measures only
    (a rollout sampled by the current weights: its ESS, from the engine's numerical gap)."""
    if rollout.engine_logprobs is None:
        raise ValueError("a rollout sampled by older weights needs its sampler's log-probs (engine_logprobs)")
    prox = batch["old_logprobs"]
    behaviour = rollout.engine_logprobs.to(prox.device)
    log_w = behaviour_log_weights(prox, behaviour, rollout.response_mask.to(prox.device), pipeline.weight)
    weights = SampleWeights.from_log_weights(to_global(log_w.view(len(slots), rollout.num_samples)),
                                             pipeline.ess_floor)
    step = OffPolicyStep(metrics={"async/ess_frac": float(weights.ess_frac.mean())})
    if not correct or pipeline.correction == OffPolicyCorrection.none:
        return step
    if pipeline.correction == OffPolicyCorrection.behaviour:
        batch["old_logprobs"] = behaviour.to(prox.dtype)
        return step
    local = weights.loss_weights[list(slots)].reshape(-1).to(device=prox.device, dtype=torch.float32)
    batch["is_weights"] = local.unsqueeze(1).expand_as(prox).contiguous()
    step.sample_weights = weights
    return step


__all__ = ["OffPolicyStep", "correct_stale_rollout"]
