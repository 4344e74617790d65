"""The study's run list: one RunSpec per distinct training run, shared between the study's parts.

A run is fixed by its *setting* (algorithm, inner loops K, learning-rate multiplier of the
default, non-default algorithm fields, task fields) and its seed. Settings that coincide are one
run: e.g. the log-ratio ablation's ``seq_sum`` arm at delta = 0.1, K = 2 is the K = 2 point of
QUATRO's inner-loop sweep when the default delta is 0.1. Algorithm fields equal to the
algorithm's default are dropped before naming, so such coincidences are found from the composed
configs, not from particular values.

A run's config is its algorithm's base config (:func:`study_base_config`: the study's training
config, composed once per algorithm) with the run's typed values set (``RunSpec.changes``,
:func:`run_config`, the engine's ``configured``). Text appears only where a person or SLURM reads
it: ``RunSpec.overrides`` (the report, the SLURM sweep file) and :func:`train_args`.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from quatro_nemo.engine.api import configured
from quatro_nemo.engine.config import ExperimentConfig, load_config
from quatro_nemo.study.config import QUATRO, StudyConfig, StudyConfigError, flat_fields

Changes = Tuple[Tuple[str, Any], ...]    # (dotted config key, typed value), in order


@dataclass(frozen=True)
class Setting:
    algorithm: str
    inner_loops: int
    lr_multiplier: float
    algo_overrides: Changes = ()    # sorted (field, value), non-default only; a nested section's
                                    # field as a dotted key (lr_control.kind)
    task_overrides: Changes = ()    # (task key, value), e.g. ("task.reward", "graded")

    @property
    def label(self) -> str:
        extra = "".join(f"-{label_key(key)}_{value}" for key, value in self.algo_overrides)
        extra += "".join(f"-{key.rsplit('.', 1)[-1]}_{value}" for key, value in self.task_overrides)
        return f"{self.algorithm}-K{self.inner_loops}-lr{self.lr_multiplier:g}x{extra}"


def label_key(key: str) -> str:
    """An algorithm field in a run's name: a section's ``kind`` by the section's name, other
    dots as ``_`` (``delta_controller.kind`` -> ``delta_controller``, ``delta_controller.target``
    -> ``delta_controller_target``: the names the flat keys before the sections gave)."""
    return key.removesuffix(".kind").replace(".", "_")


def override_text(key: str, value: Any) -> str:
    """A typed value at a config key as recipes/train.py's argument (``trainer.lr=0.0012``)."""
    return f"{key}={value}"


@dataclass(frozen=True)
class RunSpec:
    setting: Setting
    seed: int
    changes: Changes = ()    # the run's values on its algorithm's base config (run_changes)

    @property
    def name(self) -> str:
        return f"{self.setting.label}-s{self.seed}"

    @property
    def overrides(self) -> Tuple[str, ...]:
        """The run as recipes/train.py arguments after :func:`train_args` (the report's and the
        SLURM sweep file's text)."""
        return (f"algorithm={self.setting.algorithm}", *(override_text(k, v) for k, v in self.changes))


@dataclass
class Defaults:
    """What the runs' settings are relative to: each algorithm's base config (study_base_config)."""

    bases: Dict[str, ExperimentConfig]            # algorithm -> its base config

    @property
    def _any(self) -> ExperimentConfig:
        return next(iter(self.bases.values()))

    @property
    def lr(self) -> float:
        return self._any.trainer.lr

    @property
    def inner_loops(self) -> int:
        return self._any.trainer.inner_loops

    @functools.cached_property
    def algorithm_fields(self) -> Dict[str, Dict[str, Any]]:
        """algorithm -> its default config fields (flat_fields)."""
        return {name: flat_fields(dataclasses.asdict(base.algorithm)) for name, base in self.bases.items()}


