"""Advantage estimators: rewards [B, N] (B prompts x N responses) -> advantages [B, N] + metrics.

All share one call shape, ``estimator(rewards, config, sample_weights=None) -> AdvantageOutput``.
Metrics are 0-dim tensors computed over the batch given (the engine passes the global rollout
batch). ``sample_weights`` (:class:`~quatro_nemo.algos.off_policy.SampleWeights`) are a stale
rollout's importance weights pi_prox / mu (docs/quatro-math.md Sec. 9): QUATRO's dual takes them as
its base measure; the group baselines keep their unweighted statistics (Sec. 9.4 [choice]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from quatro_nemo.algos.adaptive_delta import per_query_delta
from quatro_nemo.algos.config import GPGConfig, GroupBaselineConfig, QuatroConfig
from quatro_nemo.algos.dual import check_rewards, solve_dual
from quatro_nemo.algos.off_policy import SampleWeights
from quatro_nemo.algos.registry import register_advantage_estimator

LAMBDA_QUANTILES = (0.1, 0.5, 0.9)


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor          # [B, N], dtype of the rewards (float32 for integer rewards)
    metrics: Dict[str, torch.Tensor]  # 0-dim tensors


def _check_config(config: object, expected: type, estimator: str) -> None:
    if not isinstance(config, expected):
        raise ValueError(f"advantage estimator {estimator!r} needs a {expected.__name__}, got {type(config).__name__}")


def _output_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _advantage_metrics(advantages: torch.Tensor, constant: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Metrics every estimator reports: advantage range and the share of all-equal groups."""
    return {
        "adv/mean": advantages.mean(),
        "adv/abs_mean": advantages.abs().mean(),
        "adv/max": advantages.max(),
        "adv/min": advantages.min(),
        "adv/constant_group_frac": constant.to(torch.float64).mean(),
    }


def _group_constant(rewards: torch.Tensor) -> torch.Tensor:
    return (rewards == rewards[:, :1]).all(dim=1)


@register_advantage_estimator("quatro")
def quatro_advantages(rewards: torch.Tensor, config: QuatroConfig,
                      sample_weights: Optional[SampleWeights] = None) -> AdvantageOutput:
    """QUATRO advantage ``A_i = (R_i - (lam* + mu*)) / lam*`` (paper Eq. 15, quatro-math.md Sec. 3)
    with lam* from the exact per-query dual solve (Eq. 11, ``solve_dual``).

    Metrics: lambda mean/min/max/p10/p50/p90 and mean achieved KL over the non-constant groups
    (0 when every group is constant), ``quatro/tr_inactive_frac`` and ``adv/constant_group_frac``
    (fractions of all B groups), ``quatro/solver_iters``. With an adaptive radius
    (``config.adaptive_delta``, docs/quatro-math.md Sec. 7) the radius is ``config.delta`` (the
    controller's, set by the loop) or the per-query ``delta_q`` of ``per_query_delta``, and
    ``quatro/delta/{mean,min,max}`` over the non-constant groups are added.

    With ``sample_weights`` (a stale rollout, docs/quatro-math.md Sec. 9.3) the dual is solved on
    the per-prompt normalised weights w̄ (``solve_dual(weights=)``); a group whose effective sample
    fraction is below ``sample_weights.ess_floor`` counts as constant (its rewards are treated as
    equal: A = 0), and ``quatro/low_ess_frac`` counts those groups."""
    _check_config(config, QuatroConfig, "quatro")
    weights = None
    if sample_weights is not None:
        low_ess = sample_weights.low_ess
        rewards = torch.where(low_ess.unsqueeze(1), torch.zeros_like(rewards), rewards)
        weights = sample_weights.normalised
    delta = config.delta
    per_query = config.delta_per_query
    if per_query.kind == "reward_variance":
        delta = per_query_delta(rewards, config.delta, per_query.variance_ref, per_query.cap_fraction,
                                config.lambda_min, sample_weights)
    sol = solve_dual(rewards, delta, lambda_min=config.lambda_min, max_iter=config.solver_max_iter, weights=weights)
    advantages = sol.advantages.to(_output_dtype(rewards))
    informative = ~sol.constant
    lam = sol.lam[informative]
    metrics = _advantage_metrics(sol.advantages, sol.constant)
    metrics["quatro/tr_inactive_frac"] = sol.inactive.to(torch.float64).mean()
    metrics["quatro/solver_iters"] = torch.tensor(float(sol.iterations), dtype=torch.float64)
    if sample_weights is not None:
        metrics["quatro/low_ess_frac"] = low_ess.to(torch.float64).mean()
    if lam.numel() == 0:  # every group constant: keep the keys, report zeros
        lam = torch.zeros(1, dtype=sol.lam.dtype, device=sol.lam.device)
        informative = torch.zeros_like(sol.constant)
    metrics["quatro/lambda/mean"] = lam.mean()
    metrics["quatro/lambda/min"] = lam.min()
    metrics["quatro/lambda/max"] = lam.max()
    quantiles = torch.quantile(lam, torch.tensor(LAMBDA_QUANTILES, dtype=lam.dtype, device=lam.device))
    for q, value in zip(LAMBDA_QUANTILES, quantiles):
        metrics[f"quatro/lambda/p{int(round(q * 100))}"] = value
    metrics["quatro/kl/mean"] = (sol.kl * informative).sum() / informative.sum().clamp_min(1)
    if config.adaptive_delta:
        radii = torch.as_tensor(delta, dtype=torch.float64).expand(sol.kl.shape)[informative]
        if radii.numel() == 0:
            radii = torch.full((1,), float(config.delta), dtype=torch.float64)
        metrics.update({"quatro/delta/mean": radii.mean(), "quatro/delta/min": radii.min(),
                        "quatro/delta/max": radii.max()})
    return AdvantageOutput(advantages=advantages, metrics=metrics)


