"""KL estimators between token log-probabilities.

k3 (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
``KL(pi_theta || pi_ref) ~ exp(r) - r - 1`` with ``r = log pi_ref - log pi_theta``, per token,
unbiased and >= 0 under samples from pi_theta (paper App. B: the auxiliary reference KL).
"""
from __future__ import annotations

import torch

# Log-ratios are clamped to this magnitude before exp, so one wild token cannot overflow
# (the same guard verl applies to its KL estimators).
LOG_RATIO_GUARD = 20.0


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): ``exp(r) - r - 1``, r = ref - logprobs."""
    r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)
    return torch.exp(r) - r - 1.0


def k1_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_old || pi_theta) on samples from pi_old: ``old - logprobs``."""
    return old_logprobs - logprobs
