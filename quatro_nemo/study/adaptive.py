"""The adaptive-delta study (issue 19): QUATRO's adaptive radius against a fixed-delta sweep.

A study config with ``kind: adaptive`` (conf/study/adaptive.yaml) trains, for each task in
``adaptive.tasks`` (``task.reward``: ``binary`` and ``graded``), each condition (the default,
then every ``adaptive.stress`` setting: a larger learning rate, more inner loops) and each seed:
QUATRO at every fixed delta of ``adaptive.fixed_deltas`` and with every strategy of
``adaptive.strategies`` (QuatroConfig fields, the same for every task and condition: no tuning
per task), every arm with the QuatroConfig fields of ``adaptive.common`` too (e.g.
``lr_control: {kind: kl_adaptive}``, conf/study/adaptive_lr.yaml). It answers two questions, each a claim per strategy with the study's paired
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

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from quatro_nemo.study.config import DEFAULT_CONDITION, QUATRO, StudyConfig, flat_fields
from quatro_nemo.study.plan import Changes, Defaults, RunSpec, Setting, StudyPlan, make_setting, run_spec
from quatro_nemo.study.stats import is_not_run

FULL_EVALUATION_NOTE = "default-condition runs: full evaluation; stress runs: sweep_n_samples at the first top-p"


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


def task_overrides(task: str) -> Changes:
    return () if task == "binary" else (("task.reward", task),)


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
            shared = flat_fields(ad.common)
            arms = {arm: dict(shared, delta=delta) for arm, delta in fixed.items()}
            arms.update({name: {**shared, **flat_fields(fields)} for name, fields in ad.strategies.items()})
            for arm, fields in arms.items():
                setting = make_setting(defaults, QUATRO, **common, **fields)
                settings[(task, condition, arm)] = setting
                for seed in ad.seeds:
                    spec = run_spec(setting, seed, defaults)
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
    return an.make_claim(study, f"frontier_{strategy}", statement, comparisons, "",
                         "best fixed delta chosen after the fact per task and metric (favours the fixed delta); "
                         "INCONCLUSIVE means no significant difference, not equivalence: read the intervals",
                         runs=claim_runs(plan, strategy, plan.conditions[:1]))


def claim_runs(plan: AdaptivePlan, strategy: str, conditions: List[str]):
    """A claim's runs (analysis.ClaimRuns): the strategy and every fixed delta, on every task,
    under ``conditions``, over the study's seeds."""
    return ([plan.settings[(task, condition, arm)] for task in plan.tasks for condition in conditions
             for arm in [strategy, *plan.fixed]], plan.seeds)


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
    claim = an.make_claim(study, f"stable_{strategy}", statement, comparisons, "",
                          "loss = final held-out reward at the default condition minus under the stress condition",
                          runs=claim_runs(plan, strategy, plan.conditions))
    if not comparisons and not is_not_run(claim.verdict):
        claim.note = "no fixed delta broke under any stress condition: nothing to be stable against"
    return claim


def evaluate_adaptive_claims(study) -> list:
    # no default-condition run finished: the frontier claims at the evaluation's n (NOT RUN, 0 seeds)
    kmax = adaptive_kmax(study) or study.cfg.evaluation.n_samples
    plan: AdaptivePlan = study.plan.adaptive
    claims = []
    for strategy in plan.strategies:
        if kmax is not None:
            claims.append(claim_frontier(study, strategy, kmax))
        claims.append(claim_stable(study, strategy))
    return claims
