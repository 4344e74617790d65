"""Policy losses: QUATRO and six baselines, all with the same call shape (docs/interfaces.md).

    loss, metrics = loss_fn(logprobs [S, T], old_logprobs [S, T], advantages [S],
                            response_mask [S, T], config, normalizer,
                            ref_logprobs=None [S, T], entropy=None [S, T])

``loss`` and every metric are ADDITIVE shares of the global-batch value (``normalizer`` holds
global counts), except metric keys ending in ``/max`` or ``/min`` (reduce with max / min).
No ``.item()``: metrics stay 0-dim tensors. Every loss adds ``beta * k3`` reference KL.
Notation (quatro-math.md Sec. 4): ``r_t = log pi_theta - log pi_old`` per token,
``l_i = sum_t r_t``, ``log s_i = l_i / |o_i|``, ``s_i = exp(log s_i)``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from quatro_nemo.algos.aggregation import (
    LossNormalizer,
    aggregate_sequences,
    aggregate_tokens,
    masked_max,
    masked_values,
    masked_min,
    sequence_lengths,
)
from quatro_nemo.algos.config import (
    AlgorithmConfig,
    CISPOConfig,
    GMPOConfig,
    GPGConfig,
    GRPOConfig,
    GSPOConfig,
    QuatroConfig,
)
from quatro_nemo.algos.kl import LOG_RATIO_GUARD, k1_kl, k3_kl
from quatro_nemo.algos.registry import register_policy_loss

Metrics = Dict[str, torch.Tensor]


def _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, expected, name) -> torch.Tensor:
    """Validate shapes and the config class; return the mask in the log-probs' dtype."""
    if not isinstance(config, expected):
        raise ValueError(f"policy loss {name!r} needs a {expected.__name__}, got {type(config).__name__}")
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or response_mask.shape != logprobs.shape:
        raise ValueError(
            f"policy loss {name!r}: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must all be the same [S, T]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"policy loss {name!r}: advantages must be [S={logprobs.shape[0]}], got {tuple(advantages.shape)}")
    return response_mask.to(logprobs.dtype)


def _token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """r_t = log pi_theta - log pi_old, clamped to +-20 before any exp (verl's overflow guard)."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)


def _sequence_log_ratios(logprobs, old_logprobs, mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """(l_i = sum_t r_t, log s_i = l_i / |o_i|), both [S] (GSPO, arXiv:2507.18071, Eq. 7)."""
    log_ratio_sum = masked_values(logprobs - old_logprobs, mask).sum(dim=-1)
    return log_ratio_sum, log_ratio_sum / sequence_lengths(mask)


def _clamp_log_seq_ratio(log_seq_ratio, clamp: Optional[float], mask, normalizer, metrics: Metrics) -> torch.Tensor:
    """Optional safety clamp ``log s_i <= clamp`` (verl's GSPO uses 10); records ``policy/clamp_frac``."""
    if clamp is None:
        return log_seq_ratio
    fired = (log_seq_ratio.detach() > clamp).to(mask.dtype)
    metrics["policy/clamp_frac"] = aggregate_sequences(fired, mask, normalizer)
    return log_seq_ratio.clamp(max=clamp)


def _clipped_surrogate(ratio, advantages, clip_low, clip_high) -> Tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped loss ``max(-A r, -A clip(r, 1 - lo, 1 + hi))`` (Schulman et al.
    2017, Eq. 7) and the mask of entries where the clipped branch is taken."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config: AlgorithmConfig, normalizer,
            ref_logprobs, entropy) -> Tuple[torch.Tensor, Metrics]:
    """Add the beta-weighted k3 reference KL (paper App. B; each token's k3 capped at
    ``config.kl_clamp``, see ``kl.k3_kl``) and the metrics shared by all losses."""
    loss = pg_loss
    if ref_logprobs is not None:
        kl_ref = aggregate_tokens(k3_kl(logprobs, ref_logprobs, config.kl_clamp), mask, config.loss_agg_mode, normalizer)
        metrics["policy/kl_ref"] = kl_ref.detach()
        if config.beta > 0:
            loss = loss + config.beta * kl_ref
    elif config.beta > 0:
        raise ValueError(f"{type(config).__name__}.beta = {config.beta} > 0 needs ref_logprobs")
    metrics["policy/pg_loss"] = pg_loss.detach()
    metrics["policy/loss"] = loss.detach()
    metrics["policy/kl_old"] = aggregate_tokens(k1_kl(logprobs, old_logprobs).detach(), mask, "token-mean", normalizer)
    if entropy is not None:
        metrics["policy/entropy"] = aggregate_tokens(entropy.detach(), mask, "token-mean", normalizer)
    return loss, metrics


def _token_ratio_metrics(ratio, mask, normalizer) -> Metrics:
    ratio = ratio.detach()
    return {
        "policy/ratio/mean": aggregate_tokens(ratio, mask, "token-mean", normalizer),
        "policy/ratio/max": masked_max(ratio, mask),
        "policy/ratio/min": masked_min(ratio, mask),
    }


def _sequence_ratio_metrics(seq_ratio, mask, normalizer) -> Metrics:
    seq_ratio = seq_ratio.detach()
    has_tokens = mask.sum(dim=-1) > 0
    return {
        "policy/seq_ratio/mean": aggregate_sequences(seq_ratio, mask, normalizer),
        "policy/seq_ratio/max": masked_max(seq_ratio, has_tokens),
        "policy/seq_ratio/min": masked_min(seq_ratio, has_tokens),
    }


@register_policy_loss("quatro")
def quatro_loss(logprobs, old_logprobs, advantages, response_mask, config: QuatroConfig,
                normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """QUATRO (paper Eq. 17, quatro-math.md Sec. 4), averaged over all sequences of the batch:

        L = -(1/S) sum_i s_i * (A_i - sg[g_i]),   g_i = l_i (seq_sum) | log s_i (seq_mean) | 0 (none)

    Gradient ``-(1/S) sum_i s_i (A_i - g_i) grad log s_i``: zero when g_i = A_i (the policy has
    reached the trust-region optimum on the samples). No clipping or masking by default; the
    optional ``log_ratio_clamp`` (upper clamp on log s_i) and ``clip_low/high`` (GSPO-style clip
    of s_i) report how often they fire.
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, QuatroConfig, "quatro")
    log_ratio_sum, log_seq_ratio = _sequence_log_ratios(logprobs, old_logprobs, mask)
    has_tokens = mask.sum(dim=-1) > 0
    metrics: Metrics = {}
    seq_ratio = torch.exp(_clamp_log_seq_ratio(log_seq_ratio, config.log_ratio_clamp, mask, normalizer, metrics))  # s_i
    if config.log_ratio == "seq_sum":
        stat = log_ratio_sum
    elif config.log_ratio == "seq_mean":
        stat = log_seq_ratio
    else:
        stat = torch.zeros_like(log_seq_ratio)
    # Eq. 17: the trust-region target A_i minus the (stop-gradient) log-ratio already taken.
    target = advantages.to(logprobs.dtype) - stat.detach()
    if config.clip_low is None:
        per_sequence = -seq_ratio * target
    else:
        per_sequence, clipped = _clipped_surrogate(seq_ratio, target, config.clip_low, config.clip_high)
        metrics["policy/clip_frac"] = aggregate_sequences(clipped.to(mask.dtype), mask, normalizer)
    pg_loss = aggregate_sequences(per_sequence, mask, normalizer)
    metrics.update(_sequence_ratio_metrics(seq_ratio, mask, normalizer))
    stat = stat.detach()
    metrics["quatro/log_ratio_stat/mean"] = aggregate_sequences(stat, mask, normalizer)
    metrics["quatro/log_ratio_stat/max"] = masked_max(stat, has_tokens)
    metrics["quatro/log_ratio_stat/min"] = masked_min(stat, has_tokens)
    metrics["quatro/target_abs/mean"] = aggregate_sequences(target.detach().abs(), mask, normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)


@register_policy_loss("grpo", "dapo")
def ppo_clip_loss(logprobs, old_logprobs, advantages, response_mask, config: GRPOConfig,
                  normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """Token-level PPO clip (Schulman et al. 2017, Eq. 7) as used by GRPO (arXiv:2402.03300, Eq. 3)
    and DAPO (arXiv:2503.14476, Eq. 8: clip-higher ``(1 - 0.2, 1 + 0.28)``, token-mean):

        loss_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)),  r_t = exp(log pi - log pi_old)
    aggregated with ``config.loss_agg_mode``. With ``config.clip_ratio_c = c`` (off by default),
    the dual clip of Ye et al. 2020 (arXiv:1912.09729, Eq. 5) also caps tokens with A < 0:

        loss_t = min(loss_t, -A c)   if A < 0
    (for A < 0 PPO's loss ``-A r_t`` grows without bound in r_t; past ``r_t = c`` it is constant,
    no gradient), counted in ``policy/dual_clip_frac``.
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, GRPOConfig, "ppo_clip")
    ratio = torch.exp(_token_log_ratio(logprobs, old_logprobs))
    token_advantages = advantages.to(logprobs.dtype).unsqueeze(1)
    per_token, clipped = _clipped_surrogate(ratio, token_advantages, config.clip_low, config.clip_high)
    metrics = _token_ratio_metrics(ratio, mask, normalizer)
    metrics["policy/clip_frac"] = aggregate_tokens(clipped.to(mask.dtype), mask, "token-mean", normalizer)
    if config.clip_ratio_c is not None:
        dual_bound = -token_advantages * config.clip_ratio_c
        dual_clipped = (token_advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(dual_clipped, dual_bound, per_token)
        metrics["policy/dual_clip_frac"] = aggregate_tokens(dual_clipped.to(mask.dtype), mask, "token-mean", normalizer)
    pg_loss = aggregate_tokens(per_token, mask, config.loss_agg_mode, normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)


@register_policy_loss("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, response_mask, config: GSPOConfig,
              normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """GSPO (arXiv:2507.18071, Eq. 5-7): sequence ratio ``s_i = exp(mean_t r_t)`` in a PPO clip,

        L = (1/S) sum_i max(-A_i s_i, -A_i clip(s_i, 1 - 3e-4, 1 + 4e-4)),
    log s_i clamped above at ``log_ratio_clamp`` (10 as in verl) before exp. Equal to verl's
    token-level form with ``seq-mean-token-mean`` (s_i is the same on every token of o_i).
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, GSPOConfig, "gspo")
    _, log_seq_ratio = _sequence_log_ratios(logprobs, old_logprobs, mask)
    metrics: Metrics = {}
    seq_ratio = torch.exp(_clamp_log_seq_ratio(log_seq_ratio, config.log_ratio_clamp, mask, normalizer, metrics))
    per_sequence, clipped = _clipped_surrogate(seq_ratio, advantages.to(logprobs.dtype), config.clip_low, config.clip_high)
    pg_loss = aggregate_sequences(per_sequence, mask, normalizer)
    metrics.update(_sequence_ratio_metrics(seq_ratio, mask, normalizer))
    metrics["policy/clip_frac"] = aggregate_sequences(clipped.to(mask.dtype), mask, normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)


@register_policy_loss("gmpo")
def gmpo_loss(logprobs, old_logprobs, advantages, response_mask, config: GMPOConfig,
              normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """GMPO (arXiv:2507.20673, Eq. 4; verl ``compute_policy_loss_geo_mean``): geometric mean of
    token ratios with the token clip applied in log space,

        c_t = sign(A) * min(sign(A) r_t, sign(A) clip(r_t, -clip_low, clip_high))
        L = (1/S) sum_i -A_i * exp(mean_t c_t).
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, GMPOConfig, "gmpo")
    adv = advantages.to(logprobs.dtype)
    log_ratio = _token_log_ratio(logprobs, old_logprobs)
    sign = torch.sign(adv).unsqueeze(1)
    log_ratio_clipped = log_ratio.clamp(-config.clip_low, config.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)
    geo_mean_ratio = torch.exp(masked_values(pessimistic, mask).sum(dim=-1) / sequence_lengths(mask))
    pg_loss = aggregate_sequences(-adv * geo_mean_ratio, mask, normalizer)
    clipped = (sign * log_ratio_clipped < sign * log_ratio).to(mask.dtype)
    metrics = _sequence_ratio_metrics(geo_mean_ratio, mask, normalizer)
    metrics["policy/clip_frac"] = aggregate_tokens(clipped, mask, "token-mean", normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)


@register_policy_loss("cispo")
def cispo_loss(logprobs, old_logprobs, advantages, response_mask, config: CISPOConfig,
               normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, Eq. 4-5): clip the importance WEIGHT, keep every gradient,

        loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A * log pi_theta(o_t),
    aggregated with ``config.loss_agg_mode`` (token-mean).
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, CISPOConfig, "cispo")
    ratio = torch.exp(_token_log_ratio(logprobs, old_logprobs))
    # 0 at masked positions, whose log-probs may be NaN or inf: the weight multiplies the gradient.
    weight = torch.where(mask != 0, ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high),
                         torch.zeros_like(ratio)).detach()
    per_token = -weight * advantages.to(logprobs.dtype).unsqueeze(1) * logprobs
    pg_loss = aggregate_tokens(per_token, mask, config.loss_agg_mode, normalizer)
    metrics = _token_ratio_metrics(ratio, mask, normalizer)
    metrics["policy/clip_frac"] = aggregate_tokens((weight != ratio.detach()).to(mask.dtype), mask, "token-mean", normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)


@register_policy_loss("gpg")
def gpg_loss(logprobs, old_logprobs, advantages, response_mask, config: GPGConfig,
             normalizer: LossNormalizer, ref_logprobs=None, entropy=None) -> Tuple[torch.Tensor, Metrics]:
    """GPG (arXiv:2504.02546, Eq. 6; verl ``compute_policy_loss_gpg``): plain policy gradient,
    no ratio, ``loss_t = -A * log pi_theta(o_t)``, aggregated with ``config.loss_agg_mode``."""
    mask = _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, GPGConfig, "gpg")
    per_token = -advantages.to(logprobs.dtype).unsqueeze(1) * logprobs
    pg_loss = aggregate_tokens(per_token, mask, config.loss_agg_mode, normalizer)
    metrics = _token_ratio_metrics(torch.exp(_token_log_ratio(logprobs, old_logprobs)), mask, normalizer)
    return _finish(pg_loss, metrics, logprobs, old_logprobs, mask, config, normalizer, ref_logprobs, entropy)