def _group_centered(rewards: torch.Tensor, config: GroupBaselineConfig) -> torch.Tensor:
    """``(R - mean_group) / (std_group + eps)`` or ``R - mean_group`` (float64; unbiased std as
    torch.std). Groups whose rewards are all equal get exactly 0 (no 0/0 even with eps = 0)."""
    r = rewards.detach().to(torch.float64)
    centered = r - r.mean(dim=1, keepdim=True)
    if config.norm_by_std:
        centered = centered / (r.std(dim=1, keepdim=True) + config.eps)
    return torch.where(_group_constant(rewards).unsqueeze(1), torch.zeros_like(centered), centered)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, config: GroupBaselineConfig,
                    sample_weights: Optional[SampleWeights] = None) -> AdvantageOutput:
    """GRPO outcome advantage ``(R_i - mean(R)) / (std(R) + eps)`` per group (DeepSeekMath,
    arXiv:2402.03300, Sec. 4.1.2); ``norm_by_std=False`` keeps only ``R_i - mean(R)`` (Dr. GRPO).
    ``sample_weights`` are not used (docs/quatro-math.md Sec. 9.4)."""
    _check_config(config, GroupBaselineConfig, "grpo")
    check_rewards(rewards)
    advantages = _group_centered(rewards, config)
    return AdvantageOutput(advantages.to(_output_dtype(rewards)), _advantage_metrics(advantages, _group_constant(rewards)))


@register_advantage_estimator("gpg")
def gpg_advantages(rewards: torch.Tensor, config: GPGConfig,
                   sample_weights: Optional[SampleWeights] = None) -> AdvantageOutput:
    """GPG advantage ``alpha * (R_i - mean(R)) [/ (std + eps)]`` with
    ``alpha = (B * N) / (#samples in groups whose rewards are not all equal)`` (GPG,
    arXiv:2504.02546, Eq. 7-8: alpha = B / (B - M), M = samples with zero advantage).
    ``sample_weights`` are not used (docs/quatro-math.md Sec. 9.4)."""
    _check_config(config, GPGConfig, "gpg")
    check_rewards(rewards)
    constant = _group_constant(rewards)
    num_informative = (~constant).sum() * rewards.shape[1]
    alpha = rewards.numel() / num_informative.clamp_min(1).to(torch.float64)
    advantages = alpha * _group_centered(rewards, config)
    metrics = _advantage_metrics(advantages, constant)
    metrics["gpg/alpha"] = alpha
    return AdvantageOutput(advantages.to(_output_dtype(rewards)), metrics)
