"""Aggregate the study's runs over seeds and test the paper's claims one by one.

Every number comes from the kept metrics of the runs (``<study>/metrics/<run>.jsonl.gz``: the
training records the loop logs, and the held-out records of :mod:`quatro_nemo.engine.heldout`
at each top-p) and of the base model (``metrics/base.jsonl.gz``), except the advantage vs
number-of-correct-responses table, which is exact for binary rewards (``solve_dual``).

Each claim is a family of comparisons, each a paired t test over seeds of a per-seed difference
that is > 0 when the claim holds, Holm-corrected within the claim (:mod:`quatro_nemo.study.stats`
says how and why). Held-out claims are decided at the first top-p of the study's evaluation (the
paper's 0.7); the report shows the other top-p beside them. Sweep and ablation comparisons use
their own seeds (``sweeps.seeds``, ``ablation.seeds``, ``deltas.seeds``), never the main
comparison's spread.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from quatro_nemo.algos import solve_dual
from quatro_nemo.algos.step_state import ACHIEVED_KL, ACHIEVED_KL_MAX, ACHIEVED_OVER_DELTA, LR_MULTIPLIER
from quatro_nemo.engine.heldout import EVALUATION_KIND
from quatro_nemo.study.config import QUATRO, StudyConfig
from quatro_nemo.study.kept import BASE, archive_path, read_archive
from quatro_nemo.study.plan import Setting, StudyPlan, holds
from quatro_nemo.study.stats import (NOT_TESTED, Comparison, PairedTest, decide, exact_verdict, not_run, paired_differences,
                                     paired_t)

EVAL_KIND = EVALUATION_KIND

Extract = Callable[["RunData"], Optional[float]]


# --------------------------------------------------------------------------------------------
# Runs: the kept metrics
# --------------------------------------------------------------------------------------------


@dataclass
class RunData:
    name: str
    evals: Dict[float, Dict[str, Any]]     # top_p -> the final held-out record
    train: List[Dict[str, Any]]            # train records sorted by step
    checkpoints: List[Dict[str, Any]] = field(default_factory=list)   # the loop's held-out records, by step

    def final(self, top_p: float) -> Optional[Dict[str, Any]]:
        return self.evals.get(float(top_p))


def run_from_records(name: str, records: Sequence[Dict[str, Any]]) -> Optional[RunData]:
    evals = {float(r["top_p"]): r for r in records if r.get("kind") == EVAL_KIND}
    if not evals:
        return None
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    checkpoints = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    return RunData(name, evals, train, checkpoints)


def load_runs(study_dir: str, names: Sequence[str]) -> Dict[str, RunData]:
    """name -> RunData for every run of `names` with kept metrics in ``<study_dir>/metrics``."""
    out = {}
    for name in names:
        path = archive_path(study_dir, name)
        if os.path.isfile(path):
            data = run_from_records(name, read_archive(path))
            if data is not None:
                out[name] = data
    return out


def load_base(study_dir: str) -> Dict[float, Dict[str, Any]]:
    path = archive_path(study_dir, BASE)
    if not os.path.isfile(path):
        return {}
    return {float(r["top_p"]): r for r in read_archive(path) if r.get("kind") == EVAL_KIND}


# --------------------------------------------------------------------------------------------
# Per-run quantities
# --------------------------------------------------------------------------------------------


def finite(value: Any) -> Optional[float]:
    """A finite float, or None (metrics.jsonl logs +-inf as the strings "inf" / "-inf")."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def finite_values(values: Sequence[Any]) -> List[float]:
    return [v for v in (finite(x) for x in values) if v is not None]


def ks_of(record: Dict[str, Any], prefix: str = "pass@") -> List[int]:
    return sorted(int(k[len(prefix):]) for k in record if k.startswith(prefix))


def final_metric(key: str, top_p: float) -> Extract:
    return lambda run: finite((run.final(top_p) or {}).get(key))


def entropy_retention(run: RunData) -> Optional[float]:
    """Policy entropy on the rollouts at the last training step / at the first (1 = no loss)."""
    if not run.train or not finite(run.train[0].get("entropy")):
        return None
    return finite(run.train[-1].get("entropy")) / finite(run.train[0]["entropy"])


def over_training(key: str, reduce: Callable[[List[float]], Any]) -> Extract:
    """``reduce`` (np.mean, np.max, np.median) of the finite values ``key`` took over a run's
    training steps; None when it logged none."""
    def extract(run: RunData) -> Optional[float]:
        values = finite_values(r.get(key) for r in run.train)
        return float(reduce(values)) if values else None
    return extract


def mean_over_training(key: str) -> Extract:
    return over_training(key, np.mean)


def peak_over_training(key: str) -> Extract:
    return over_training(key, np.max)


def median_over_training(key: str) -> Extract:
    return over_training(key, np.median)


