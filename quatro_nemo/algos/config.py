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
import functools
import typing
from dataclasses import dataclass, field
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


def _section_values(cls: type, values: Any, key: str) -> Dict[str, Any]:
    """The keyword arguments of dataclass ``cls`` from the mapping ``values`` found at ``key``:
    a nested section's mapping becomes its dataclass; ConfigError naming ``key`` for anything else."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{key} must be a mapping of {cls.__name__} fields, got {values!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    given = dict(values.items())
    # An old flat key is "renamed" only where its new section exists (QUATRO's); elsewhere it is unknown.
    renamed = [k for k in given if k in RENAMED_KEYS and RENAMED_KEYS[k].split(".")[0] in known
               and (k not in known or not isinstance(given[k], Mapping))]
    if renamed:
        raise renamed_key_error(renamed[0], key)
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(known)}")
    sections = _section_types(cls)
    return {k: sections[k](**_section_values(sections[k], v, f"{key}.{k}")) if k in sections else v
            for k, v in given.items()}


@functools.lru_cache(maxsize=None)
def _section_types(cls: type) -> Dict[str, type]:
    """Field name -> dataclass type of ``cls``'s nested sections."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


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
        """Build the config from a mapping (dict or OmegaConf section), its nested sections from
        nested mappings; reject unknown keys (a renamed one with its new name, :data:`RENAMED_KEYS`).

        ``source`` names where the mapping came from, for the error message.
        """
        return cls(**_section_values(cls, values, source))

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
class DeltaControllerConfig:
    """``algorithm.delta_controller``: adapt QUATRO's global delta between rollout steps so that the
    achieved trust-region KL of the update stays on ``target`` (``adaptive_delta.DeltaController``,
    docs/quatro-math.md Sec. 7.1; delta is then its starting value)."""

    kind: DeltaControllerKind = DeltaControllerKind("off")
    """off (the paper's fixed delta) | kl (the controller on the achieved KL)."""
    target: float = 0.015
    """The achieved KL to hold (> 0). 0.015: what the paper's delta = 0.1 achieves at the CPU
    default's lr on the binary task (measured, docs/quatro-math.md Sec. 7.1)."""
    gain: float = 0.5
    """Exponent of the multiplicative update, in (0, 2)."""
    max_factor: float = 2.0
    """Largest change of delta per step (> 1)."""
    min: float = 0.001
    """Lower bound on delta (0 < min < max)."""
    max: float = 1.0
    """Upper bound on delta."""

    def validate(self, key: str) -> None:
        coerce_choices(self, key)
        check_number(f"{key}.target", self.target, positive=True)
        check_number(f"{key}.gain", self.gain, positive=True)
        if self.gain >= 2:
            raise ConfigError(f"{key}.gain must be in (0, 2), got {self.gain!r}")
        check_number(f"{key}.max_factor", self.max_factor, positive=True)
        if self.max_factor <= 1:
            raise ConfigError(f"{key}.max_factor must be > 1, got {self.max_factor!r}")
        check_number(f"{key}.min", self.min, positive=True)
        check_number(f"{key}.max", self.max, positive=True)
        if self.min >= self.max:
            raise ConfigError(f"{key}.min ({self.min!r}) must be below {key}.max ({self.max!r})")


@dataclass
class DeltaPerQueryConfig:
    """``algorithm.delta_per_query``: each query's own radius from its group's rewards
    (``adaptive_delta.per_query_delta``, docs/quatro-math.md Sec. 7.2)."""

    kind: DeltaPerQueryRule = DeltaPerQueryRule("off")
    """off (every query gets delta) | reward_variance: delta_q = delta * Var_q(R) / variance_ref,
    capped at cap_fraction of the KL the solver can reach."""
    variance_ref: float = 0.25
    """The reward variance that gets the full delta (> 0; 0.25: a 0/1 group at p = 1/2)."""
    cap_fraction: float = 0.9
    """In (0, 1): keeps each per-query constraint binding."""

    def validate(self, key: str) -> None:
        coerce_choices(self, key)
        check_number(f"{key}.variance_ref", self.variance_ref, positive=True)
        check_number(f"{key}.cap_fraction", self.cap_fraction)
        check_in_unit_interval(f"{key}.cap_fraction", self.cap_fraction, closed_high=False)


