"""Typed, validated configs for every algorithm (one dataclass per algorithm).

Each config is a plain dataclass, so it can be built from an OmegaConf ``algorithm.*`` section
with :meth:`AlgorithmConfig.from_dict` (unknown keys are rejected by name). Every field is
checked in ``__post_init__`` with :mod:`quatro_nemo.validation`'s rules; a bad value raises its
``ConfigError`` (a ValueError) naming the field. Choices are :class:`~quatro_nemo.validation.Choice`
enums, which Hydra checks while composing.

Defaults follow ``shared/docs/quatro-math.md`` (Sec. 4-5), the paper (App. B: beta = 0.001,
"verl defaults" otherwise) and each baseline's paper / verl implementation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from quatro_nemo.algos.adaptive_delta import DELTA_CONTROLLERS, PER_QUERY_RULES
from quatro_nemo.algos.dual import DEFAULT_LAMBDA_MIN
from quatro_nemo.algos.kl import K3_CLAMP
from quatro_nemo.algos.lr_control import LR_CONTROLS
from quatro_nemo.validation import ConfigError, check_bool, check_in_unit_interval, check_number, choices, coerce_choices

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
QUATRO_LOG_RATIOS = ("seq_sum", "seq_mean", "none")
LossAggMode = choices("LossAggMode", LOSS_AGG_MODES, __name__)
QuatroLogRatio = choices("QuatroLogRatio", QUATRO_LOG_RATIOS, __name__)
DeltaControllerKind = choices("DeltaControllerKind", DELTA_CONTROLLERS, __name__)
DeltaPerQueryRule = choices("DeltaPerQueryRule", PER_QUERY_RULES, __name__)
LrControl = choices("LrControl", LR_CONTROLS, __name__)


def _check_number(owner: str, name: str, value: Any, **rule: bool) -> None:
    check_number(f"{owner}.{name}", value, **rule)


@dataclass
class AlgorithmConfig:
    """Fields shared by every algorithm.

    beta:          coefficient of the token-level k3 KL to the reference policy (paper App. B).
    kl_clamp:      cap on each token's k3 value (verl's 10); a token above it adds the constant
                   cap and no gradient (``kl.k3_kl``). 0 = off.
    loss_agg_mode: how token values are reduced over the global batch (see ``aggregation.py``);
                   also used for the k3 term of sequence-level losses.
    log_achieved_kl: log the per-prompt trust-region KL each update achieved
                   (``trust_region/achieved_kl``, ``_max``; ``step_state.TrustRegionLog``), at
                   the cost of one more forward pass over the step's rollouts.
    """

    beta: float = 0.001
    kl_clamp: float = K3_CLAMP
    loss_agg_mode: LossAggMode = LossAggMode("token-mean")
    """token-mean | seq-mean-token-mean | seq-mean-token-sum (``aggregation.py``)."""
    log_achieved_kl: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        owner = type(self).__name__
        coerce_choices(self, owner)
        _check_number(owner, "beta", self.beta, non_negative=True)
        _check_number(owner, "kl_clamp", self.kl_clamp, non_negative=True)
        check_bool(f"{owner}.log_achieved_kl", self.log_achieved_kl)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "algorithm"):
        """Build the config from a mapping (dict or OmegaConf section); reject unknown keys.

        ``source`` names where the mapping came from, for the error message.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        given = dict(values.items())
        unknown = sorted(k for k in given if k not in known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(known)}"
            )
        return cls(**given)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GroupBaselineConfig(AlgorithmConfig):
    """Group-relative advantage ``(R - mean) / (std + eps)`` (GRPO, DeepSeekMath Eq. in Sec. 4.1.2).

    norm_by_std: divide by the group's (unbiased) standard deviation; False gives Dr. GRPO's
                 mean-only baseline.
    eps:         added to the std.
    """

    norm_by_std: bool = True
    eps: float = 1e-6

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        check_bool(f"{owner}.norm_by_std", self.norm_by_std)
        _check_number(owner, "eps", self.eps, non_negative=True)


