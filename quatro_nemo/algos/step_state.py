"""State an algorithm carries from one rollout step to the next, behind one hook (issue 30).

The training loop calls, for every rollout step and every algorithm alike::

    step_cfg = state.config_for_step(cfg)        # this step's run config (e.g. QUATRO's radius, lr)
    ... rollout, advantages, K inner loops with step_cfg ...
    state.observe(StepMeasurements(rewards, log_ratios))   # log_ratios only if needs_policy_shift
    metrics.update(state.metrics())
    checkpoint["algorithm_state"] = state.state_dict()     # resume: state.load_state_dict(...)

so an algorithm with state (QUATRO's adaptive radius and KL-adaptive learning rate) is added here
and in the registry, never in the loop. Pure torch / Python (no Megatron, no engine import): the
run config is reached only through its ``algorithm`` and ``trainer`` sections (dataclasses).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Protocol

import torch

from quatro_nemo.algos.adaptive_delta import DeltaController, achieved_kl_per_group
from quatro_nemo.algos.lr_control import KlAdaptiveLr
from quatro_nemo.algos.off_policy import SampleWeights

# The per-step trust-region metrics logged here (and read by the study's report, study/analysis.py)
ACHIEVED_KL = "trust_region/achieved_kl"                   # mean over the informative prompts
ACHIEVED_KL_MAX = "trust_region/achieved_kl_max"           # the largest prompt's
ACHIEVED_OVER_DELTA = "trust_region/achieved_over_delta"   # achieved KL / the step's delta
LR_MULTIPLIER = "trust_region/lr_multiplier"               # lr_control.kind=kl_adaptive's multiplier


@dataclass
class StepMeasurements:
    """What the loop measured in one rollout step, global over data-parallel ranks (identical on
    every rank): the verifier's ``rewards`` [B, N] and, when the state asked for it
    (``needs_policy_shift``), the updated policy's trajectory log-ratios
    ``log pi_theta(o_i) / pi_old(o_i)`` [B, N] on the step's responses (one more forward pass);
    for a stale rollout corrected with ``proximal`` its ``sample_weights`` (the achieved KL is then
    the weighted one, docs/quatro-math.md Sec. 9.7)."""

    rewards: torch.Tensor
    log_ratios: Optional[torch.Tensor] = None
    sample_weights: Optional[SampleWeights] = None


class AlgorithmState(Protocol):
    """The hook (see the module docstring); ``AlgorithmSpec.make_state(config)`` builds one per run."""

    needs_policy_shift: bool

    def config_for_step(self, cfg: Any) -> Any:
        """The run config of the next rollout step (``cfg`` itself when nothing changes)."""

    def observe(self, measured: StepMeasurements) -> None:
        """Update the state from the step just taken."""

    def metrics(self) -> Dict[str, float]:
        """Metrics of the step last observed."""

    def state_dict(self) -> Dict[str, Any]:
        """What resumes the state exactly (plain Python values)."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ...


class TrustRegionLog:
    """Every algorithm's state: none, but with ``algorithm.log_achieved_kl`` the per-prompt
    trust-region KL the update achieved (:func:`~quatro_nemo.algos.adaptive_delta.trust_region_kl`
    of the trajectory log-ratios, over the prompts whose rewards are not all equal):
    ``trust_region/achieved_kl`` (mean over those prompts) and ``trust_region/achieved_kl_max``;
    absent on a step whose groups were all constant."""

    def __init__(self, config: Any):
        self.needs_policy_shift = bool(config.log_achieved_kl)
        self.achieved: Optional[torch.Tensor] = None

    def config_for_step(self, cfg: Any) -> Any:
        return cfg

    def observe(self, measured: StepMeasurements) -> None:
        self.achieved = (None if measured.log_ratios is None else
                         achieved_kl_per_group(measured.log_ratios, measured.rewards, measured.sample_weights))

    @property
    def achieved_kl(self) -> Optional[float]:
        """Mean achieved KL over the informative prompts of the step last observed (None: none)."""
        return None if self.achieved is None else float(self.achieved.mean())

    def metrics(self) -> Dict[str, float]:
        if self.achieved is None:
            return {}
        return {ACHIEVED_KL: self.achieved_kl, ACHIEVED_KL_MAX: float(self.achieved.max())}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class QuatroState(TrustRegionLog):
    """QUATRO's state: the adaptive radius (``delta_controller.kind=kl``, :class:`DeltaController`)
    and the KL-adaptive learning rate (``lr_control.kind=kl_adaptive``, :class:`KlAdaptiveLr`), both
    driven by the same measured achieved KL (they compose: the radius tracks
    ``delta_controller.target`` while the lr makes the step track the radius). Adds
    ``trust_region/achieved_over_delta`` (achieved KL / the step's global delta; with
    ``delta_per_query`` each prompt's own radius is delta_q <= delta)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.delta_controller = DeltaController.from_config(config)
        self.lr_control = KlAdaptiveLr.from_config(config)
        self.needs_policy_shift = (self.needs_policy_shift or self.delta_controller is not None
                                   or self.lr_control is not None)
        self.delta = config.delta                  # the radius of the step in progress
        self.lr_multiplier = 1.0                   # the lr multiplier of the step in progress

    def config_for_step(self, cfg: Any) -> Any:
        changes: Dict[str, Any] = {}
        if self.delta_controller is not None:
            changes["algorithm"] = self.delta_controller.apply(cfg.algorithm)
        if self.lr_control is not None:
            changes["trainer"] = dataclasses.replace(cfg.trainer, lr=cfg.trainer.lr * self.lr_control.multiplier)
            self.lr_multiplier = self.lr_control.multiplier
        step_cfg = dataclasses.replace(cfg, **changes) if changes else cfg
        self.delta = step_cfg.algorithm.delta
        return step_cfg

    def observe(self, measured: StepMeasurements) -> None:
        super().observe(measured)
        if self.delta_controller is not None:   # the next step's radius, from this step's achieved KL
            self.delta_controller.update(self.achieved_kl)
        if self.lr_control is not None:         # the next step's lr, from the same KL and this radius
            self.lr_control.update(self.achieved_kl, self.delta)

    def metrics(self) -> Dict[str, float]:
        out = super().metrics()
        if self.achieved is not None:
            out[ACHIEVED_OVER_DELTA] = self.achieved_kl / self.delta
        if self.lr_control is not None:
            out[LR_MULTIPLIER] = self.lr_multiplier
        if self.delta_controller is not None:
            out["quatro/delta_used"] = self.delta
            out.update(self.delta_controller.metrics())
        return out

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {}
        if self.delta_controller is not None:
            state["delta_controller"] = self.delta_controller.state_dict()
        if self.lr_control is not None:
            state["lr_control"] = self.lr_control.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; a controller the checkpoint lacks (turned on at
        resume) keeps its start."""
        if self.delta_controller is not None and "delta_controller" in state:
            self.delta_controller.load_state_dict(state["delta_controller"])
        if self.lr_control is not None and "lr_control" in state:
            self.lr_control.load_state_dict(state["lr_control"])