@dataclass
class LrControlConfig:
    """``algorithm.lr_control``: a step that honours the radius (``lr_control.KlAdaptiveLr``,
    docs/quatro-math.md Sec. 7.4)."""

    kind: LrControl = LrControl("fixed")
    """fixed (trainer.lr) | kl_adaptive: after each rollout step the lr multiplier is divided by
    ``factor`` when the achieved KL exceeds 2 delta and multiplied by it below delta / 2."""
    factor: float = 1.5
    """The multiplier's step (> 1)."""
    min: float = 0.01
    """Lower bound on the multiplier (0 < min <= 1)."""
    max: float = 10.0
    """Upper bound on the multiplier (>= 1)."""

    def validate(self, key: str) -> None:
        coerce_choices(self, key)
        check_number(f"{key}.factor", self.factor, positive=True)
        if self.factor <= 1:
            raise ConfigError(f"{key}.factor must be > 1, got {self.factor!r}")
        check_number(f"{key}.min", self.min, positive=True)
        check_number(f"{key}.max", self.max, positive=True)
        if not self.min <= 1.0 <= self.max:
            raise ConfigError(f"{key}.min ({self.min!r}) and {key}.max ({self.max!r}) must bracket 1 "
                              "(the configured lr)")


# The flat keys QUATRO's sections replaced (old key -> its key under algorithm.): an old run's saved
# config is migrated (:func:`migrate_renamed_keys`), anything else given an old key is refused naming the new one.
RENAMED_KEYS = {
    "delta_controller": "delta_controller.kind",
    **{f"delta_controller_{name}": f"delta_controller.{name}" for name in ("target", "gain", "max_factor", "min", "max")},
    "delta_per_query": "delta_per_query.kind",
    "delta_variance_ref": "delta_per_query.variance_ref",
    "delta_cap_fraction": "delta_per_query.cap_fraction",
    "lr_control": "lr_control.kind",
    **{f"lr_control_{name}": f"lr_control.{name}" for name in ("factor", "min", "max")},
}


def renamed_key_error(old: str, where: str = "algorithm") -> ConfigError:
    """The error for the flat key ``old`` of :data:`RENAMED_KEYS` given at ``where``, naming its new key."""
    return ConfigError(f"{where}.{old} is now {where}.{RENAMED_KEYS[old]}")


def migrate_renamed_keys(values: Mapping[str, Any]) -> Dict[str, Any]:
    """An algorithm section (a plain mapping) with every flat key of :data:`RENAMED_KEYS` moved to
    its nested section (a run saved before the sections existed); a nested section is kept as it is."""
    out = dict(values)
    for old, new in RENAMED_KEYS.items():
        if old in out and not isinstance(out[old], Mapping):
            section, name = new.split(".")
            value = out.pop(old)
            out[section] = {**(out.get(section) if isinstance(out.get(section), Mapping) else {}), name: value}
    return out


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
    log_achieved_kl: on by default for QUATRO (``trust_region/*`` metrics; one more forward pass).

    Adaptive radius (issue 19, ``adaptive_delta.py``, docs/quatro-math.md Sec. 7), both off by
    default (the paper's fixed delta): the sections ``delta_controller`` (:class:`DeltaControllerConfig`)
    and ``delta_per_query`` (:class:`DeltaPerQueryConfig`). A step that honours the radius (issue 29,
    ``lr_control.py``, Sec. 7.4): ``lr_control`` (:class:`LrControlConfig`, default fixed).
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
    delta_controller: DeltaControllerConfig = field(default_factory=DeltaControllerConfig)
    """The adaptive global radius (kind off | kl)."""
    delta_per_query: DeltaPerQueryConfig = field(default_factory=DeltaPerQueryConfig)
    """Each query's own radius (kind off | reward_variance)."""
    lr_control: LrControlConfig = field(default_factory=LrControlConfig)
    """The learning rate that follows the achieved KL to delta (kind fixed | kl_adaptive)."""
    log_achieved_kl: bool = True

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        _check_number(owner, "delta", self.delta, positive=True)
        for name, section_type in _section_types(type(self)).items():
            section = getattr(self, name)
            if not isinstance(section, section_type):
                raise ConfigError(f"{owner}.{name} must be a {section_type.__name__}, got {section!r}")
            section.validate(f"{owner}.{name}")
        _check_number(owner, "lambda_min", self.lambda_min, positive=True)
        _check_number(owner, "log_ratio_clamp", self.log_ratio_clamp, positive=True, optional=True)
        _check_number(owner, "clip_low", self.clip_low, positive=True, optional=True)
        _check_number(owner, "clip_high", self.clip_high, positive=True, optional=True)
        if (self.clip_low is None) != (self.clip_high is None):
            raise ConfigError(f"{owner}.clip_low and {owner}.clip_high must both be set or both be None")
        _check_number(owner, "solver_max_iter", self.solver_max_iter, integer=True, positive=True)

    @property
    def adaptive_delta(self) -> bool:
        """Whether either adaptive strategy is on (their metrics are logged only then)."""
        return self.delta_controller.kind != "off" or self.delta_per_query.kind != "off"
