"""Truncated importance sampling between the rollout engine and the trained policy.

The rollout engine (vLLM) samples from its own copy mu of the policy; the losses are written for
samples from pi_old, which the trainer recomputes (docs/quatro-math.md Sec. 8). Truncated
importance sampling (TIS: Ionides 2008, "Truncated importance sampling", J. Comput. Graph. Stat.;
as verl's ``rollout_is`` and Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training") weights each sample's gradient by the capped ratio pi_old / mu.
"""
from __future__ import annotations

import torch

from quatro_nemo.validation import Choice


class ImportanceCorrection(Choice):
    """``rollout.importance_correction``: what one weight covers."""

    none = "none"
    token = "token"          # w_{i,t} = min(pi_old(o_t) / mu(o_t), C)
    sequence = "sequence"    # w_i = min(prod_t pi_old(o_t) / mu(o_t), C), on every token of o_i


def truncated_importance_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                                 response_mask: torch.Tensor, mode: ImportanceCorrection,
                                 cap: float) -> torch.Tensor:
    """The detached weights of docs/quatro-math.md Sec. 8 (the ``min(pi_old/mu, C)`` of TIS).

    Args:
        old_logprobs: [S, T] log pi_old(o_t), the trainer's recomputation.
        engine_logprobs: [S, T] log mu(o_t), the engine's, at temperature 1.
        response_mask: [S, T] 1 on response tokens.
        mode: token or sequence weights (:class:`ImportanceCorrection`; ``none`` gives ones).
        cap: C > 0.

    Returns [S, T] float32 weights, 1 outside the response.
    """
    if cap <= 0:
        raise ValueError(f"importance cap must be > 0, got {cap}")
    mask = response_mask.float()
    log_ratio = (old_logprobs.double() - engine_logprobs.double()) * mask
    if mode == ImportanceCorrection.none:
        return torch.ones_like(mask)
    if mode == ImportanceCorrection.sequence:
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask)
    weights = torch.exp(torch.clamp(log_ratio, max=torch.log(torch.tensor(float(cap), dtype=torch.float64))))
    return torch.where(mask > 0, weights, torch.ones_like(weights)).float().detach()


def importance_weighted_logprobs(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``logprobs`` with the same values and gradients scaled by ``weights`` token by token:
    ``lp.detach() + w * (lp - lp.detach())``. Any loss of these log-probs then has the
    importance-weighted gradient of TIS (each token's, or with sequence weights each sequence's,
    contribution times its weight), whatever its form, while its value and metrics are unchanged."""
    detached = logprobs.detach()
    return detached + weights.to(logprobs.dtype) * (logprobs - detached)


__all__ = ["ImportanceCorrection", "importance_weighted_logprobs", "truncated_importance_weights"]