def checkpoint_eval_values(cfg: StudyConfig) -> Dict[str, Any]:
    """The loop's own held-out evaluation in every run. The study evaluates each final policy
    itself (the engine's EvalRequest, with the base model evaluated once), so it is off, except
    at the held-out checkpoints every ``checkpoints.every`` steps (and at step 0) on the study's
    problems at the claims' top-p (issue 29: comparisons at matched reward and KL)."""
    ck = cfg.checkpoints
    if not ck.every:
        return {"eval.num_problems": 0}
    return {"eval.num_problems": cfg.evaluation.num_problems, "eval.n_samples": ck.n_samples,
            "eval.top_p": cfg.decision_top_p, "eval.temperature": float(cfg.evaluation.temperature),
            "trainer.eval_every": ck.every}


def _composed_args(cfg: StudyConfig) -> List[str]:
    """The study config's own text: the primary training config and ``train_overrides``."""
    return [f"config={cfg.train_config}", *cfg.train_overrides]


def train_args(cfg: StudyConfig) -> List[str]:
    """The study's base config as recipes/train.py arguments (the SLURM edge, and the tests'
    reference for :func:`study_base_config`)."""
    return [*_composed_args(cfg), *(override_text(k, v) for k, v in checkpoint_eval_values(cfg).items())]


def study_base_config(cfg: StudyConfig, algorithm: Optional[str] = None) -> ExperimentConfig:
    """The config every run of the study starts from: the training config with the study-wide
    ``train_overrides`` (the study config's text, composed by Hydra like recipes/train.py's
    arguments), ``algorithm=<algorithm>`` when given, and the held-out checkpoint values."""
    composed = load_config(_composed_args(cfg) + ([f"algorithm={algorithm}"] if algorithm else []))
    return configured(composed, checkpoint_eval_values(cfg))


def read_defaults(cfg: StudyConfig, algorithms: Sequence[str]) -> Defaults:
    return Defaults({name: study_base_config(cfg, name) for name in algorithms})


def make_setting(defaults: Defaults, algorithm: str, inner_loops: Optional[int] = None,
                 lr_multiplier: float = 1.0, task_overrides: Changes = (), **algo_overrides: Any) -> Setting:
    known = defaults.algorithm_fields[algorithm]
    algo_overrides = flat_fields(algo_overrides)
    for key in algo_overrides:
        if key not in known:
            raise ValueError(f"algorithm.{key} is not a field of {algorithm}'s config; known: {sorted(known)}")
    changed = tuple(sorted((k, v) for k, v in algo_overrides.items() if known[k] != v))
    return Setting(algorithm, defaults.inner_loops if inner_loops is None else int(inner_loops),
                   float(lr_multiplier), changed, tuple(task_overrides))


def run_spec(setting: Setting, seed: int, defaults: Defaults) -> RunSpec:
    """The run of ``setting`` at ``seed``: its typed values on its algorithm's base config."""
    changes = (("run.seed", seed), ("trainer.inner_loops", setting.inner_loops),
               ("trainer.lr", defaults.lr * setting.lr_multiplier),
               *((f"algorithm.{key}", value) for key, value in setting.algo_overrides), *setting.task_overrides)
    return RunSpec(setting, seed, changes)


def run_config(defaults: Defaults, spec: RunSpec, directory: str) -> ExperimentConfig:
    """The validated config of one run, training in ``directory``."""
    values: Dict[str, Any] = dict(spec.changes)
    values.update({"run.dir": directory, "run.progress_bar": False})
    return configured(defaults.bases[spec.setting.algorithm], values)


