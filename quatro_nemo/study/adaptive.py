"""The adaptive-delta study (issue 19): QUATRO's adaptive radius against a fixed-delta sweep.

A study config with ``kind: adaptive`` (conf/study/adaptive.yaml) trains, for each task in
``adaptive.tasks`` (``task.reward``: ``binary`` and ``graded``), each condition (the default,
then every ``adaptive.stress`` setting: a larger learning rate, more inner loops) and each seed:
QUATRO at every fixed delta of ``adaptive.fixed_deltas`` and with every strategy of
``adaptive.strategies`` (QuatroConfig fields, the same for every task and condition: no tuning
per task). It answers two questions, each a claim per strategy with the study's paired
statistics (paired t over seeds, Holm within the claim, :mod:`quatro_nemo.study.stats`):

- ``frontier_<strategy>``: does the strategy reach the best fixed delta's accuracy / diversity
  frontier? Per task at the default condition, the strategy minus the best fixed delta of that
  task (chosen after the fact from the sweep's means: an oracle tuned per task, which favours the
  fixed delta) on pass@1, and minus the best fixed delta on pass@kmax (UCC@kmax beside it).
  REPRODUCED: better than the tuned delta everywhere; NOT REPRODUCED: significantly worse
  somewhere (it does not reach the frontier there); INCONCLUSIVE: no significant difference (the
  95% intervals say how far from the frontier it may be).
- ``stable_<strategy>``: does it stay stable where a fixed delta breaks? Per task and stress
  condition, for every fixed delta whose mean final held-out reward falls below ``tolerance``
  of its own default-condition reward (it *breaks*), that delta's loss (reward at the default
  minus under stress, per seed) minus the strategy's. NOT TESTED when no fixed delta breaks.

The report (report.md / report.json / PNGs) has the claims, per task and condition the final
held-out numbers of every arm with its mean radius, the retention under stress, the frontier
figure (pass@1 against pass@kmax and UCC@kmax, fixed deltas as a line, strategies as points,
the base model as a star) and the controller's radius over training.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from quatro_nemo.algos.config import QuatroConfig
from quatro_nemo.rewards.countdown import REWARD_KINDS
from quatro_nemo.study.config import QUATRO, StudyConfig, StudyConfigError, _check_positive, _check_seeds
from quatro_nemo.study.plan import Defaults, RunSpec, Setting, StudyPlan, make_setting, run_overrides

DEFAULT_CONDITION = "default"
FULL_EVALUATION_NOTE = "default-condition runs: full evaluation; stress runs: sweep_n_samples at the first top-p"


def _default_strategies() -> Dict[str, Dict[str, Any]]:
    return {"controller": {"delta_controller": "kl"}, "variance": {"delta_per_query": "reward_variance"}}


def _default_stress() -> Dict[str, Dict[str, Any]]:
    return {"lr4": {"lr_multiplier": 4.0}, "K4": {"inner_loops": 4}}


@dataclass
class AdaptiveStudyConfig:
    """The ``adaptive:`` section of a ``kind: adaptive`` study (errors name the key)."""

    tasks: List[str] = field(default_factory=lambda: list(REWARD_KINDS))     # task.reward values
    fixed_deltas: List[float] = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.2])
    strategies: Dict[str, Dict[str, Any]] = field(default_factory=_default_strategies)  # name -> QuatroConfig fields
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
        if not isinstance(self.strategies, dict) or not self.strategies:
            raise StudyConfigError(f"adaptive.strategies must map names to QuatroConfig fields, got {self.strategies!r}")
        for name, fields in self.strategies.items():
            key = f"adaptive.strategies.{name}"
            if not isinstance(fields, dict):
                raise StudyConfigError(f"{key} must be a mapping of QuatroConfig fields, got {fields!r}")
            try:
                config = QuatroConfig.from_dict(fields, source=key)
            except ValueError as exc:
                raise StudyConfigError(f"{key}: {exc}") from exc
            if not config.adaptive_delta:
                raise StudyConfigError(f"{key} turns no adaptive radius on (delta_controller or delta_per_query)")
        if not isinstance(self.stress, dict):
            raise StudyConfigError(f"adaptive.stress must map names to settings, got {self.stress!r}")
        for name, values in self.stress.items():
            key = f"adaptive.stress.{name}"
            if name == DEFAULT_CONDITION or not isinstance(values, dict) or not values \
                    or set(values) - {"inner_loops", "lr_multiplier"}:
                raise StudyConfigError(f"{key} must be a non-empty mapping of inner_loops / lr_multiplier "
                                       f"(and not named {DEFAULT_CONDITION!r}), got {values!r}")
            if "inner_loops" in values:
                _check_positive(f"{key}.inner_loops", [values["inner_loops"]], integer=True)
            if "lr_multiplier" in values:
                _check_positive(f"{key}.lr_multiplier", [values["lr_multiplier"]], integer=False)
        _check_seeds("adaptive.seeds", self.seeds)
        if not 0.0 < self.tolerance <= 1.0:
            raise StudyConfigError(f"adaptive.tolerance must be in (0, 1], got {self.tolerance}")


# --------------------------------------------------------------------------------------------
# The run list
# --------------------------------------------------------------------------------------------


def fixed_arm(delta: float) -> str:
    return f"delta={delta:g}"


@dataclass
class AdaptivePlan:
    """Every (task, condition, arm) setting; arms are fixed deltas (``delta=0.1``) and strategies."""

    tasks: List[str]
    conditions: List[str]                              # "default" first, then the stress names
    fixed: Dict[str, float]                            # arm -> delta
    strategies: List[str]
    seeds: List[int]
    settings: Dict[Tuple[str, str, str], Setting]      # (task, condition, arm) -> setting

    def arms(self) -> List[str]:
        return list(self.fixed) + list(self.strategies)

    def needs_full_evaluation(self, spec: RunSpec) -> bool:
        """The frontier (pass@kmax, UCC@kmax) is read at the default condition only."""
        return any(s == spec.setting for (_, condition, _), s in self.settings.items()
                   if condition == DEFAULT_CONDITION)


def task_overrides(task: str) -> Tuple[str, ...]:
    return () if task == "binary" else (f"task.reward={task}",)


def build_adaptive_plan(cfg: StudyConfig, defaults: Defaults) -> StudyPlan:
    ad = cfg.adaptive
    conditions = {DEFAULT_CONDITION: {}, **ad.stress}
    fixed = {fixed_arm(d): float(d) for d in ad.fixed_deltas}
    runs: Dict[str, RunSpec] = {}
    settings: Dict[Tuple[str, str, str], Setting] = {}
    for task in ad.tasks:
        for condition, values in conditions.items():
            common = dict(inner_loops=values.get("inner_loops"), lr_multiplier=float(values.get("lr_multiplier", 1.0)),
                          task_overrides=task_overrides(task))
            arms = {arm: dict(delta=delta) for arm, delta in fixed.items()}
            arms.update({name: dict(fields) for name, fields in ad.strategies.items()})
            for arm, fields in arms.items():
                setting = make_setting(defaults, QUATRO, **common, **fields)
                settings[(task, condition, arm)] = setting
                for seed in ad.seeds:
                    spec = RunSpec(setting, seed, run_overrides(setting, seed, defaults))
                    runs.setdefault(spec.name, spec)
    adaptive = AdaptivePlan(list(ad.tasks), list(conditions), fixed, list(ad.strategies), list(ad.seeds), settings)
    return StudyPlan(defaults, runs, {}, [], {}, {}, [], {}, [], {}, [], adaptive=adaptive)


# --------------------------------------------------------------------------------------------
# Claims
# --------------------------------------------------------------------------------------------


def _analysis():
    from quatro_nemo.study import analysis

    return analysis


def adaptive_kmax(study) -> Optional[int]:
    """The largest k every default-condition run was evaluated at."""
    ks_of = _analysis().ks_of
    plan: AdaptivePlan = study.plan.adaptive
    finals = [run.final(study.claim_top_p) for (_, condition, _), s in plan.settings.items()
              if condition == DEFAULT_CONDITION for run in study.group(s, plan.seeds)]
    ks = [max(ks_of(f)) for f in finals if f and ks_of(f)]
    return min(ks) if ks else None


def mean_of(study, setting: Setting, extract) -> Optional[float]:
    s = study.stat(setting, study.plan.adaptive.seeds, extract)
    return None if s is None else s.mean


def best_fixed(study, task: str, extract) -> Optional[str]:
    """The fixed-delta arm with the highest mean of `extract` at the default condition of `task`."""
    plan: AdaptivePlan = study.plan.adaptive
    means = {arm: mean_of(study, plan.settings[(task, DEFAULT_CONDITION, arm)], extract) for arm in plan.fixed}
    means = {arm: m for arm, m in means.items() if m is not None}
    return max(means, key=means.get) if means else None


def claim_frontier(study, strategy: str, kmax: int):
    """The strategy minus the best fixed delta (per task, oracle) on pass@1 and on pass@kmax."""
    an = _analysis()
    plan: AdaptivePlan = study.plan.adaptive
    p = study.claim_top_p
    metrics = [("pass@1", an.final_metric("pass@1", p)), (f"pass@{kmax}", an.final_metric(f"pass@{kmax}", p))]
    ucc = an.final_metric(f"ucc@{kmax}", p)
    comparisons = []
    for task in plan.tasks:
        mine = plan.settings[(task, DEFAULT_CONDITION, strategy)]
        for name, extract in metrics:
            arm = best_fixed(study, task, extract)
            if arm is None:
                continue
            other = plan.settings[(task, DEFAULT_CONDITION, arm)]
            comparisons.append(an.paired_comparison(
                f"{task}: {name} - best fixed ({arm})", study.by_seed(mine, plan.seeds, extract),
                study.by_seed(other, plan.seeds, extract), **{strategy: mean_of(study, mine, extract),
                                                              arm: mean_of(study, other, extract),
                                                              f"ucc@{kmax} {strategy}": mean_of(study, mine, ucc),
                                                              f"ucc@{kmax} {arm}": mean_of(study, other, ucc)}))
    statement = (f"'{strategy}' (one setting for every task) reaches the accuracy / diversity frontier of the best fixed "
                 f"delta tuned per task: pass@1 and pass@{kmax} (top-p {p:g}) not below it")
    return an._claim(study, f"frontier_{strategy}", statement, comparisons, "",
                     "best fixed delta chosen after the fact per task and metric (favours the fixed delta); "
                     "INCONCLUSIVE means no significant difference, not equivalence: read the intervals")


def reward_loss(study, task: str, condition: str, arm: str) -> Dict[int, float]:
    """seed -> final held-out reward at the default condition minus under `condition`."""
    an = _analysis()
    plan: AdaptivePlan = study.plan.adaptive
    reward = an.final_metric("reward/mean", study.claim_top_p)
    at_default = study.by_seed(plan.settings[(task, DEFAULT_CONDITION, arm)], plan.seeds, reward)
    stressed = study.by_seed(plan.settings[(task, condition, arm)], plan.seeds, reward)
    return {s: at_default[s] - stressed[s] for s in at_default if s in stressed}


def retention(study, task: str, condition: str, arm: str) -> Optional[float]:
    """Mean final held-out reward under `condition` / at the default condition."""
    an = _analysis()
    plan: AdaptivePlan = study.plan.adaptive
    reward = an.final_metric("reward/mean", study.claim_top_p)
    base = mean_of(study, plan.settings[(task, DEFAULT_CONDITION, arm)], reward)
    stressed = mean_of(study, plan.settings[(task, condition, arm)], reward)
    if base is None or stressed is None or base <= 0:
        return None
    return stressed / base


def breaks(study, task: str, condition: str, arm: str) -> Optional[bool]:
    kept = retention(study, task, condition, arm)
    return None if kept is None else kept < study.cfg.adaptive.tolerance


def claim_stable(study, strategy: str):
    """Each broken fixed delta's reward loss under stress minus the strategy's, paired by seed."""
    an = _analysis()
    plan: AdaptivePlan = study.plan.adaptive
    comparisons = []
    for task in plan.tasks:
        for condition in plan.conditions[1:]:
            mine = reward_loss(study, task, condition, strategy)
            for arm in plan.fixed:
                if breaks(study, task, condition, arm):
                    theirs = reward_loss(study, task, condition, arm)
                    comparisons.append(an.paired_comparison(
                        f"{task}, {condition}: loss of {arm} - loss of {strategy}", theirs, mine,
                        **{f"retention {arm}": retention(study, task, condition, arm),
                           f"retention {strategy}": retention(study, task, condition, strategy)}))
    statement = (f"'{strategy}' stays stable where a fixed delta breaks (final held-out reward under stress below "
                 f"{study.cfg.adaptive.tolerance:.0%} of its default): smaller reward loss than each broken delta")
    claim = an._claim(study, f"stable_{strategy}", statement, comparisons, "",
                      "loss = final held-out reward at the default condition minus under the stress condition")
    if not comparisons:
        claim.note = "no fixed delta broke under any stress condition: nothing to be stable against"
    return claim


def evaluate_adaptive_claims(study) -> list:
    kmax = adaptive_kmax(study)
    plan: AdaptivePlan = study.plan.adaptive
    claims = []
    for strategy in plan.strategies:
        if kmax is not None:
            claims.append(claim_frontier(study, strategy, kmax))
        claims.append(claim_stable(study, strategy))
    return claims


def write_adaptive_report(cfg: StudyConfig, plan: StudyPlan, study_dir: str, out_dir: str,
                          info: Dict[str, Any]) -> Dict[str, Any]:
    """Load the kept metrics of ``study_dir``, test the claims, write report.md / report.json / PNGs."""
    from quatro_nemo.eval.tables import to_jsonable
    from quatro_nemo.study.adaptive_report import to_markdown, write_figures

    an = _analysis()
    study = an.Study(cfg, plan, an.load_runs(study_dir, list(plan.runs)), an.load_base(study_dir))
    claims = evaluate_adaptive_claims(study)
    info = dict(info, scale_note=cfg.description or None)
    os.makedirs(out_dir, exist_ok=True)
    figures = write_figures(study, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(study, claims, figures, info))
    ad: AdaptivePlan = plan.adaptive
    summary = {"study": cfg.name, "kind": cfg.kind, "info": info, "claims": an.claims_to_json(claims),
               "retention": {task: {c: {arm: retention(study, task, c, arm) for arm in ad.arms()}
                                    for c in ad.conditions[1:]} for task in ad.tasks},
               "runs": {name: {"finished": name in study.runs, "overrides": list(spec.overrides)}
                        for name, spec in plan.runs.items()}}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(summary), f, indent=1, allow_nan=False)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "json": os.path.join(out_dir, "report.json"),
             **{k: os.path.join(out_dir, v) for k, v in figures.items()}}
    return {"paths": paths, "claims": claims, "study": study}
