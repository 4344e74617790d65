"""Off-policy correction for a sampler k steps behind the trainer (docs/quatro-math.md Sec. 9).

A stale rollout's responses come from the behaviour policy mu (the weights that sampled them);
the trust region and the losses are written for samples from the proximal policy pi_prox (the
trainer's weights at the start of the step, the loop's recomputed ``old_logprobs``). This module
holds what the three corrections of Sec. 9.2 need, as pure functions on tensors:

- :class:`OffPolicyCorrection`: ``proximal`` (decoupled: pi_prox anchors, importance weights in
  QUATRO's dual and in every loss's gradient), ``behaviour`` (bypass: pi_old := mu) and ``none``
  (pi_prox anchors, the samples are treated as its own: the control arm);
- :func:`behaviour_log_weights`: each response's ``log w_i = log pi_prox(o_i) / mu(o_i)``, exact
  (``sequence``) or length-normalised (``seq_mean``) (Sec. 9.3);
- :class:`SampleWeights`: their per-prompt normalisation w̄, the effective sample size and the
  loss's per-sample gradient weights ``N w̄_i`` (Sec. 9.3, 9.5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quatro_nemo.validation import Choice


class OffPolicyCorrection(Choice):
    """``rollout.pipeline.correction`` (Sec. 9.2) [choice]."""

    proximal = "proximal"    # trust region around pi_prox; weights pi_prox / mu in the dual and the gradient
    behaviour = "behaviour"  # trust region around mu: old_logprobs := mu's log-probs
    none = "none"            # trust region around pi_prox, uniform weights (the control arm)


class BehaviourWeight(Choice):
    """``rollout.pipeline.weight``: what one response's importance weight is (Sec. 9.3) [choice]."""

    sequence = "sequence"    # log w_i = sum_t (log pi_prox - log mu): the exact sequence ratio
    seq_mean = "seq_mean"    # log w_i = mean_t (log pi_prox - log mu): length-normalised, as GSPO's s_i


# [choice] Sec. 9.3: a group with fewer than N / 4 effective samples counts as constant in QUATRO's dual.
DEFAULT_ESS_FLOOR = 0.25


def behaviour_log_weights(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          response_mask: torch.Tensor, kind: BehaviourWeight) -> torch.Tensor:
    """Each response's log importance weight ``log w_i`` [S] (float64), Sec. 9.3:

        sequence:  sum_t (log pi_prox(o_t) - log mu(o_t))
        seq_mean:  the same divided by |o_i| (a response without tokens: 0)

    Args:
        prox_logprobs: [S, T] log pi_prox of each sampled token (the trainer's recomputation).
        behaviour_logprobs: [S, T] log mu of the same tokens (temperature 1).
        response_mask: [S, T] 1 on response tokens; values elsewhere (NaN included) are ignored.
        kind: :class:`BehaviourWeight`.
    """
    mask = response_mask.to(torch.float64) != 0
    diff = torch.where(mask, prox_logprobs.to(torch.float64) - behaviour_logprobs.to(torch.float64),
                       torch.zeros((), dtype=torch.float64))
    log_w = diff.sum(dim=-1)
    if BehaviourWeight(kind) == BehaviourWeight.seq_mean:
        log_w = log_w / mask.sum(dim=-1).clamp_min(1).to(torch.float64)
    return log_w


@dataclass
class SampleWeights:
    """A stale rollout's per-prompt normalised importance weights (Sec. 9.3).

    log_normalised: [B, N] float64, ``log w̄_i = log w_i - log sum_j w_j`` per prompt row
                    (``log_softmax`` of the log weights: no overflow however large they are).
    ess_floor:      groups whose effective sample fraction is below it count as constant in
                    QUATRO's dual (``rollout.pipeline.ess_floor``; 0: none).
    """

    log_normalised: torch.Tensor
    ess_floor: float = DEFAULT_ESS_FLOOR

    @classmethod
    def from_log_weights(cls, log_weights: torch.Tensor, ess_floor: float = DEFAULT_ESS_FLOOR) -> "SampleWeights":
        """From log weights [B, N] (:func:`behaviour_log_weights` in global prompt order; -inf is a
        weight of 0, and every row needs a finite one)."""
        log_w = log_weights.detach().to(torch.float64)
        if log_w.dim() != 2 or bool((log_w.isnan() | (log_w == torch.inf)).any()) \
                or not bool(torch.isfinite(log_w).any(dim=1).all()):
            raise ValueError(f"log weights must be a [B, N] tensor, each row with a finite value and no NaN "
                             f"or +inf, got {log_w.tolist() if log_w.numel() <= 16 else tuple(log_w.shape)}")
        return cls(torch.log_softmax(log_w, dim=1), ess_floor)

    @property
    def normalised(self) -> torch.Tensor:
        """w̄ [B, N]: each row sums to 1 (1/N when mu = pi_prox)."""
        return self.log_normalised.exp()

    @property
    def ess_frac(self) -> torch.Tensor:
        """[B] effective sample fraction ``(sum w)^2 / (N sum w^2) = 1 / (N sum w̄^2)``, in [1/N, 1]
        (exactly 1 for equal weights: computed on the weights relative to each row's largest)."""
        relative = (self.log_normalised - self.log_normalised.amax(dim=1, keepdim=True)).exp()
        return relative.sum(dim=1).square() / (self.log_normalised.shape[1] * relative.square().sum(dim=1))

    @property
    def low_ess(self) -> torch.Tensor:
        """[B] bool: groups below the floor (counted as constant by QUATRO's dual)."""
        return self.ess_frac < self.ess_floor

    @property
    def loss_weights(self) -> torch.Tensor:
        """[B, N] per-sample gradient weights ``omega_i = N w̄_i`` of Sec. 9.5 (1 when uniform)."""
        return self.normalised * self.log_normalised.shape[1]


__all__ = ["BehaviourWeight", "DEFAULT_ESS_FLOOR", "OffPolicyCorrection", "SampleWeights", "behaviour_log_weights"]