@dataclass
class ClippedRatioConfig(GroupBaselineConfig):
    """A ratio clipped to ``[1 - clip_low, 1 + clip_high]`` (PPO, Schulman et al. 2017, Eq. 7)."""

    clip_low: float = 0.2
    clip_high: float = 0.2

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        _check_number(owner, "clip_low", self.clip_low, positive=True)
        _check_number(owner, "clip_high", self.clip_high, positive=True)


@dataclass
class GRPOConfig(ClippedRatioConfig):
    """GRPO: group-normalised advantage, token-level PPO clip eps = 0.2 (verl default token-mean).

    clip_ratio_c: optional dual clip (Ye et al. 2020, arXiv:1912.09729, Eq. 5): for A < 0 the
                  token loss is capped at ``-A * clip_ratio_c``; must be > 1. None (default) =
                  off, as in the GRPO and DAPO papers (verl turns it on with 3).
    """

    clip_ratio_c: Optional[float] = None

    def validate(self) -> None:
        super().validate()
        if self.clip_ratio_c is not None:
            _check_number(type(self).__name__, "clip_ratio_c", self.clip_ratio_c)
            if self.clip_ratio_c <= 1:
                raise ConfigError(f"{type(self).__name__}.clip_ratio_c must be > 1 or None (off), "
                                 f"got {self.clip_ratio_c!r}")


@dataclass
class DAPOConfig(GRPOConfig):
    """DAPO (Yu et al. 2025, arXiv:2503.14476): clip-higher (0.2, 0.28), token-mean over the batch;
    ``clip_ratio_c`` as GRPO's (off, as in the DAPO paper).

    Data-side options (the engine applies them with ``dapo_filter_groups`` / ``overlong_penalty``):
    dynamic_sampling:        drop groups whose verifier rewards (correctness, BEFORE overlong
                             shaping) are all equal (DAPO Eq. 11 constraint).
    overlong_buffer_len:     soft overlong punishment window L_cache (DAPO Eq. 13), added to the
                             rewards after the filter; None = off.
    overlong_penalty_factor: the penalty reached at the maximum length.
    """

    clip_high: float = 0.28
    dynamic_sampling: bool = True
    overlong_buffer_len: Optional[int] = None
    overlong_penalty_factor: float = 1.0

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        check_bool(f"{owner}.dynamic_sampling", self.dynamic_sampling)
        _check_number(owner, "overlong_buffer_len", self.overlong_buffer_len, integer=True, positive=True,
                      optional=True)
        _check_number(owner, "overlong_penalty_factor", self.overlong_penalty_factor, non_negative=True)