@dataclass
class StudyPlan:
    """Every distinct run, and the settings of each part of the study (for the analysis)."""

    defaults: Defaults
    runs: Dict[str, RunSpec]                       # name -> spec, in plan order
    compare: Dict[str, Setting]                    # algorithm -> default setting
    seeds: List[int]
    sweep_inner: Dict[str, Dict[int, Setting]]     # algorithm -> K -> setting
    sweep_lr: Dict[str, Dict[float, Setting]]      # algorithm -> multiplier -> setting
    sweep_seeds: List[int]
    ablation: Dict[str, Setting]                   # log_ratio -> setting
    ablation_seeds: List[int]
    deltas: Dict[float, Setting]                   # delta -> setting
    delta_seeds: List[int]
    adaptive: Optional[Any] = None                 # an adaptive-delta study's part (study/adaptive.py)
    stress: Dict[str, Dict[str, Setting]] = dataclasses.field(default_factory=dict)  # point -> method or arm -> setting
    stress_seeds: List[int] = dataclasses.field(default_factory=list)

    def runs_of(self, setting: Setting, seeds: Sequence[int]) -> List[RunSpec]:
        return [self.runs[RunSpec(setting, s, ()).name] for s in seeds]

    def needs_full_evaluation(self, spec: RunSpec) -> bool:
        """Main-comparison and delta runs are read at every k and top-p; a run only in the sweeps
        or the ablation is read for its held-out reward alone."""
        return ((spec.setting in self.compare.values() and spec.seed in self.seeds)
                or (spec.setting in self.deltas.values() and spec.seed in self.delta_seeds)
                or (self.adaptive is not None and self.adaptive.needs_full_evaluation(spec)))


# A finished run's final held-out reward at the claims' top-p, None while it is not finished.
RewardOf = Callable[[RunSpec], Optional[float]]


def holds(reward: float, reward_at_default: float, tolerance: float) -> bool:
    """A sweep point holds when its mean final held-out reward keeps at least ``tolerance`` of the
    method's reward at the sweep's default (a method's breaking point is the first that does not)."""
    return reward >= tolerance * reward_at_default


def searched_points(points: Sequence, default, mean_reward: Callable[[Any], Optional[float]],
                    tolerance: float, unknown_holds: bool = False) -> List:
    """The points of a sweep a search runs: every point up to ``default``, then each next point
    while the one before it holds (:func:`holds`); the first point that breaks is the last. A point
    whose mean reward is not known yet (its runs are not finished) ends the list for now, or, with
    ``unknown_holds`` (a cost estimate's upper bound), counts as holding."""
    ordered = sorted(points)
    chosen = [x for x in ordered if x <= default]
    at_default = mean_reward(default)
    for x in (x for x in ordered if x > default):
        previous = mean_reward(chosen[-1])
        if at_default is None or previous is None:
            if not unknown_holds:
                break
        elif not holds(previous, at_default, tolerance):
            break
        chosen.append(x)
    return chosen