@dataclass
class Stat:
    """Mean over seeds with the sample std and the 95% t interval of the mean."""

    mean: float
    std: float
    n: int
    low: float
    high: float


def stat(values: Sequence[float]) -> Optional[Stat]:
    from scipy import stats as scipy_stats

    values = finite_values(values)
    if not values:
        return None
    mean = float(np.mean(values))
    if len(values) == 1:
        return Stat(mean, 0.0, 1, mean, mean)
    std = float(np.std(values, ddof=1))
    half = float(scipy_stats.t.ppf(0.975, len(values) - 1)) * std / math.sqrt(len(values))
    return Stat(mean, std, len(values), mean - half, mean + half)


class Study:
    """The plan, the loaded runs, the base model's evaluation, and per-seed values."""

    def __init__(self, cfg: StudyConfig, plan: StudyPlan, runs: Dict[str, RunData],
                 base: Optional[Dict[float, Dict[str, Any]]] = None):
        self.cfg, self.plan, self.runs, self.base = cfg, plan, runs, base or {}
        self.top_ps = [float(p) for p in cfg.evaluation.top_p]
        self.claim_top_p = cfg.decision_top_p      # stated in advance (claim_top_p), else the first

    def by_seed(self, setting: Setting, seeds: Sequence[int], extract: Extract) -> Dict[int, float]:
        """seed -> value for the finished runs of `setting` among `seeds`."""
        out = {}
        for spec in self.plan.runs_of(setting, seeds):
            run = self.runs.get(spec.name)
            value = extract(run) if run is not None else None
            if value is not None:
                out[spec.seed] = value
        return out

    def group(self, setting: Setting, seeds: Sequence[int]) -> List[RunData]:
        return [self.runs[s.name] for s in self.plan.runs_of(setting, seeds) if s.name in self.runs]

    def complete_seeds(self, settings: Sequence[Setting], seeds: Sequence[int]) -> List[int]:
        """The seeds of ``seeds`` for which every setting of ``settings`` has a finished run (the
        complete pairs of a claim's comparisons)."""
        return [seed for seed in seeds
                if all(spec.name in self.runs for setting in settings for spec in self.plan.runs_of(setting, [seed]))]

    def stat(self, setting: Setting, seeds: Sequence[int], extract: Extract) -> Optional[Stat]:
        return stat(list(self.by_seed(setting, seeds, extract).values()))

    def kmax(self) -> Optional[int]:
        """The largest k every main-comparison run was evaluated at (sweep-only runs have fewer samples)."""
        finals = [run.final(self.claim_top_p) for s in self.plan.compare.values() for run in self.group(s, self.plan.seeds)]
        ks = [max(ks_of(f)) for f in finals if f and ks_of(f)]
        return min(ks) if ks else None

    def curve(self, setting: Setting, seeds: Sequence[int], key: str
              ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(steps, mean, std) over seeds of a per-step training metric, on the steps every seed logged."""
        series = [{r["step"]: finite(r.get(key)) for r in run.train if finite(r.get(key)) is not None}
                  for run in self.group(setting, seeds)]
        series = [s for s in series if s]
        if not series:
            return None
        steps = sorted(set.intersection(*(set(s) for s in series)))
        if not steps:
            return None
        values = np.array([[s[step] for step in steps] for s in series], dtype=float)
        std = values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros(len(steps))
        return np.array(steps), values.mean(axis=0), std


def identical_methods(study: Study) -> List[Tuple[str, str]]:
    """Pairs of compared methods whose runs ended with identical held-out results for every seed
    (e.g. GRPO and CISPO, or GSPO and GMPO, have the same gradient when every update is on-policy)."""
    def signature(setting: Setting):
        runs = study.group(setting, study.plan.seeds)
        keys = ("reward/mean", "entropy", "ucr")
        return tuple(tuple((r.final(study.claim_top_p) or {}).get(k) for k in keys) for r in runs) if runs else None

    names = list(study.plan.compare)
    sigs = {n: signature(study.plan.compare[n]) for n in names}
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if sigs[a] is not None and sigs[a] == sigs[b]]


# --------------------------------------------------------------------------------------------
# Claims
# --------------------------------------------------------------------------------------------


@dataclass
class Claim:
    id: str
    statement: str                  # the paper's claim, as tested here
    verdict: str
    summary: str                    # the numbers behind the verdict, one line
    comparisons: List[Comparison] = field(default_factory=list)
    note: str = ""
    margin: Optional[float] = None  # the stated equivalence margin (TOST), if the claim has one
    family_size: int = 0            # comparisons in the claim's Holm family (also when NOT RUN)
    design_seeds: Optional[int] = None   # the paired seeds its design states (None: not stated)


def paired_comparison(label: str, better: Mapping[int, float], other: Mapping[int, float],
                      **detail: Any) -> Comparison:
    """better - other paired by seed (None test when fewer than two seeds pair up)."""
    differences = paired_differences(better, other)
    return Comparison(label, paired_t(differences), detail=dict(detail, seeds=len(differences)))


def _count_line(comparisons: Sequence[Comparison]) -> str:
    from quatro_nemo.study.stats import OPPOSES, SUPPORTS, WITHIN_MARGIN

    n = len(comparisons)
    equivalent = sum(c.outcome == WITHIN_MARGIN for c in comparisons)
    return (f"significant for the claim vs {sum(c.outcome == SUPPORTS for c in comparisons)}/{n}, "
            f"against it vs {sum(c.outcome == OPPOSES for c in comparisons)}/{n}"
            + (f", equivalent vs {equivalent}/{n}" if equivalent else ""))


# A claim's runs: the settings its comparisons read and the seeds its design states for them.
ClaimRuns = Tuple[Sequence[Setting], Sequence[int]]


def make_claim(study: Study, claim_id: str, statement: str, comparisons: List[Comparison], summary: str,
               note: str = "", runs: Optional[ClaimRuns] = None) -> Claim:
    """Decide the claim's family (stats.decide), with the equivalence margin the study config
    states for this claim id, if any (``equivalence_margins``). With ``runs`` (settings, designed
    seeds): a claim whose runs are finished for fewer seeds than designed is ``NOT RUN (n of N
    seeds)`` (stats.not_run), n the seeds with every run finished, and nothing is decided."""
    margin = study.cfg.equivalence_margins.get(claim_id)
    designed = None if runs is None else len(runs[1])
    if runs is not None:
        complete = len(study.complete_seeds(*runs))
        if complete < designed:
            return Claim(claim_id, statement, not_run(complete, designed),
                         f"finished for {complete} of the design's {designed} seeds: not decided", [], note, margin,
                         len(comparisons), designed)
    verdict = decide(comparisons, study.cfg.alpha, margin)
    if comparisons and verdict != NOT_TESTED:
        summary = f"{summary}; {_count_line(comparisons)}" if summary else _count_line(comparisons)
    return Claim(claim_id, statement, verdict, summary, comparisons, note, margin, len(comparisons), designed)


def families(study: Study, claim_id: str) -> List[Tuple[str, List[str]]]:
    """(claim id, baselines) of each family of a main-comparison claim: one family of every
    baseline, or, with ``primary_baselines``, the primary family under the claim's own id and the
    other baselines as ``<id>_secondary`` (each Holm-corrected on its own)."""
    baselines = [a for a in study.plan.compare if a != QUATRO]
    primary = study.cfg.primary_baselines
    if not primary:
        return [(claim_id, baselines)]
    secondary = [a for a in baselines if a not in primary]
    return [(claim_id, list(primary))] + ([(f"{claim_id}_secondary", secondary)] if secondary else [])


def claim_higher_than_baselines(study: Study, claim_id: str, statement: str, extract: Extract, metric_name: str,
                                beside: Optional[Tuple[str, Extract]] = None,
                                baselines: Optional[Sequence[str]] = None) -> Claim:
    """QUATRO's metric vs each baseline's (``baselines``: these only) at the default settings,
    paired by seed. `beside` (name, extract) is a related metric reported with each comparison,
    not tested."""
    plan = study.plan
    quatro = study.by_seed(plan.compare[QUATRO], plan.seeds, extract)
    comparisons = []
    for name, setting in plan.compare.items():
        if name == QUATRO or (baselines is not None and name not in baselines):
            continue
        other = study.by_seed(setting, plan.seeds, extract)
        detail = {"quatro": _mean(quatro), name: _mean(other)}
        if beside is not None:
            detail.update({f"{beside[0]} quatro": _mean(study.by_seed(plan.compare[QUATRO], plan.seeds, beside[1])),
                           f"{beside[0]} {name}": _mean(study.by_seed(setting, plan.seeds, beside[1]))})
        comparisons.append(paired_comparison(name, quatro, other, **detail))
    s = stat(list(quatro.values()))
    summary = "" if s is None else f"QUATRO {metric_name} {s.mean:.4f} ± {s.std:.4f} (n={s.n})"
    return make_claim(study, claim_id, statement, comparisons, summary, runs=main_runs(study, baselines))


def main_runs(study: Study, baselines: Optional[Sequence[str]]) -> ClaimRuns:
    """A main-comparison claim's runs: QUATRO and ``baselines`` (None: every method) at the
    default settings, over the main comparison's seeds."""
    plan = study.plan
    names = [n for n in plan.compare if n == QUATRO or baselines is None or n in baselines]
    return [plan.compare[n] for n in names], plan.seeds


def _mean(values: Mapping[int, float]) -> Optional[float]:
    return float(np.mean(list(values.values()))) if values else None


def claim_gain_grows_with_k(study: Study, kmax: int, claim_id: str = "passk_gain_grows_with_k",
                            baselines: Optional[Sequence[str]] = None) -> Claim:
    """Per seed: (QUATRO - baseline) at k = kmax minus at k = 1."""
    plan, p = study.plan, study.claim_top_p
    lo, hi = final_metric("pass@1", p), final_metric(f"pass@{kmax}", p)
    q_lo, q_hi = (study.by_seed(plan.compare[QUATRO], plan.seeds, e) for e in (lo, hi))
    comparisons = []
    for name, setting in plan.compare.items():
        if name == QUATRO or (baselines is not None and name not in baselines):
            continue
        b_lo, b_hi = (study.by_seed(setting, plan.seeds, e) for e in (lo, hi))
        gain_hi = dict(zip(*_paired(q_hi, b_hi)))
        gain_lo = dict(zip(*_paired(q_lo, b_lo)))
        comparisons.append(paired_comparison(name, gain_hi, gain_lo, **{"gain@1": _mean(gain_lo),
                                                                        f"gain@{kmax}": _mean(gain_hi)}))
    return make_claim(study, claim_id, f"QUATRO's Pass@k gain over each baseline grows with k (k=1 -> k={kmax})",
                      comparisons, "", runs=main_runs(study, baselines))


def _paired(a: Mapping[int, float], b: Mapping[int, float]) -> Tuple[List[int], List[float]]:
    """(seeds, a - b) over the seeds both have."""
    seeds = sorted(s for s in a if s in b)
    return seeds, [a[s] - b[s] for s in seeds]


def sweep_degradation(study: Study, axis: Dict[Any, Setting], seeds: Sequence[int], default: Any,
                      points: Optional[Sequence[Any]] = None) -> Dict[int, float]:
    """seed -> mean over ``points`` (default: the axis's non-default points) of (reward at the
    default - reward there): how much held-out reward the method loses along the axis, each seed
    on its own runs."""
    reward = final_metric("reward/mean", study.claim_top_p)
    at_default = study.by_seed(axis[default], seeds, reward)
    points = [x for x in axis if x != default] if points is None else list(points)
    drops: Dict[int, List[float]] = {}
    for x in points:
        for seed, value in study.by_seed(axis[x], seeds, reward).items():
            if seed in at_default:
                drops.setdefault(seed, []).append(at_default[seed] - value)
    return {s: float(np.mean(d)) for s, d in drops.items() if len(d) == len(points)}


def claim_stability(study: Study, claim_id: str, statement: str, sweep: Dict[str, Dict[Any, Setting]],
                    default: Any, axis_name: str) -> Claim:
    """Each baseline's reward loss along the axis minus QUATRO's, paired by seed (sweep seeds), on
    the points both ran (all of them, unless a search ended one method's sweep before another's)."""
    if QUATRO not in sweep or len(sweep[QUATRO]) < 2:
        return Claim(claim_id, statement, NOT_TESTED, "", [], f"the {axis_name} sweep has one point")
    seeds = study.plan.sweep_seeds
    mine = sweep_degradation(study, sweep[QUATRO], seeds, default)
    comparisons = []
    for name, axis in sweep.items():
        if name == QUATRO:
            continue
        common = sorted(x for x in axis if x in sweep[QUATRO] and x != default)
        baseline = sweep_degradation(study, axis, seeds, default, common)
        quatro = sweep_degradation(study, sweep[QUATRO], seeds, default, common)
        detail = {} if len(common) == len(sweep[QUATRO]) - 1 == len(axis) - 1 else {
            "points": ", ".join(f"{x:g}" for x in common)}
        comparisons.append(paired_comparison(name, baseline, quatro, quatro_loss=_mean(quatro),
                                             baseline_loss=_mean(baseline), **detail))
    summary = "" if not mine else (f"QUATRO's mean held-out reward loss over {axis_name} != {default:g}: "
                                   f"{_mean(mine):+.4f}")
    return make_claim(study, claim_id, statement, comparisons, summary,
                      "loss = reward at the default minus reward at a point, averaged over the axis's other points "
                      "that both methods ran", runs=([s for axis in sweep.values() for s in axis.values()], seeds))


def claim_at_stress_point(study: Study, point: str) -> Claim:
    """Issue 29: at a fixed stress point, QUATRO's final held-out reward minus each baseline's
    there, paired by seed (``stress.seeds``), one Holm family per point; each QUATRO arm
    (``stress.arms``) is compared with every baseline and with QUATRO itself in the same family."""
    settings, seeds = study.plan.stress[point], study.plan.stress_seeds
    reward = final_metric("reward/mean", study.claim_top_p)
    values = {name: study.by_seed(setting, seeds, reward) for name, setting in settings.items()}
    arms = list(study.cfg.stress.arms)
    baselines = [a for a in settings if a != QUATRO and a not in arms]
    comparisons = [paired_comparison(f"quatro - {b}", values[QUATRO], values[b], quatro=_mean(values[QUATRO]),
                                     baseline=_mean(values[b])) for b in baselines]
    for arm in arms:
        comparisons += [paired_comparison(f"{arm} - {b}", values[arm], values[b], arm=_mean(values[arm]),
                                          baseline=_mean(values[b])) for b in [*baselines, QUATRO]]
    where = ", ".join(f"{k} {v:g}" for k, v in study.cfg.stress.points[point].items())
    summary = ", ".join(f"{name} {_mean(v):.4f}" for name, v in values.items() if v)
    return make_claim(study, f"stress_{point}", f"At the stress point {point} ({where}) QUATRO keeps a higher final "
                      f"held-out reward than every baseline (top-p {study.claim_top_p:g})", comparisons,
                      f"final held-out reward: {summary}" if summary else "",
                      "tested at this point alone (fixed, not searched); arms vs every baseline and vs QUATRO",
                      runs=(list(settings.values()), seeds))


MATCH_WINDOW = 5     # rollout steps averaged for a checkpoint's rollout reward / KL-to-reference


def checkpoint_curve(run: RunData, x_key: str, y_key: str) -> List[Tuple[float, float]]:
    """(x, y) at each held-out checkpoint after step 0: x the mean of training metric ``x_key``
    over the MATCH_WINDOW rollout steps ending at the checkpoint (rollout reward is noisy step to
    step), y the checkpoint's held-out ``y_key``."""
    out = []
    for record in run.checkpoints:
        x, y = window_mean(run, x_key, record["step"]), finite(record.get(y_key))
        if record["step"] > 0 and x is not None and y is not None:
            out.append((x, y))
    return out


def window_mean(run: RunData, key: str, step: int) -> Optional[float]:
    """The mean of training metric ``key`` over the MATCH_WINDOW rollout steps ending at ``step``."""
    values = finite_values(r.get(key) for r in run.train if step - MATCH_WINDOW < r["step"] <= step)
    return float(np.mean(values)) if values else None


def matched_difference(mine: List[Tuple[float, float]], other: List[Tuple[float, float]]) -> Optional[float]:
    """y(mine) - y(other) at the matched level x*: the highest x both curves reached, read off each
    by linear interpolation along x; None when the ranges of x do not overlap (or a curve has fewer
    than two checkpoints)."""
    if len(mine) < 2 or len(other) < 2:
        return None
    level = min(max(x for x, _ in mine), max(x for x, _ in other))
    if level < max(min(x for x, _ in mine), min(x for x, _ in other)):
        return None

    def at(curve: List[Tuple[float, float]]) -> float:
        xs, ys = zip(*sorted(curve))
        return float(np.interp(level, xs, ys))
    return at(mine) - at(other)


def claim_matched(study: Study, claim_id: str, x_key: str, x_name: str, y_key: str,
                  baselines: Optional[Sequence[str]] = None) -> Claim:
    """Issue 29: QUATRO's held-out ``y_key`` minus each baseline's at a matched training level
    (rollout reward or KL-to-reference) rather than at an equal step, paired by seed; the level is
    the highest both runs of the seed reached (:func:`matched_difference`)."""
    plan = study.plan
    curves = {name: {spec.seed: checkpoint_curve(study.runs[spec.name], x_key, y_key)
                     for spec in plan.runs_of(setting, plan.seeds) if spec.name in study.runs}
              for name, setting in plan.compare.items()}
    comparisons = []
    for name in plan.compare:
        if name == QUATRO or (baselines is not None and name not in baselines):
            continue
        diffs = {s: matched_difference(curves[QUATRO][s], curves[name][s]) for s in curves[QUATRO] if s in curves[name]}
        diffs = {s: d for s, d in diffs.items() if d is not None}
        comparisons.append(paired_comparison(name, diffs, {s: 0.0 for s in diffs}))
    return make_claim(study, claim_id, f"QUATRO keeps a higher held-out {y_key} than each baseline at matched {x_name} "
                      f"(held-out checkpoints every {study.cfg.checkpoints.every} steps, top-p {study.claim_top_p:g})",
                      comparisons, "", f"per seed, at the highest {x_name} both runs reached (mean over the "
                      f"{MATCH_WINDOW} rollout steps before a checkpoint), each run's held-out value interpolated there",
                      runs=main_runs(study, baselines))


def claim_logratio(study: Study) -> Claim:
    """Fig. 4c: with the detached log-ratio term the final reward is higher and the mean
    KL(pi_old || pi_theta) over training lower (both paired by seed)."""
    plan, cfg = study.plan, study.cfg
    statement = (f"Without the log-ratio term (delta={cfg.ablation.delta:g}, K={cfg.ablation.inner_loops}) reward "
                 "is lower and KL-to-old higher; with it reward is higher and KL controlled")
    reward = final_metric("reward/mean", study.claim_top_p)
    kl = mean_over_training("policy/kl_old")
    without = plan.ablation["none"]
    seeds = plan.ablation_seeds
    comparisons, parts = [], []
    for statistic, setting in plan.ablation.items():
        if statistic == "none":
            continue
        r_with, r_without = study.by_seed(setting, seeds, reward), study.by_seed(without, seeds, reward)
        k_with, k_without = study.by_seed(setting, seeds, kl), study.by_seed(without, seeds, kl)
        comparisons.append(paired_comparison(f"final reward: {statistic} - none", r_with, r_without,
                                             with_term=_mean(r_with), without_term=_mean(r_without)))
        comparisons.append(paired_comparison(f"mean KL-to-old: none - {statistic}", k_without, k_with,
                                             with_term=_mean(k_with), without_term=_mean(k_without)))
        if r_with and r_without and k_with and k_without:
            parts.append(f"{statistic}: final reward {_mean(r_with):.4f} vs none {_mean(r_without):.4f}; mean "
                         f"KL-to-old {_mean(k_with):.3g} vs none {_mean(k_without):.3g}")
    return make_claim(study, "logratio_ablation", statement, comparisons, "; ".join(parts),
                      runs=(list(plan.ablation.values()), seeds))


def claim_lambda_vs_delta(study: Study) -> Claim:
    plan = study.plan
    lam = mean_over_training("quatro/lambda/mean")
    ordered = sorted(plan.deltas.items())
    values = {d: study.by_seed(s, plan.delta_seeds, lam) for d, s in ordered}
    comparisons = [paired_comparison(f"lambda(delta={d1:g}) - lambda(delta={d2:g})", values[d1], values[d2])
                   for (d1, _), (d2, _) in zip(ordered, ordered[1:])]
    summary = ", ".join(f"delta={d:g}: mean lambda {_mean(v):.4f}" for d, v in values.items() if v)
    return make_claim(study, "lambda_vs_delta", "Smaller delta gives larger lambda throughout training (App. C.1, "
                      "Fig. I right)", comparisons, summary, runs=([s for _, s in ordered], plan.delta_seeds))


def advantage_table(deltas: Sequence[float], n: int, lambda_min: float) -> Dict[float, Dict[str, List[float]]]:
    """Exact QUATRO advantages for binary rewards with c = 1..N-1 correct of N (solve_dual)."""
    out = {}
    for delta in deltas:
        rewards = torch.tensor([[1.0] * c + [0.0] * (n - c) for c in range(1, n)], dtype=torch.float64)
        sol = solve_dual(rewards, float(delta), lambda_min=lambda_min)
        out[float(delta)] = {"c": list(range(1, n)), "lambda": sol.lam.tolist(),
                             "a_correct": sol.advantages[:, 0].tolist(), "a_wrong": sol.advantages[:, -1].tolist(),
                             "inactive": sol.inactive.tolist()}
    return out


def claim_advantage_vs_correct(table: Dict[float, Dict[str, List[float]]]) -> Claim:
    """Fig. I left: the positive advantage falls as c grows; smaller delta attenuates |A| at every c.
    Exact relations (no noise): each either holds or not."""
    holds, comparisons = [], []
    for delta, t in sorted(table.items()):
        steps = np.diff(t["a_correct"])
        holds.append(bool(np.all(steps < 0)))
        comparisons.append(Comparison(f"delta={delta:g}: A(correct) decreasing in c", None,
                                      outcome="holds" if holds[-1] else "fails",
                                      detail={"largest step": float(steps.max())}))
    ordered = sorted(table)
    for d_small, d_large in zip(ordered, ordered[1:]):
        small = np.abs(table[d_small]["a_correct"]) + np.abs(table[d_small]["a_wrong"])
        large = np.abs(table[d_large]["a_correct"]) + np.abs(table[d_large]["a_wrong"])
        holds.append(bool(np.all(small < large)))
        comparisons.append(Comparison(f"|A| smaller at delta={d_small:g} than {d_large:g} for every c", None,
                                      outcome="holds" if holds[-1] else "fails",
                                      detail={"smallest margin": float(np.min(large - small))}))
    first = table[ordered[0]]
    summary = (f"N={len(first['c']) + 1}: A(correct) at c=1..N-1 for delta={ordered[0]:g}: "
               + ", ".join(f"{a:.3f}" for a in first["a_correct"]))
    return Claim("advantage_vs_correct",
                 "Fewer correct responses -> larger update; tighter delta attenuates updates uniformly (App. C.1, Fig. I left)",
                 exact_verdict(holds), summary, comparisons,
                 "exact for binary rewards with the configured lambda_min (no training, no statistics)")


def evaluate_claims(study: Study, advantages: Dict[float, Dict[str, List[float]]]) -> List[Claim]:
    # no main-comparison run finished: the held-out claims at the evaluation's n (NOT RUN, 0 seeds)
    kmax, p = study.kmax() or (study.cfg.evaluation.n_samples if study.plan.compare else None), study.claim_top_p
    claims: List[Claim] = []

    def per_family(claim_id: str, make: Callable[[str, List[str]], Claim]) -> None:
        claims.extend(make(family_id, baselines) for family_id, baselines in families(study, claim_id))

    if kmax is not None:
        per_family("passk_at_kmax", lambda cid, bl: claim_higher_than_baselines(
            study, cid, f"QUATRO has higher held-out Pass@k than every baseline (k={kmax}, top-p {p:g})",
            final_metric(f"pass@{kmax}", p), f"pass@{kmax}", baselines=bl))
        per_family("passk_gain_grows_with_k", lambda cid, bl: claim_gain_grows_with_k(study, kmax, cid, bl))
        per_family("ucc_at_kmax", lambda cid, bl: claim_higher_than_baselines(
            study, cid, f"QUATRO finds more unique correct solutions: UCC@{kmax} higher than every "
            f"baseline (UCR, = UCC@n / n, shown beside it)", final_metric(f"ucc@{kmax}", p), f"ucc@{kmax}",
            beside=("UCR", final_metric("ucr", p)), baselines=bl))
    per_family("entropy_final", lambda cid, bl: claim_higher_than_baselines(
        study, cid, "QUATRO keeps higher policy entropy at the end of training (Tab. 2): held-out token entropy",
        final_metric("entropy", p), "held-out token entropy", baselines=bl))
    per_family("entropy_stable", lambda cid, bl: claim_higher_than_baselines(
        study, cid, "QUATRO's entropy stays stable while baselines' collapse (Fig. 3): "
        "higher ratio of last to first rollout entropy", entropy_retention, "entropy retention", baselines=bl))
    if study.cfg.checkpoints.every:
        n = study.cfg.checkpoints.n_samples
        for x_key, x_name, tag in (("reward/mean", "rollout reward", "reward"), ("policy/kl_ref", "KL-to-reference", "kl")):
            per_family(f"ucc_matched_{tag}", lambda cid, bl, x_key=x_key, x_name=x_name: claim_matched(
                study, cid, x_key, x_name, f"ucc@{n}", bl))
    claims += [claim_at_stress_point(study, point) for point in study.plan.stress]
    plan = study.plan
    claims.append(claim_stability(
        study, "stability_inner_loops", "QUATRO stays stable as inner loops K grow, clipping baselines degrade "
        "(Fig. 4a): smaller held-out reward loss over K > 1", plan.sweep_inner, 1, "K"))
    claims.append(claim_stability(
        study, "stability_lr", "QUATRO tolerates larger learning rates, baselines diverge (Fig. 4b): "
        "smaller held-out reward loss over lr multipliers > 1", plan.sweep_lr, 1.0, "lr x"))
    claims.append(claim_logratio(study))
    claims.append(claim_lambda_vs_delta(study))
    claims.append(claim_advantage_vs_correct(advantages))
    return claims


# --------------------------------------------------------------------------------------------
# Reported (not claimed): the trust region where the step is taken (issue 29)
# --------------------------------------------------------------------------------------------

# column -> the per-run statistic over training steps (each cell: mean ± std over seeds)
TRUST_REGION_COLUMNS: Dict[str, Extract] = {
    "median achieved KL": median_over_training(ACHIEVED_KL),
    "max achieved KL": peak_over_training(ACHIEVED_KL),
    "max per-prompt KL": peak_over_training(ACHIEVED_KL_MAX),
    "median achieved / delta": median_over_training(ACHIEVED_OVER_DELTA),
    "max achieved / delta": peak_over_training(ACHIEVED_OVER_DELTA),
    "median lr multiplier": median_over_training(LR_MULTIPLIER),
}


@dataclass
class TrustRegionRow:
    part: str                      # "deltas" or the stress point's name
    label: str                     # the setting (delta=0.1, or the method / arm at the point)
    delta: float                   # the setting's configured radius
    runs: int                      # runs with the per-step achieved KL logged
    stats: Dict[str, Optional[Stat]]   # TRUST_REGION_COLUMNS -> per-run statistic over seeds


def quatro_delta(study: Study, setting: Setting) -> float:
    """The configured radius of a QUATRO setting (its override, else QUATRO's default)."""
    return float(dict(setting.algo_overrides).get("delta", study.plan.defaults.algorithm_fields[QUATRO]["delta"]))


def trust_region_groups(study: Study) -> List[Tuple[str, str, Setting, Sequence[int]]]:
    """(part, label, setting, seeds) of the QUATRO settings whose achieved KL the report
    tabulates: every delta of the delta sweep, and QUATRO and its arms at each stress point; in
    an adaptive-delta study, every arm per task and condition."""
    plan = study.plan
    if plan.adaptive is not None:
        return [(f"{task}, {condition}", arm, setting, plan.adaptive.seeds)
                for (task, condition, arm), setting in plan.adaptive.settings.items()]
    groups = [("deltas", f"delta={d:g}", s, plan.delta_seeds) for d, s in sorted(plan.deltas.items())]
    for point, settings in plan.stress.items():
        groups += [(point, name, s, plan.stress_seeds) for name, s in settings.items() if s.algorithm == QUATRO]
    return groups


def trust_region_rows(study: Study) -> List[TrustRegionRow]:
    """Issue 29: how far each QUATRO update moved against the radius it was given, from the
    per-step ``trust_region/*`` metrics (algos/step_state.py); one row per setting of
    :func:`trust_region_groups` that has them. Each column is a statistic of a run's training
    steps (median, max), then mean ± std over its seeds; achieved / delta is the ratio the loop
    logged per step (the step's own delta)."""
    rows = []
    for part, label, setting, seeds in trust_region_groups(study):
        logged = study.by_seed(setting, seeds, median_over_training(ACHIEVED_KL))
        if logged:
            rows.append(TrustRegionRow(part, label, quatro_delta(study, setting), len(logged),
                                       {column: study.stat(setting, seeds, extract)
                                        for column, extract in TRUST_REGION_COLUMNS.items()}))
    return rows


def trust_region_to_json(rows: Sequence[TrustRegionRow]) -> List[Dict[str, Any]]:
    return [{"part": r.part, "setting": r.label, "delta": r.delta, "runs": r.runs,
             **{c: None if st is None else {"mean": st.mean, "std": st.std, "n": st.n} for c, st in r.stats.items()}}
            for r in rows]


# --------------------------------------------------------------------------------------------
# Reported (not claimed): breaking points, convergence
# --------------------------------------------------------------------------------------------


def breaking_point(means: Mapping[float, float], default: float, tolerance: float) -> Optional[float]:
    """The largest point x of the axis such that every point up to x keeps at least `tolerance`
    of the reward at `default` (the method's 'breaking point' is the next one)."""
    if default not in means:
        return None
    best = None
    for x in sorted(means):
        if x < default:
            continue
        if not holds(means[x], means[default], tolerance):
            break
        best = x
    return best


def breaking_points(study: Study, sweep: Dict[str, Dict[Any, Setting]], default: Any) -> Dict[str, Optional[float]]:
    reward = final_metric("reward/mean", study.claim_top_p)
    out = {}
    for name, axis in sweep.items():
        means = {x: s.mean for x, s in ((x, study.stat(setting, study.plan.sweep_seeds, reward))
                                        for x, setting in axis.items()) if s is not None}
        out[name] = breaking_point(means, default, study.cfg.sweeps.tolerance)
    return out


def plateau(study: Study) -> Optional[Dict[str, Any]]:
    """Has the best method (highest final held-out reward) stopped improving? The change of its
    rollout reward (mean over seeds) over the last quarter of training, from a least-squares line
    through that quarter, against ``plateau_tolerance``."""
    reward = final_metric("reward/mean", study.claim_top_p)
    means = {name: study.stat(s, study.plan.seeds, reward) for name, s in study.plan.compare.items()}
    means = {n: m.mean for n, m in means.items() if m is not None}
    if not means:
        return None
    best = max(means, key=means.get)
    curve = study.curve(study.plan.compare[best], study.plan.seeds, "reward/mean")
    if curve is None or len(curve[0]) < 8:
        return None
    steps, mean, _ = curve
    tail = slice(len(steps) - len(steps) // 4, len(steps))
    slope = float(np.polyfit(steps[tail], mean[tail], 1)[0])
    change = slope * float(steps[tail][-1] - steps[tail][0])
    return {"method": best, "steps": int(steps[-1]), "last_quarter_change": change,
            "tolerance": study.cfg.plateau_tolerance, "plateaued": abs(change) <= study.cfg.plateau_tolerance}


def comparisons_to_json(comparisons: Sequence[Comparison]) -> List[Dict[str, Any]]:
    out = []
    for c in comparisons:
        test = c.test
        simultaneous = None if c.simultaneous is None else [b if math.isfinite(b) else None for b in c.simultaneous]
        out.append({"label": c.label, "outcome": c.outcome, "p_adjusted": c.p_adjusted, "detail": c.detail,
                    "simultaneous_ci": simultaneous, "tost_p_adjusted": c.tost_p_adjusted,
                    **({"mean": test.mean, "ci95": [test.low, test.high], "p_value": test.p_value, "n": test.n,
                        "differences": test.differences} if isinstance(test, PairedTest) else {})})
    return out


def claims_to_json(claims: Sequence[Claim]) -> List[Dict[str, Any]]:
    return [json.loads(json.dumps({"id": c.id, "statement": c.statement, "verdict": c.verdict, "summary": c.summary,
                                   "note": c.note, "margin": c.margin, "comparisons": comparisons_to_json(c.comparisons)}, default=float))
            for c in claims]
