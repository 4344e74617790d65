"""Adaptive trust-region radius delta for QUATRO (issue 19; docs/quatro-math.md Sec. 7).

The paper leaves delta, the per-query KL budget of Eq. 11, a fixed hyper-parameter ("designing
adaptive strategies for delta selection is an interesting direction for future work"). Two
strategies, both off by default (the paper's fixed delta):

- :class:`DeltaController` adapts one global delta between rollout steps so that the trust-region
  KL the update actually achieved stays on a target (PPO's adaptive KL coefficient, acting on the
  radius instead of a penalty coefficient);
- :func:`per_query_delta` sets delta_q from each group's reward variance, so that in the small-KL
  limit QUATRO's advantage is the mean-centred advantage without GRPO's division by the group's
  standard deviation, and caps it where the constraint would stop binding.

Pure torch / Python (no Megatron): the loop measures the policy's shift and hands it over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional

import torch

from quatro_nemo.algos.off_policy import SampleWeights

DELTA_CONTROLLERS = ("off", "kl")
PER_QUERY_RULES = ("off", "reward_variance")


# --------------------------------------------------------------------------------------------
# The empirical trust-region KL (Sec. 2) of any per-sample log-weights
# --------------------------------------------------------------------------------------------


def trust_region_kl(log_weights: torch.Tensor, log_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``KL(softmax(l_q) || uniform_N)`` per row of ``log_weights`` [B, N] (float64 [B]); with
    ``log_base`` [B, N] (a stale rollout's ``log w̄``, rows normalised: quatro-math.md Sec. 9.3,
    9.7) the weighted ``KL(softmax(l_q + log w̄_q) || w̄_q)`` (a sample of weight 0 adds 0).

    The KL of the distribution over a group's N samples that reweights pi_old's uniform one by
    exp(l_i) (self-normalised): Sec. 2's ``KL(w_lambda || uniform)`` with ``l = R / lambda``,
    which the dual solve sets to delta; with the trajectory log-ratios
    ``l_i = log pi_theta(o_i) / pi_old(o_i)`` of an updated policy it is that policy's trust-region
    KL measured on pi_old's samples (exactly delta if it reached pi*, where l_i = A_i). Bounded by
    log N; shift-invariant per row, so mass the update moved off the sampled responses is not seen.
    """
    if log_base is None:
        log_w = torch.log_softmax(log_weights.detach().to(torch.float64), dim=1)
        return (log_w.exp() * (log_w + math.log(log_weights.shape[1]))).sum(dim=1)
    log_q = torch.log_softmax(log_weights.detach().to(torch.float64) + log_base, dim=1)
    terms = log_q.exp() * (log_q - log_base)
    return torch.where(log_q == -math.inf, torch.zeros_like(terms), terms).sum(dim=1)


def achieved_kl_per_group(log_ratios: torch.Tensor, rewards: torch.Tensor,
                          sample_weights: Optional[SampleWeights] = None) -> Optional[torch.Tensor]:
    """:func:`trust_region_kl` of the updated policy on each group whose rewards are not all equal
    (those the trust region acts on), from trajectory log-ratios and rewards [B, N] (float64
    [B_informative]); None when every group is constant. With a stale rollout's ``sample_weights``
    the weighted KL of quatro-math.md Sec. 9.7, over the groups that are also above the ESS floor."""
    informative = ~(rewards == rewards[:, :1]).all(dim=1)
    if sample_weights is not None:
        informative &= ~sample_weights.low_ess
    if not bool(informative.any()):
        return None
    if sample_weights is None:
        return trust_region_kl(log_ratios[informative])
    return trust_region_kl(log_ratios[informative], sample_weights.log_normalised[informative])


# --------------------------------------------------------------------------------------------
# Strategy 1: a controller on the achieved KL
# --------------------------------------------------------------------------------------------


@dataclass
class DeltaController:
    """Multiplicative controller of the global radius (PPO, Schulman et al. 2017, Sec. 4 "adaptive
    KL penalty coefficient", moved from the penalty coefficient to the constraint radius).

    After each rollout step's K inner loops the loop measures the achieved trust-region KL ``d``
    (:attr:`quatro_nemo.algos.step_state.TrustRegionLog.achieved_kl`) and the radius of the next step is

        delta_{t+1} = clip( delta_t * clip((target / d)^gain, 1/max_factor, max_factor),
                            delta_min, delta_max ).

    Rationale: delta is the KL of the *target* pi*, but the step the optimizer takes towards it
    depends on the learning rate, the inner loops and the task; too large a step (a large lr or
    many inner loops overshooting pi*) is what breaks training, and a fixed delta does not see it.
    Holding the achieved KL on a target makes the radius shrink exactly when the update overshoots.
    Convergence: if locally ``d = c * delta^p`` (p > 0), ``e_t = log(delta_t / delta*)`` obeys
    ``e_{t+1} = (1 - gain * p) e_t`` while no clip acts, so it converges for ``0 < gain * p < 2``
    (geometrically, rate |1 - gain p|). A step with nothing measured (d None, 0 or not finite)
    leaves delta unchanged.
    """

    delta: float
    target: float
    gain: float = 0.5
    max_factor: float = 2.0
    delta_min: float = 1e-3
    delta_max: float = 1.0
    updates: int = 0
    last_kl: Optional[float] = None

    def __post_init__(self) -> None:
        self.delta = min(max(float(self.delta), self.delta_min), self.delta_max)

    @classmethod
    def from_config(cls, config: Any) -> Optional["DeltaController"]:
        """The controller of a :class:`QuatroConfig` with ``delta_controller.kind=kl``, else None
        (the paper's fixed delta). Other algorithms have no radius: the caller passes only QUATRO's."""
        section = config.delta_controller
        if section.kind == "off":
            return None
        return cls(delta=config.delta, target=section.target, gain=section.gain, max_factor=section.max_factor,
                   delta_min=section.min, delta_max=section.max)

    def update(self, measured_kl: Optional[float]) -> float:
        """One step of the rule above; returns the new delta."""
        self.last_kl = measured_kl
        if measured_kl is None or not math.isfinite(measured_kl) or measured_kl <= 0.0:
            return self.delta
        factor = min(max((self.target / measured_kl) ** self.gain, 1.0 / self.max_factor), self.max_factor)
        self.delta = min(max(self.delta * factor, self.delta_min), self.delta_max)
        self.updates += 1
        return self.delta

    def apply(self, config: Any) -> Any:
        """A copy of the algorithm config with this step's radius."""
        return replace(config, delta=self.delta)

    def metrics(self) -> Dict[str, float]:
        out = {"quatro/delta_controller": self.delta}
        if self.last_kl is not None:
            out["quatro/achieved_kl"] = self.last_kl
        return out

    def state_dict(self) -> Dict[str, Any]:
        """What resumes the controller exactly (plain Python floats: pickled bit for bit)."""
        return {"delta": self.delta, "updates": self.updates, "last_kl": self.last_kl}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.delta, self.updates, self.last_kl = float(state["delta"]), int(state["updates"]), state["last_kl"]