def build_paper_plan(cfg: StudyConfig, reward_of: Optional[RewardOf] = None,
                     defaults: Optional[Defaults] = None, unknown_holds: bool = False) -> StudyPlan:
    """The run list of a ``kind: paper`` study (``kind: adaptive``: ``adaptive.build_adaptive_plan``;
    ``driver.build_plan`` chooses).

    With ``sweeps.search``, each method's points of the K and learning-rate sweeps are
    :func:`searched_points`, judged by ``reward_of`` (the finished runs' rewards): the study adds a
    method's next K or multiplier only once the one before it has held. Without ``reward_of`` (a
    SLURM sweep, which runs every run at once), the whole grids. ``defaults``: :func:`read_defaults`'
    result, when known. ``unknown_holds``: see :func:`searched_points`."""
    algorithms = sorted(set(cfg.algorithms) | set(cfg.sweeps.algorithms) | set(cfg.stress.algorithms) | {QUATRO})
    defaults = defaults or read_defaults(cfg, algorithms)
    runs: Dict[str, RunSpec] = {}

    def specs(setting: Setting, seeds: Sequence[int]) -> List[RunSpec]:
        return [run_spec(setting, seed, defaults) for seed in seeds]

    def add(setting: Setting, seeds: Sequence[int]) -> Setting:
        for spec in specs(setting, seeds):
            runs.setdefault(spec.name, spec)
        return setting

    compare = {a: add(make_setting(defaults, a), cfg.seeds) for a in cfg.algorithms}
    sw = cfg.sweeps

    def mean_reward(setting: Setting) -> Optional[float]:
        rewards = [reward_of(spec) for spec in specs(setting, sw.seeds)]
        return None if any(r is None for r in rewards) else float(np.mean(rewards))   # as analysis.stat

    def points(grid: Sequence, default, setting_at: Callable[[Any], Setting]) -> List:
        if not sw.search or reward_of is None:
            return list(grid)
        return searched_points(grid, default, lambda x: mean_reward(setting_at(x)), sw.tolerance, unknown_holds)

    def inner_setting(algorithm: str) -> Callable[[int], Setting]:
        return lambda k: make_setting(defaults, algorithm, inner_loops=k)

    def lr_setting(algorithm: str) -> Callable[[float], Setting]:
        return lambda m: make_setting(defaults, algorithm, inner_loops=1, lr_multiplier=m)

    sweep_inner = {a: {k: add(inner_setting(a)(k), sw.seeds) for k in points(sw.inner_loops, 1, inner_setting(a))}
                   for a in sw.algorithms}
    sweep_lr = {a: {m: add(lr_setting(a)(m), sw.seeds) for m in points(sw.lr_multipliers, 1.0, lr_setting(a))}
                for a in sw.algorithms}
    ab = cfg.ablation
    ablation = {g: add(make_setting(defaults, QUATRO, inner_loops=ab.inner_loops, delta=ab.delta, log_ratio=g),
                       ab.seeds) for g in ab.log_ratios}
    deltas = {d: add(make_setting(defaults, QUATRO, delta=d), cfg.deltas.seeds) for d in cfg.deltas.values}
    stress = {point: {name: add(setting, cfg.stress.seeds) for name, setting in stress_settings(cfg, defaults, values).items()}
              for point, values in cfg.stress.points.items()}
    return StudyPlan(defaults, runs, compare, list(cfg.seeds), sweep_inner, sweep_lr, list(sw.seeds),
                     ablation, list(ab.seeds), deltas, list(cfg.deltas.seeds), stress=stress,
                     stress_seeds=list(cfg.stress.seeds))


def stress_settings(cfg: StudyConfig, defaults: Defaults, point: Dict[str, Any]) -> Dict[str, Setting]:
    """One stress point's settings: every ``stress.algorithms`` method at its defaults, and every
    QUATRO arm (``stress.arms``), at the point's K and lr multiplier. An arm field that QUATRO's
    config does not have (misspelt, or an old flat key) fails here, naming the arm."""
    where = dict(inner_loops=point.get("inner_loops"), lr_multiplier=point.get("lr_multiplier", 1.0))
    out = {a: make_setting(defaults, a, **where) for a in cfg.stress.algorithms}
    for arm, fields in cfg.stress.arms.items():
        try:
            out[arm] = make_setting(defaults, QUATRO, **where, **fields)
        except ValueError as exc:   # StudyConfigError included
            raise StudyConfigError(f"stress.arms.{arm}: {exc}") from exc
    return out


def sweep_line(cfg: StudyConfig, spec: RunSpec) -> str:
    """One run's override set as a sweep-file line (``collect=`` maps lines back to runs by it)."""
    return " ".join([*cfg.train_overrides, *spec.overrides])


def sweep_lines(cfg: StudyConfig, plan: StudyPlan) -> List[str]:
    """The SLURM sweep file (slurm/sweep.sh): one override set per line, each preceded by a
    comment naming the run. ``config=`` is left to the template; ``run.dir`` to sweep.sh."""
    lines = [f"# quatro-nemo study '{cfg.name}': {len(plan.runs)} runs (relative to config={cfg.train_config}, "
             f"default lr {plan.defaults.lr!r}).",
             "# Submit: bash slurm/sweep.sh THIS_FILE; report: python recipes/study.py collect=SWEEP_DIR ..."]
    for spec in plan.runs.values():
        lines += [f"# {spec.name}", sweep_line(cfg, spec)]
    return lines
