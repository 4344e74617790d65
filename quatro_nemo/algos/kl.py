"""KL estimators between token log-probabilities.

k3 (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
``KL(pi_theta || pi_ref) ~ exp(r) - r - 1`` with ``r = log pi_ref - log pi_theta``, per token,
unbiased and >= 0 under samples from pi_theta (paper App. B: the auxiliary reference KL).
"""
from __future__ import annotations

import torch

# Log-ratios are clamped to [-20, 20] before exp, so one wild token cannot overflow (verl's
# ``kl_penalty`` clamps its log-ratio to the same range before exp).
LOG_RATIO_GUARD = 20.0

# Default cap on each token's k3 value (verl's ``low_var_kl`` clamps k3 to [-10, 10]).
K3_CLAMP = 10.0


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = K3_CLAMP) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) (Schulman 2020): ``exp(r) - r - 1``,
    ``r = ref - logprobs`` clamped to +-LOG_RATIO_GUARD.

    ``clamp > 0`` caps each token's value at ``clamp`` (verl clamps to ``[-clamp, clamp]``; k3 >= 0,
    so only the upper bound can act). This caps the VALUE, it does not clip the gradient: a token
    whose k3 exceeds ``clamp`` (for 10: ``r`` above about 2.61, i.e. pi_ref far more likely than
    pi_theta, or ``r`` below about -11) contributes the constant ``clamp`` and NO gradient, where
    the bare estimator's gradient ``d k3 / d log pi_theta = 1 - exp(r)`` would be -3.3e6 at r = 15.
    ``clamp = 0`` turns this cap off; the guard on ``r`` stays in every case, so past
    ``|r| = LOG_RATIO_GUARD`` the value is that of ``r = +-20`` (``exp(20) - 21`` above) and the
    gradient is 0.
    """
    r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)
    kl = torch.exp(r) - r - 1.0
    if clamp > 0:
        kl = kl.clamp(max=clamp)
    return kl


def k1_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_old || pi_theta) on samples from pi_old: ``old - logprobs``
    (Schulman 2020, k1)."""
    return old_logprobs - logprobs
