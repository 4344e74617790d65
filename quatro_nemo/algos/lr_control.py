"""A learning rate that makes QUATRO's step honour its radius (issue 29; docs/quatro-math.md Sec. 7.4).

QUATRO's delta is the KL of the *target* pi* of each query (Eq. 11), but under Adam the step the
optimizer takes towards pi* is set by the learning rate: the achieved trust-region KL of an update
(:attr:`quatro_nemo.algos.step_state.TrustRegionLog.achieved_kl`) is 8-100x below delta at the CPU default
and grows with the lr whatever delta is. ``algorithm.lr_control.kind=kl_adaptive`` closes that loop the
way PPO implementations with a KL-adaptive learning rate do, with delta as the desired KL.

Pure Python (no Megatron): the loop measures the achieved KL and reads the multiplier.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

LR_CONTROLS = ("fixed", "kl_adaptive")


@dataclass
class KlAdaptiveLr:
    """The multiplier ``m`` of the configured learning rate (``trainer.lr``), after each rollout step:

        m_{t+1} = clip(m_t / f, m_min, m_max)   if d_t > 2 delta_t
                  clip(m_t * f, m_min, m_max)   if 0 < d_t < delta_t / 2
                  m_t                           otherwise (or nothing measured),

    ``d_t`` the step's achieved trust-region KL (mean over its informative prompts), ``delta_t``
    the radius the step used and ``f`` > 1 the factor. The rule is rsl_rl's PPO "adaptive"
    schedule (Rudin et al. 2022, "Learning to Walk in Minutes Using Massively Parallel Deep RL",
    rsl_rl/algorithms/ppo.py: lr / 1.5 when the KL exceeds 2 x desired_kl, lr x 1.5 below half
    of it; also rl_games' ``AdaptiveScheduler``), with QUATRO's radius as the desired KL and the
    bounds on the multiplier instead of on the lr. The dead band [delta/2, 2 delta] keeps m from
    chattering on the noise of d; m moves geometrically, so reaching the band from a lr off by
    a factor c takes about log(c) / log(f) steps. The lr of optimizer step s is
    ``m_t x warmup(trainer.lr, s)``.
    """

    multiplier: float = 1.0
    factor: float = 1.5
    low: float = 0.01
    high: float = 10.0
    last_kl: Optional[float] = None

    @classmethod
    def from_config(cls, config: Any) -> Optional["KlAdaptiveLr"]:
        """The controller of a QuatroConfig with ``lr_control.kind=kl_adaptive``, else None (fixed lr)."""
        section = config.lr_control
        if section.kind == "fixed":
            return None
        return cls(factor=section.factor, low=section.min, high=section.max)

    def update(self, measured_kl: Optional[float], delta: float) -> float:
        """One step of the rule above; returns the new multiplier."""
        self.last_kl = measured_kl
        if measured_kl is None or not math.isfinite(measured_kl) or measured_kl <= 0.0:
            return self.multiplier
        if measured_kl > 2.0 * delta:
            self.multiplier = max(self.multiplier / self.factor, self.low)
        elif measured_kl < 0.5 * delta:
            self.multiplier = min(self.multiplier * self.factor, self.high)
        return self.multiplier

    def state_dict(self) -> Dict[str, Any]:
        """What resumes the controller exactly (plain Python floats: pickled bit for bit)."""
        return {"multiplier": self.multiplier, "last_kl": self.last_kl}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.multiplier, self.last_kl = float(state["multiplier"]), state["last_kl"]
