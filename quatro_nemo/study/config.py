"""The study's typed configuration (conf/study/<name>.yaml), validated with errors naming the key.

A study is a list of training runs (recipes/train.py override sets) in four groups:

- ``compare``:  every algorithm at the default settings over ``seeds`` (claims 1-3 of issue 9);
- ``sweeps``:   the stability sweeps, one axis at a time from the default: inner loops K at the
                default learning rate, and learning-rate multipliers at K = 1 (paper Fig. 4a/b);
- ``ablation``: QUATRO with and without the detached log-ratio term at (delta, K) (Fig. 4c);
- ``deltas``:   QUATRO at several trust-region radii: lambda over training (App. C.1) and the
                accuracy / diversity trade-off (pass@1 against pass@n per delta).

``evaluation`` is the held-out evaluation of every run's final policy and of the base model
(``quatro_nemo.engine.heldout``, an EvalRequest); ``alpha`` the significance level of the Holm-corrected
paired tests (:mod:`quatro_nemo.study.stats`).

A study of ``kind: adaptive`` (issue 19) trains only its ``adaptive`` section instead: QUATRO's
adaptive-delta strategies against a fixed-delta sweep on the binary and graded tasks, at the
default and at stress settings (:mod:`quatro_nemo.study.adaptive`).

recipes/study.py (a Hydra app) chooses a study as ``study=<name>`` and overrides its keys as
``study.KEY=VALUE``; :class:`StudyConfig` types that node, :func:`study_config_from_dict`
validates it (the one place that does).

``train_overrides`` apply to every run (on top of conf/config.yaml, or of ``train_config``);
they are where a study shrinks the CPU default (e.g. fewer steps in quick mode).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping

from omegaconf import OmegaConf

from quatro_nemo.algos import ALGORITHMS
from quatro_nemo.algos.config import QUATRO_LOG_RATIOS, RENAMED_KEYS, QuatroConfig, renamed_key_error
from quatro_nemo.tasks.countdown.verifier import REWARD_KINDS
from quatro_nemo.validation import ConfigError, check_choice, choices

STUDY_CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "conf", "study")
QUATRO = "quatro"


StudyConfigError = ConfigError  # a problem in a study config (the one config error); the message names the key


def _check_algorithms(key: str, names: List[str]) -> None:
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise StudyConfigError(f"{key}: unknown algorithm(s) {unknown}; choose from {sorted(ALGORITHMS)}")
    if len(set(names)) != len(names):
        raise StudyConfigError(f"{key}: repeated algorithm in {names}")


def _check_seeds(key: str, seeds: List[int]) -> None:
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise StudyConfigError(f"{key} must be a non-empty list of distinct integers, got {seeds}")


def _check_positive(key: str, values: List[Any], integer: bool) -> None:
    kind = int if integer else (int, float)
    if not values or any(isinstance(v, bool) or not isinstance(v, kind) or not math.isfinite(v) or v <= 0
                         for v in values):
        raise StudyConfigError(f"{key} must be a non-empty list of positive {'integers' if integer else 'numbers'}, "
                               f"got {values}")


@dataclass
class SweepConfig:
    algorithms: List[str] = field(default_factory=lambda: sorted(ALGORITHMS))
    inner_loops: List[int] = field(default_factory=lambda: [1, 2, 4, 8])     # K, at lr x 1
    lr_multipliers: List[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 4.0, 6.0, 8.0])  # x default lr, K = 1
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    # a method's breaking point on an axis: the last point whose mean final held-out reward keeps
    # at least this fraction of its reward at the default (lr x1, K = 1), every point before it too
    tolerance: float = 0.9
    # Search the sweeps instead of running their whole grids: a method's next K or lr multiplier
    # runs only once its previous one has held (plan.searched_points), so each method's sweep ends
    # at its breaking point. Every method follows the same rule; it saves the runs past each break.
    search: bool = False

    def validate(self) -> None:
        _check_algorithms("sweeps.algorithms", self.algorithms)
        if not isinstance(self.search, bool):
            raise StudyConfigError(f"sweeps.search must be true or false, got {self.search!r}")
        _check_positive("sweeps.inner_loops", self.inner_loops, integer=True)
        _check_positive("sweeps.lr_multipliers", self.lr_multipliers, integer=False)
        _check_seeds("sweeps.seeds", self.seeds)
        if not 0.0 < self.tolerance <= 1.0:
            raise StudyConfigError(f"sweeps.tolerance must be in (0, 1], got {self.tolerance}")
        for key, values, base in (("sweeps.inner_loops", self.inner_loops, 1),
                                  ("sweeps.lr_multipliers", self.lr_multipliers, 1.0)):
            if base not in values:
                raise StudyConfigError(f"{key} must contain {base} (the default the sweep starts from), got {values}")


@dataclass
class AblationConfig:
    delta: float = 0.1
    inner_loops: int = 2
    log_ratios: List[str] = field(default_factory=lambda: ["seq_sum", "none"])
    seeds: List[int] = field(default_factory=lambda: [1])

    def validate(self) -> None:
        _check_positive("ablation.delta", [self.delta], integer=False)
        _check_positive("ablation.inner_loops", [self.inner_loops], integer=True)
        bad = [v for v in self.log_ratios if v not in QUATRO_LOG_RATIOS]
        if bad or "none" not in self.log_ratios or len(set(self.log_ratios)) < 2:
            raise StudyConfigError(f"ablation.log_ratios must contain 'none' and at least one log-ratio "
                                   f"statistic (seq_sum, seq_mean), got {self.log_ratios}")
        _check_seeds("ablation.seeds", self.seeds)


@dataclass
class DeltaConfig:
    values: List[float] = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.2, 0.4])
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])

    def validate(self) -> None:
        _check_positive("deltas.values", self.values, integer=False)
        if len(self.values) < 2:
            raise StudyConfigError(f"deltas.values needs at least two radii to compare, got {self.values}")
        _check_seeds("deltas.seeds", self.seeds)


@dataclass
class EvaluationConfig:
    """The held-out evaluation of each run's final policy and of the base model (once)."""

    num_problems: int = 64
    n_samples: int = 128             # samples per problem: Pass@k and UCC@k for k = 1, 2, 4, ..., n_samples
    top_p: List[float] = field(default_factory=lambda: [0.7, 1.0])   # claims are decided at the first
    temperature: float = 1.0
    seed: int = 0                    # the sampling noise of every evaluation (shared: paired across runs)
    # The sweeps and the log-ratio ablation are decided on held-out reward alone, which needs no
    # large n: their runs (not shared with the main comparison) are evaluated with this many
    # samples per problem at the first top-p only. 0: as the main comparison.
    sweep_n_samples: int = 32

    def validate(self) -> None:
        _check_positive("evaluation.num_problems", [self.num_problems], integer=True)
        _check_positive("evaluation.n_samples", [self.n_samples], integer=True)
        if not self.top_p or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0
                                 for p in self.top_p) or len(set(self.top_p)) != len(self.top_p):
            raise StudyConfigError(f"evaluation.top_p must be a non-empty list of distinct values in (0, 1], "
                                   f"got {self.top_p}")
        _check_positive("evaluation.temperature", [self.temperature], integer=False)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise StudyConfigError(f"evaluation.seed must be an integer, got {self.seed!r}")
        if isinstance(self.sweep_n_samples, bool) or not isinstance(self.sweep_n_samples, int) \
                or not 0 <= self.sweep_n_samples <= self.n_samples:
            raise StudyConfigError(f"evaluation.sweep_n_samples must be an integer in [0, n_samples], "
                                   f"got {self.sweep_n_samples!r}")