@dataclass
class GSPOConfig(ClippedRatioConfig):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence ratio clipped to (1 - 3e-4, 1 + 4e-4).

    log_ratio_clamp: upper clamp on log s_i before exp (verl's GSPO uses 10); None = off.
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    loss_agg_mode: LossAggMode = LossAggMode("seq-mean-token-mean")
    log_ratio_clamp: Optional[float] = 10.0

    def validate(self) -> None:
        super().validate()
        _check_number(type(self).__name__, "log_ratio_clamp", self.log_ratio_clamp,
                      positive=True, optional=True)


@dataclass
class GMPOConfig(ClippedRatioConfig):
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): token log-ratios clipped to (-0.4, 0.4).

    Here clip_low / clip_high are bounds in LOG space: log r_t is clipped to [-clip_low, clip_high].
    """

    clip_low: float = 0.4
    clip_high: float = 0.4
    loss_agg_mode: LossAggMode = LossAggMode("seq-mean-token-mean")


@dataclass
class CISPOConfig(ClippedRatioConfig):
    """CISPO (MiniMax-M1, arXiv:2506.13585, Eq. 4-5): sg(clip(r)) * A * log pi, token-mean.

    [choice] MiniMax leave the lower bound unset: clip_low = 1.0 (weights never below 0);
    clip_high = 0.28 (DAPO's upper bound, tune per task).
    """

    clip_low: float = 1.0
    clip_high: float = 0.28


@dataclass
class GPGConfig(GroupBaselineConfig):
    """GPG (Chu et al. 2025, arXiv:2504.02546): A = alpha * (R - mean), loss -A log pi.

    norm_by_std defaults to False (GPG's F_norm = 1).
    """

    norm_by_std: bool = False


@dataclass
class QuatroConfig(AlgorithmConfig):
    """QUATRO (quatro-math.md Sec. 2-4).

    delta:           per-query trust-region radius (Eq. 11); > 0.
    lambda_min:      floor on lambda RELATIVE to the group's reward range (max - min); queries
                     whose constraint cannot bind at this floor are clamped and counted in
                     ``quatro/tr_inactive_frac`` [choice]. Bounds |A| by about 1 / lambda_min.
    log_ratio:       the detached statistic g_i in ``-(1/N) sum s_i (A_i - sg[g_i])`` (Eq. 17):
                     ``seq_sum`` (trajectory log-ratio, default), ``seq_mean`` (length-normalised),
                     or ``none`` (the paper's ablation without the log-ratio term).
    log_ratio_clamp: optional upper clamp on log s_i before exp (safety, off by default).
    clip_low / clip_high: optional GSPO-style clip of s_i; both None (default) or both set.
    solver_max_iter: cap on the dual solver's passes over the rewards, per phase (solve_dual's max_iter).

    Adaptive radius (issue 19, ``adaptive_delta.py``, docs/quatro-math.md Sec. 7); both off by
    default, which is the paper's fixed delta:
    delta_controller:            ``off`` | ``kl``: adapt the global delta between rollout steps so the
                                 achieved trust-region KL of the update stays on ``..._target``
                                 (``DeltaController``; delta is then its starting value).
    delta_controller_target:     the achieved KL to hold (> 0). 0.015: what the paper's delta = 0.1
                                 achieves at the CPU default's lr on the binary task (measured,
                                 docs/quatro-math.md Sec. 7.1).
    delta_controller_gain:       exponent of the multiplicative update, in (0, 2).
    delta_controller_max_factor: largest change of delta per step (> 1).
    delta_controller_min / _max: bounds on delta (0 < min < max).
    delta_per_query:             ``off`` | ``reward_variance``: delta_q = delta * Var_q(R) / delta_variance_ref,
                                 capped at delta_cap_fraction of the KL the solver can reach (``per_query_delta``).
    delta_variance_ref:          reward variance that gets the full delta (0.25: a 0/1 group at p = 1/2).
    delta_cap_fraction:          in (0, 1): keeps each per-query constraint binding.

    A step that honours the radius (issue 29, ``lr_control.py``, docs/quatro-math.md Sec. 7.4):
    lr_control:        ``fixed`` (default: trainer.lr) | ``kl_adaptive``: after each rollout step the
                       lr multiplier is divided by ``lr_control_factor`` when the achieved KL exceeds
                       2 delta and multiplied by it below delta / 2 (``KlAdaptiveLr``).
    lr_control_factor: > 1.
    lr_control_min / _max: bounds on the multiplier (0 < min <= 1 <= max).
    log_achieved_kl:   on by default for QUATRO (``trust_region/*`` metrics; one more forward pass).
    """

    delta: float = 0.1
    lambda_min: float = DEFAULT_LAMBDA_MIN
    log_ratio: QuatroLogRatio = QuatroLogRatio("seq_sum")
    """seq_sum | seq_mean | none (see the class docstring)."""
    log_ratio_clamp: Optional[float] = None
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    loss_agg_mode: LossAggMode = LossAggMode("seq-mean-token-mean")
    solver_max_iter: int = 100
    delta_controller: DeltaControllerKind = DeltaControllerKind("off")
    """off | kl (``adaptive_delta.DeltaController``)."""
    delta_controller_target: float = 0.015
    delta_controller_gain: float = 0.5
    delta_controller_max_factor: float = 2.0
    delta_controller_min: float = 0.001
    delta_controller_max: float = 1.0
    delta_per_query: DeltaPerQueryRule = DeltaPerQueryRule("off")
    """off | reward_variance (``adaptive_delta.per_query_delta``)."""
    delta_variance_ref: float = 0.25
    delta_cap_fraction: float = 0.9
    lr_control: LrControl = LrControl("fixed")
    """fixed | kl_adaptive (``lr_control.KlAdaptiveLr``: the lr follows the achieved KL to delta)."""
    lr_control_factor: float = 1.5
    lr_control_min: float = 0.01
    lr_control_max: float = 10.0
    log_achieved_kl: bool = True

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        _check_number(owner, "delta", self.delta, positive=True)
        self._validate_adaptive_delta(owner)
        _check_number(owner, "lambda_min", self.lambda_min, positive=True)
        _check_number(owner, "log_ratio_clamp", self.log_ratio_clamp, positive=True, optional=True)
        _check_number(owner, "clip_low", self.clip_low, positive=True, optional=True)
        _check_number(owner, "clip_high", self.clip_high, positive=True, optional=True)
        if (self.clip_low is None) != (self.clip_high is None):
            raise ConfigError(f"{owner}.clip_low and {owner}.clip_high must both be set or both be None")
        _check_number(owner, "solver_max_iter", self.solver_max_iter, integer=True, positive=True)

    def _validate_adaptive_delta(self, owner: str) -> None:
        _check_number(owner, "delta_controller_target", self.delta_controller_target, positive=True)
        _check_number(owner, "delta_controller_gain", self.delta_controller_gain, positive=True)
        if self.delta_controller_gain >= 2:
            raise ConfigError(f"{owner}.delta_controller_gain must be in (0, 2), got {self.delta_controller_gain!r}")
        _check_number(owner, "delta_controller_max_factor", self.delta_controller_max_factor, positive=True)
        if self.delta_controller_max_factor <= 1:
            raise ConfigError(f"{owner}.delta_controller_max_factor must be > 1, got {self.delta_controller_max_factor!r}")
        _check_number(owner, "delta_controller_min", self.delta_controller_min, positive=True)
        _check_number(owner, "delta_controller_max", self.delta_controller_max, positive=True)
        if self.delta_controller_min >= self.delta_controller_max:
            raise ConfigError(f"{owner}.delta_controller_min ({self.delta_controller_min!r}) must be below "
                             f"{owner}.delta_controller_max ({self.delta_controller_max!r})")
        _check_number(owner, "delta_variance_ref", self.delta_variance_ref, positive=True)
        _check_number(owner, "delta_cap_fraction", self.delta_cap_fraction)
        check_in_unit_interval(f"{owner}.delta_cap_fraction", self.delta_cap_fraction, closed_high=False)
        _check_number(owner, "lr_control_factor", self.lr_control_factor, positive=True)
        if self.lr_control_factor <= 1:
            raise ConfigError(f"{owner}.lr_control_factor must be > 1, got {self.lr_control_factor!r}")
        _check_number(owner, "lr_control_min", self.lr_control_min, positive=True)
        _check_number(owner, "lr_control_max", self.lr_control_max, positive=True)
        if not self.lr_control_min <= 1.0 <= self.lr_control_max:
            raise ConfigError(f"{owner}.lr_control_min ({self.lr_control_min!r}) and {owner}.lr_control_max "
                             f"({self.lr_control_max!r}) must bracket 1 (the configured lr)")

    @property
    def adaptive_delta(self) -> bool:
        """Whether either adaptive strategy is on (their metrics are logged only then)."""
        return self.delta_controller != "off" or self.delta_per_query != "off"