# --------------------------------------------------------------------------------------------
# Strategy 2: a per-query radius from the group's reward variance
# --------------------------------------------------------------------------------------------


def floor_kl(rewards: torch.Tensor, lambda_min: float, log_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The largest trust-region KL the solver can honour per group (float64 [B]):
    ``KL(softmax(z / lambda_min) || uniform)`` with ``z = (R - max R) / (max R - min R)``, the KL at
    ``solve_dual``'s floor lambda = lambda_min * range. It is below Sec. 2's
    ``KL_max = log(N / n_max)`` (the lambda -> 0 limit) and equal to it up to ~N e^(-1/lambda_min)
    for binary rewards. 0 for constant groups. ``log_base``: the weighted KL (Sec. 9.3)."""
    r = rewards.detach().to(torch.float64)
    r_max = r.amax(dim=1, keepdim=True)
    r_range = (r_max - r.amin(dim=1, keepdim=True))
    z = (r - r_max) / torch.where(r_range > 0, r_range, torch.ones_like(r_range))
    return trust_region_kl(z / lambda_min, log_base)


def per_query_delta(rewards: torch.Tensor, delta: float, variance_ref: float, cap_fraction: float,
                    lambda_min: float, sample_weights: Optional[SampleWeights] = None) -> torch.Tensor:
    """Per-query radius [B] (float64) from each group's reward variance (docs/quatro-math.md Sec. 7.2):

        delta_q = min( delta * Var_q(R) / variance_ref,  cap_fraction * KL_floor_q ),

    ``Var_q`` the population variance of the group's N rewards, ``KL_floor_q`` :func:`floor_kl`.

    Why the variance (Sec. 3): for small delta the dual's advantage expands to
    ``A_i = sqrt(2 delta) (R_i - mean R) / std R + O(delta)``, i.e. a fixed delta is GRPO's
    std-normalised advantage, which up-weights groups with nearly equal rewards (an easy query
    with 7 of 8 correct, a graded group whose rewards differ by 0.01; Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783, Sec. 3.1). With ``delta_q ∝ Var_q`` the expansion becomes
    ``A_i = sqrt(2 delta / variance_ref) (R_i - mean R)``: the mean-centred advantage, whose size
    follows the reward spread, while the exact dual still holds each query's KL at its delta_q.
    For binary rewards ``Var = p (1 - p)`` (p the success rate): rare successes and near-solved
    queries both get a smaller radius (4 p (1 - p) delta with ``variance_ref = 1/4``); a single
    success on a hard query is not sharpened onto as hard as a fixed delta would.

    The cap keeps the constraint binding: Sec. 2, delta >= log(N / n_max) has no finite lambda*,
    and the solver clamps lambda at its floor (``inactive``). ``cap_fraction < 1`` of the KL the
    floor reaches leaves every non-constant group active. For 0/1 rewards the variance term alone
    stays below log(N / c) whenever ``delta <= variance_ref`` (``delta p (1 - p) / variance_ref <
    1 - p <= -log p``), so the cap then only matters for continuous rewards with a crowded
    maximum. Constant groups (no information, A = 0) get delta.

    With a stale rollout's ``sample_weights`` (quatro-math.md Sec. 9.3) the variance and the floor
    KL are under the weighted measure w̄: ``Var = sum_i w̄_i (R_i - sum_j w̄_j R_j)^2``.
    """
    r = rewards.detach().to(torch.float64)
    if sample_weights is None:
        variance, log_base = r.var(dim=1, unbiased=False), None
    else:
        log_base = sample_weights.log_normalised
        probs = log_base.exp()
        centred = r - (probs * r).sum(dim=1, keepdim=True)
        variance = (probs * centred.square()).sum(dim=1)
    rule = delta * variance / variance_ref
    delta_q = torch.minimum(rule, cap_fraction * floor_kl(rewards, lambda_min, log_base))
    constant = (rewards == rewards[:, :1]).all(dim=1)
    return torch.where(constant, torch.full_like(delta_q, delta), delta_q.clamp_min(torch.finfo(torch.float64).tiny))