STRESS_KEYS = ("inner_loops", "lr_multiplier")


def _check_stress_points(key: str, points: Any) -> None:
    """name -> {inner_loops, lr_multiplier}: the fixed stress settings (adaptive.stress too)."""
    if not isinstance(points, dict):
        raise StudyConfigError(f"{key} must map names to settings, got {points!r}")
    for name, values in points.items():
        item = f"{key}.{name}"
        if name == DEFAULT_CONDITION or not isinstance(values, dict) or not values or set(values) - set(STRESS_KEYS):
            raise StudyConfigError(f"{item} must be a non-empty mapping of inner_loops / lr_multiplier "
                                   f"(and not named {DEFAULT_CONDITION!r}), got {values!r}")
        if "inner_loops" in values:
            _check_positive(f"{item}.inner_loops", [values["inner_loops"]], integer=True)
        if "lr_multiplier" in values:
            _check_positive(f"{item}.lr_multiplier", [values["lr_multiplier"]], integer=False)


@dataclass
class StressConfig:
    """Fixed stress points (issue 29): every method of ``algorithms`` (and every arm) runs at every
    point over ``seeds``; each point is its own claim, QUATRO against each baseline on the final
    held-out reward *at that point* (no search, no loss averaged over searched points). ``arms``
    are extra QUATRO variants (name -> QuatroConfig fields, e.g. ``{lr_control: {kind: kl_adaptive}}``)
    tested at each point against the baselines and against QUATRO itself; a field the algorithm
    config does not have fails when the plan is built, naming the arm."""

    points: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    algorithms: List[str] = field(default_factory=list)
    seeds: List[int] = field(default_factory=list)
    arms: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.points:
            if self.algorithms or self.arms:
                raise StudyConfigError("stress.algorithms / stress.arms need stress.points")
            return
        _check_stress_points("stress.points", self.points)
        _check_algorithms("stress.algorithms", self.algorithms)
        if QUATRO not in self.algorithms or len(self.algorithms) < 2:
            raise StudyConfigError(f"stress.algorithms must contain quatro and at least one baseline, got {self.algorithms}")
        _check_seeds("stress.seeds", self.seeds)
        if not isinstance(self.arms, dict):
            raise StudyConfigError(f"stress.arms must map names to QUATRO fields, got {self.arms!r}")
        for name, fields in self.arms.items():
            if name in ALGORITHMS or not isinstance(fields, dict) or not fields:
                raise StudyConfigError(f"stress.arms.{name} must be a non-empty mapping of QUATRO config fields "
                                       f"(and not an algorithm's name), got {fields!r}")


@dataclass
class CheckpointEvalConfig:
    """Held-out evaluations during training (issue 29), for comparisons at matched rollout reward
    and matched KL-to-reference: the loop's own evaluation every ``every`` rollout steps (and at
    step 0) on the study's ``evaluation.num_problems`` problems x ``n_samples`` at the claims'
    top-p. 0: off."""

    every: int = 0
    n_samples: int = 32

    def validate(self) -> None:
        for key in ("every", "n_samples"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "every" else 1):
                raise StudyConfigError(f"checkpoints.{key} must be an integer >= {0 if key == 'every' else 1}, "
                                       f"got {value!r}")


# paper: the claims of the QUATRO paper; adaptive: the adaptive radius (issue 19)
StudyKind = choices("StudyKind", ("paper", "adaptive"), __name__)


@dataclass
class StudyConfig:
    name: str = "study"
    kind: StudyKind = StudyKind.paper
    description: str = ""                        # what this study's scale is; shown in the report
    train_config: str = "config"                 # primary training config (conf/<train_config>.yaml)
    train_overrides: List[str] = field(default_factory=list)   # key=value for every run
    algorithms: List[str] = field(default_factory=lambda: sorted(ALGORITHMS))
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    sweeps: SweepConfig = field(default_factory=SweepConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    deltas: DeltaConfig = field(default_factory=DeltaConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    workers: int = 2                             # training processes at a time
    alpha: float = 0.05                          # significance level of the Holm-corrected paired tests
    # the best method has plateaued when its rollout reward changes by at most this much over the
    # last quarter of training (least-squares line through the mean over seeds)
    plateau_tolerance: float = 0.02
    time_budget_minutes: float = 150.0           # the target wall time, checked and reported
    adaptive: Any = None                         # kind adaptive: AdaptiveStudyConfig
    # Pre-registration (issue 29), all stated before any run:
    claim_top_p: Any = None                      # the top-p the held-out claims are decided at (None: evaluation.top_p[0])
    primary_baselines: List[str] = field(default_factory=list)   # the primary family (rest: secondary); [] = one family
    equivalence_margins: Dict[str, float] = field(default_factory=dict)   # claim id -> TOST margin (metric units)
    power_effect_sd: float = 2.0                 # the effect the design is sized for (sd of a paired difference)
    power_target: float = 0.8                    # ... and the power it needs (stats.paired_power; reported)
    stress: StressConfig = field(default_factory=StressConfig)
    checkpoints: CheckpointEvalConfig = field(default_factory=CheckpointEvalConfig)

    def validate(self) -> None:
        _check_algorithms("algorithms", self.algorithms)
        if QUATRO not in self.algorithms or len(self.algorithms) < 2:
            raise StudyConfigError(f"algorithms must contain quatro and at least one baseline, got {self.algorithms}")
        if QUATRO not in self.sweeps.algorithms:
            raise StudyConfigError(f"sweeps.algorithms must contain quatro, got {self.sweeps.algorithms}")
        _check_seeds("seeds", self.seeds)
        for key in ("workers",):
            _check_positive(key, [getattr(self, key)], integer=True)
        if not 0.0 < self.alpha < 1.0:
            raise StudyConfigError(f"alpha must be in (0, 1), got {self.alpha}")
        _check_positive("plateau_tolerance", [self.plateau_tolerance], integer=False)
        _check_positive("time_budget_minutes", [self.time_budget_minutes], integer=False)
        for i, item in enumerate(self.train_overrides):
            if not isinstance(item, str) or "=" not in item:
                raise StudyConfigError(f"train_overrides[{i}] must be a key=value string, got {item!r}")
            if item.split("=", 1)[0] in ("run.dir", "run.seed", "algorithm", "config"):
                raise StudyConfigError(f"train_overrides[{i}]={item!r}: the study sets this key per run")
        self.sweeps.validate()
        self.ablation.validate()
        self.deltas.validate()
        self.evaluation.validate()
        self.kind = check_choice("kind", self.kind, StudyKind)
        if (self.kind == "adaptive") != (self.adaptive is not None):
            raise StudyConfigError("an adaptive section needs kind: adaptive, and kind: adaptive an adaptive section")
        if self.adaptive is not None:
            self.adaptive.validate()
        self.stress.validate()
        self.checkpoints.validate()
        self._validate_preregistration()

    def _validate_preregistration(self) -> None:
        if self.claim_top_p is not None and (isinstance(self.claim_top_p, bool)
                                             or self.claim_top_p not in self.evaluation.top_p):
            raise StudyConfigError(f"claim_top_p must be one of evaluation.top_p {self.evaluation.top_p}, "
                                   f"got {self.claim_top_p!r}")
        stray = [b for b in self.primary_baselines if b == QUATRO or b not in self.algorithms]
        if stray or len(set(self.primary_baselines)) != len(self.primary_baselines):
            raise StudyConfigError(f"primary_baselines must be distinct baselines of algorithms {self.algorithms}, "
                                   f"got {self.primary_baselines}")
        if not isinstance(self.equivalence_margins, dict):
            raise StudyConfigError(f"equivalence_margins must map claim ids to margins, got {self.equivalence_margins!r}")
        for claim_id, margin in self.equivalence_margins.items():
            _check_positive(f"equivalence_margins.{claim_id}", [margin], integer=False)
        _check_positive("power_effect_sd", [self.power_effect_sd], integer=False)
        if not 0.0 < self.power_target < 1.0:
            raise StudyConfigError(f"power_target must be in (0, 1), got {self.power_target}")

    @property
    def decision_top_p(self) -> float:
        """The top-p the held-out claims are decided at, stated in advance (``claim_top_p``)."""
        return float(self.evaluation.top_p[0] if self.claim_top_p is None else self.claim_top_p)


def _nested() -> Dict[str, type]:
    return {"sweeps": SweepConfig, "ablation": AblationConfig, "deltas": DeltaConfig, "evaluation": EvaluationConfig,
            "adaptive": AdaptiveStudyConfig, "stress": StressConfig, "checkpoints": CheckpointEvalConfig}


def _build(cls: type, values: Dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise StudyConfigError(f"unknown key(s) {[prefix + k for k in unknown]}; known: {sorted(known)}")
    kwargs = {}
    nested = _nested()
    for key, value in values.items():
        if key in nested and cls is StudyConfig and not (key == "adaptive" and value is None):  # None: no section
            if not isinstance(value, dict):
                raise StudyConfigError(f"{key} must be a mapping, got {value!r}")
            value = _build(nested[key], value, f"{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def study_config_from_dict(values: Dict[str, Any]) -> StudyConfig:
    cfg = _build(StudyConfig, dict(values), "")
    cfg.validate()
    return cfg


def load_study_config(name_or_path: str) -> StudyConfig:
    """conf/study/<name>.yaml (or a path to a YAML file) as it is, without overrides (those are
    recipes/study.py's ``study.KEY=VALUE``, composed by Hydra)."""
    path = name_or_path if name_or_path.endswith((".yaml", ".yml")) else os.path.join(STUDY_CONF_DIR, name_or_path + ".yaml")
    if not os.path.isfile(path):
        raise StudyConfigError(f"study config not found: {path}")
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    values.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return study_config_from_dict(values)


def flat_fields(values: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Algorithm fields with their nested sections' fields as dotted keys
    (``{"lr_control": {"kind": "kl_adaptive"}}`` -> ``{"lr_control.kind": "kl_adaptive"}``): what
    a run's settings and overrides are made of. An old flat key (``lr_control: kl_adaptive``) is
    refused naming its new key."""
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flat_fields(value, f"{prefix}{key}."))
        elif not prefix and key in RENAMED_KEYS:
            raise renamed_key_error(key)
        else:
            out[prefix + key] = value
    return out


def nested_fields(flat: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`flat_fields`."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        *sections, name = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return out


# --------------------------------------------------------------------------------------------
# kind: adaptive (issue 19; the study itself: quatro_nemo/study/adaptive.py)
# --------------------------------------------------------------------------------------------

DEFAULT_CONDITION = "default"


def _default_strategies() -> Dict[str, Dict[str, Any]]:
    return {"controller": {"delta_controller": {"kind": "kl"}}, "variance": {"delta_per_query": {"kind": "reward_variance"}}}


def _default_stress() -> Dict[str, Dict[str, Any]]:
    return {"lr4": {"lr_multiplier": 4.0}, "K4": {"inner_loops": 4}}


@dataclass
class AdaptiveStudyConfig:
    """The ``adaptive:`` section of a ``kind: adaptive`` study (errors name the key)."""

    tasks: List[str] = field(default_factory=lambda: list(REWARD_KINDS))     # task.reward values
    fixed_deltas: List[float] = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.2])
    strategies: Dict[str, Dict[str, Any]] = field(default_factory=_default_strategies)  # name -> QuatroConfig fields
    # QuatroConfig fields every arm (fixed deltas and strategies) shares, e.g. {lr_control: {kind: kl_adaptive}}
    common: Dict[str, Any] = field(default_factory=dict)
    stress: Dict[str, Dict[str, Any]] = field(default_factory=_default_stress)  # name -> inner_loops / lr_multiplier
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    # an arm breaks under a stress condition when its mean final held-out reward there is below
    # this fraction of its reward at the default condition
    tolerance: float = 0.9

    def validate(self) -> None:
        if not self.tasks or any(t not in REWARD_KINDS for t in self.tasks) or len(set(self.tasks)) != len(self.tasks):
            raise StudyConfigError(f"adaptive.tasks must be distinct values of {list(REWARD_KINDS)}, got {self.tasks}")
        _check_positive("adaptive.fixed_deltas", self.fixed_deltas, integer=False)
        if len(set(self.fixed_deltas)) < 2:
            raise StudyConfigError(f"adaptive.fixed_deltas needs at least two radii (a frontier), got {self.fixed_deltas}")
        if not isinstance(self.common, dict):
            raise StudyConfigError(f"adaptive.common must be a mapping of QuatroConfig fields, got {self.common!r}")
        shared = [key for key in self.common if key in ("delta", "delta_controller", "delta_per_query")]
        if shared:
            raise StudyConfigError(f"adaptive.common must not set the radius, which the arms differ by: {shared}")
        try:
            QuatroConfig.from_dict(dict(self.common), source="adaptive.common")
        except ValueError as exc:
            raise StudyConfigError(f"adaptive.common: {exc}") from exc
        if not isinstance(self.strategies, dict) or not self.strategies:
            raise StudyConfigError(f"adaptive.strategies must map names to QuatroConfig fields, got {self.strategies!r}")
        for name, fields in self.strategies.items():
            key = f"adaptive.strategies.{name}"
            if not isinstance(fields, dict):
                raise StudyConfigError(f"{key} must be a mapping of QuatroConfig fields, got {fields!r}")
            try:
                config = QuatroConfig.from_dict(nested_fields({**flat_fields(self.common), **flat_fields(fields)}),
                                                source=key)
            except ValueError as exc:
                raise StudyConfigError(f"{key}: {exc}") from exc
            if not config.adaptive_delta:
                raise StudyConfigError(f"{key} turns no adaptive radius on (delta_controller.kind or delta_per_query.kind)")
        _check_stress_points("adaptive.stress", self.stress)
        _check_seeds("adaptive.seeds", self.seeds)
        if not 0.0 < self.tolerance <= 1.0:
            raise StudyConfigError(f"adaptive.tolerance must be in (0, 1], got {self.tolerance}")
