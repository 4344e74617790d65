"""Evaluate sample sets (one per run/method) into the paper's tables (paper Sec. 4, App. C).

    from quatro_nemo.eval.report import MetricsConfig, evaluate_runs, write_report
    report = evaluate_runs({"grpo": grpo_samples, "quatro": quatro_samples},
                           MetricsConfig(base_run="base"), verifier="math")
    write_report(report, "out/")       # report.md, metrics.csv, report.json, *.png

Per problem: n samples, c correct; Pass@k (unbiased, :func:`quatro_nemo.eval.passk.pass_at_k`);
the correct responses clustered into near-duplicates (:func:`cluster_near_duplicates`) for UCC@k
and UCR; the mean pairwise similarity among correct responses under each metric; the token
entropy when the samples carry it. Per benchmark: the mean over its problems. "average": the
mean over benchmarks (the paper's Tab. 1 and 3 average the six benchmarks, not the problems).
Flip rates compare every run to ``base_run`` on the problems both evaluated (App. C.7).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from quatro_nemo.eval.entropy import ratio_of_sums, token_sum_and_count
from quatro_nemo.eval.flip import DEFAULT_BUCKET_EDGES, flip_rate_by_bucket, overall_flip_rate
from quatro_nemo.eval.passk import pass_at_k, power_of_two_ks, ucc_at_k, unique_correct_ratio
from quatro_nemo.eval.plots import write_plots
from quatro_nemo.eval.similarity import (DEFAULT_THRESHOLDS, SIMILARITY_METRICS, cluster_near_duplicates,
                                         mean_pairwise_similarity, pairwise_similarity)
from quatro_nemo.eval.tables import AVERAGE, write_tables
from quatro_nemo.validation import ConfigError, choices, coerce_choices

PRECOMPUTED = "precomputed"
# MetricsConfig.ucc_metric: a near-duplicate metric of quatro_nemo.eval.similarity, or "precomputed"
UccMetric = choices("UccMetric", (*SIMILARITY_METRICS, PRECOMPUTED), __name__)
DEFAULT_PAIRWISE_METRICS = ("tfidf", "rouge_l", "jaccard", "edit")   # paper App. C.5


@dataclasses.dataclass
class MetricsConfig:
    """What :func:`evaluate_runs` computes from samples files (recipes/evaluate.py's metric keys;
    a run's own held-out evaluation is its ``eval:`` section, quatro_nemo.engine.config.EvalConfig).
    Validated on construction (ConfigError naming the field)."""

    ks: Optional[List[int]] = None              # Pass@k grid; None: 1, 2, 4, ..., n
    ucc_ks: Optional[List[int]] = None          # UCC@k grid; None: same as ks
    ucc_metric: UccMetric = UccMetric("rouge_l")  # near-duplicate criterion for UCC@k / UCR, or
                                                # "precomputed": each record's "cluster_sizes"
                                                # (e.g. a task's canonical solution forms)
    ucc_threshold: Optional[float] = None       # None: DEFAULT_THRESHOLDS[ucc_metric]
    pairwise_metrics: Tuple[str, ...] = DEFAULT_PAIRWISE_METRICS
    max_pairwise_responses: int = 32            # correct responses per problem in the pairwise
                                                # means (a seeded random subset when more)
    correct_threshold: float = 1.0              # a reward >= this counts as correct
    base_run: Optional[str] = None              # run that defines the flip-rate buckets
    bucket_edges: Tuple[int, ...] = DEFAULT_BUCKET_EDGES
    regrade: bool = False                       # ignore precomputed "rewards" in the samples
    workers: int = 1                            # threads for rapidfuzz similarity matrices
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("ks", "ucc_ks"):
            value = getattr(self, name)
            if value is not None and (not value or any(int(k) < 1 for k in value)):
                raise ConfigError(f"MetricsConfig.{name} must be a non-empty list of k >= 1, got {value}")
        coerce_choices(self, "MetricsConfig")
        for value in self.pairwise_metrics:
            if value not in SIMILARITY_METRICS:
                raise ConfigError(f"MetricsConfig.pairwise_metrics: unknown similarity {value!r}; "
                                  f"choose from {sorted(SIMILARITY_METRICS)}")
        if self.ucc_threshold is None:
            self.ucc_threshold = DEFAULT_THRESHOLDS.get(self.ucc_metric, 1.0)
        if not 0.0 <= self.ucc_threshold <= 1.0:
            raise ConfigError(f"MetricsConfig.ucc_threshold must be in [0, 1], got {self.ucc_threshold}")
        if self.max_pairwise_responses < 2:
            raise ConfigError(f"MetricsConfig.max_pairwise_responses must be >= 2, got {self.max_pairwise_responses}")
        if not 0.0 < self.correct_threshold <= 1.0:
            raise ConfigError(f"MetricsConfig.correct_threshold must be in (0, 1], got {self.correct_threshold}")
        if self.workers < 1:
            raise ConfigError(f"MetricsConfig.workers must be >= 1, got {self.workers}")
        self.pairwise_metrics = tuple(self.pairwise_metrics)
        self.bucket_edges = tuple(self.bucket_edges)


# ---------------------------------------------------------------------------------------------
# grading


def grade_samples(records: Sequence[Dict[str, Any]], verifier: Any) -> Tuple[List[List[float]], List[Dict[str, int]]]:
    """Rewards [problem][response] from `verifier` in one batched call, and per-problem counts of
    grading statuses (a verifier with ``grade_batch``, like the math one, reports timeouts,
    errors and missing answers; others give empty counts)."""
    problems, responses = [], []
    for record in records:
        problems.extend([record] * len(record["responses"]))
        responses.extend(record["responses"])
    if hasattr(verifier, "grade_batch"):
        grades = verifier.grade_batch(problems, responses)
        flat, flat_status = [g.score for g in grades], [g.status for g in grades]
    else:
        flat, flat_status = list(verifier.score_batch(problems, responses)), None
    rewards, statuses, start = [], [], 0
    for record in records:
        end = start + len(record["responses"])
        rewards.append(flat[start:end])
        counts: Dict[str, int] = {}
        for status in (flat_status[start:end] if flat_status is not None else ()):
            counts[status] = counts.get(status, 0) + 1
        statuses.append(counts)
        start = end
    return rewards, statuses


# ---------------------------------------------------------------------------------------------
# per problem


def evaluate_problem(responses: Sequence[str], rewards: Sequence[float], config: MetricsConfig,
                     ks: Sequence[int], ucc_ks: Sequence[int], rng: np.random.Generator,
                     cluster_sizes: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Metrics of one problem (n responses and their rewards; `cluster_sizes` when precomputed)."""
    n = len(responses)
    correct = [r for r, reward in zip(responses, rewards) if reward >= config.correct_threshold]
    c = len(correct)
    if config.ucc_metric == PRECOMPUTED:
        clusters = sorted((int(m) for m in cluster_sizes), reverse=True)
        if sum(clusters) != c:
            raise ValueError(f"precomputed cluster_sizes sum to {sum(clusters)}, but {c} responses are correct")
    else:
        clusters = cluster_near_duplicates(correct, config.ucc_metric, config.ucc_threshold, workers=config.workers)
    out: Dict[str, Any] = {
        "n": n, "num_correct": c, "num_clusters": len(clusters), "cluster_sizes": clusters,
        "pass@k": {k: float(pass_at_k(n, c, k)) if k <= n else math.nan for k in ks},
        "ucc@k": {k: ucc_at_k(n, clusters, k) if k <= n else math.nan for k in ucc_ks},
        "ucr": unique_correct_ratio(n, len(clusters)),
        "similarity": {},
    }
    if config.pairwise_metrics and c >= 2:
        subset = correct
        if c > config.max_pairwise_responses:
            idx = np.sort(rng.choice(c, size=config.max_pairwise_responses, replace=False))
            subset = [correct[i] for i in idx]
        for metric in config.pairwise_metrics:
            sim = pairwise_similarity(subset, metric, workers=config.workers)
            out["similarity"][metric] = mean_pairwise_similarity(sim)
    return out


# ---------------------------------------------------------------------------------------------
# runs


def _mean(values: Sequence[float]) -> float:
    """Mean ignoring NaN (e.g. similarity of problems with < 2 correct); NaN if nothing left."""
    arr = np.asarray([v for v in values if not (isinstance(v, float) and math.isnan(v))], dtype=np.float64)
    return float(arr.mean()) if arr.size else math.nan


def _summarise(problem_metrics: List[Dict[str, Any]], ks: Sequence[int], ucc_ks: Sequence[int],
               pairwise_metrics: Sequence[str]) -> Dict[str, Any]:
    """Mean over problems (Pass@k / UCC@k cells stay NaN if any problem has fewer than k samples)."""
    return {
        "num_problems": len(problem_metrics),
        "n": int(min(p["n"] for p in problem_metrics)),
        "accuracy": float(np.mean([p["num_correct"] / p["n"] for p in problem_metrics])),
        "pass@k": {k: float(np.mean([p["pass@k"][k] for p in problem_metrics])) for k in ks},
        "ucc@k": {k: float(np.mean([p["ucc@k"][k] for p in problem_metrics])) for k in ucc_ks},
        "ucr": float(np.mean([p["ucr"] for p in problem_metrics])),
        "similarity": {m: _mean([p["similarity"].get(m, math.nan) for p in problem_metrics])
                       for m in pairwise_metrics},
    }


def _average_over_benchmarks(per_benchmark: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    rows = list(per_benchmark.values())
    avg: Dict[str, Any] = {"num_problems": int(sum(r["num_problems"] for r in rows)),
                           "n": int(min(r["n"] for r in rows))}
    for key in ("accuracy", "ucr", "entropy", "nll"):
        avg[key] = _mean([r.get(key, math.nan) for r in rows])
    for key in ("pass@k", "ucc@k", "similarity"):
        avg[key] = {sub: _mean([r[key][sub] for r in rows]) for sub in rows[0][key]}
    avg["grading"] = {}
    for r in rows:
        for status, count in r["grading"].items():
            avg["grading"][status] = avg["grading"].get(status, 0) + count
    return avg


def evaluate_run(records: Sequence[Dict[str, Any]], config: MetricsConfig, verifier: Any = None) -> Dict[str, Any]:
    """Per-benchmark and averaged metrics of one run's samples, plus per-problem details."""
    to_grade = [i for i, r in enumerate(records) if config.regrade or r.get("rewards") is None]
    rewards = [r.get("rewards") for r in records]
    statuses_by_problem: List[Dict[str, int]] = [{} for _ in records]
    if to_grade:
        if verifier is None:
            raise ValueError("samples carry no 'rewards' (or regrade=True): a verifier is needed")
        graded, statuses = grade_samples([records[i] for i in to_grade], verifier)
        for i, reward, status in zip(to_grade, graded, statuses):
            rewards[i], statuses_by_problem[i] = reward, status

    max_n = max(len(r["responses"]) for r in records)
    ks = list(config.ks) if config.ks is not None else power_of_two_ks(max_n)
    ucc_ks = list(config.ucc_ks) if config.ucc_ks is not None else ks
    rng = np.random.default_rng(config.seed)
    problems = []
    for record, reward, statuses in zip(records, rewards, statuses_by_problem):
        if config.ucc_metric == PRECOMPUTED and record.get("cluster_sizes") is None:
            raise ValueError(f"ucc_metric='precomputed' but problem {record['id']!r} "
                             f"({record['benchmark']}) has no 'cluster_sizes'")
        try:
            metrics = evaluate_problem(record["responses"], reward, config, ks, ucc_ks, rng,
                                       record.get("cluster_sizes"))
        except ValueError as err:
            raise ValueError(f"problem {record['id']!r} ({record['benchmark']}): {err}") from err
        metrics.update(id=str(record["id"]), benchmark=record["benchmark"], grading=statuses)
        for key in ("entropies", "logprobs"):       # (sum, count) over tokens, additive
            if record.get(key) is not None:
                metrics[key + "_sum_count"] = token_sum_and_count(record[key])
        problems.append(metrics)

    benchmarks: Dict[str, Dict[str, Any]] = {}
    for name in sorted({p["benchmark"] for p in problems}):
        members = [p for p in problems if p["benchmark"] == name]
        summary = _summarise(members, ks, ucc_ks, config.pairwise_metrics)
        # token-weighted over all generated tokens of the benchmark (entropy.py): the exact
        # full-vocabulary entropy, and -mean log p(sampled token), its Monte-Carlo estimate
        summary["entropy"] = ratio_of_sums(p["entropies_sum_count"] for p in members if "entropies_sum_count" in p)
        summary["nll"] = -ratio_of_sums(p["logprobs_sum_count"] for p in members if "logprobs_sum_count" in p)
        summary["grading"] = {}
        for p in members:
            for status, count in p["grading"].items():
                summary["grading"][status] = summary["grading"].get(status, 0) + count
        benchmarks[name] = summary
    return {"benchmarks": benchmarks, AVERAGE: _average_over_benchmarks(benchmarks), "problems": problems,
            "ks": ks, "ucc_ks": ucc_ks}


def evaluate_runs(runs: Dict[str, Sequence[Dict[str, Any]]], config: Optional[MetricsConfig] = None,
                  verifier: Any = "math", verifier_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Evaluate several runs side by side; the entry point of recipes/evaluate.py and of the
    training loop's final report.

    Args:
        runs: run name -> list of sample records (see quatro_nemo.eval.samples).
        config: what to compute (MetricsConfig()).
        verifier: a verifier object, or a name for ``quatro_nemo.rewards.get_verifier``; only built
            when some record has no precomputed rewards.
    Returns:
        a JSON-able dict: {"config", "runs": {name: evaluate_run(...)}, "flip": {name: ...}}.
    """
    config = config or MetricsConfig()
    if not runs:
        raise ValueError("evaluate_runs needs at least one run")
    if config.base_run is not None and config.base_run not in runs:
        raise ValueError(f"MetricsConfig.base_run {config.base_run!r} is not one of the runs {sorted(runs)}")
    needs_verifier = any(config.regrade or r.get("rewards") is None for recs in runs.values() for r in recs)
    owned = None
    if needs_verifier and isinstance(verifier, str):
        from quatro_nemo.rewards import get_verifier

        verifier = owned = get_verifier(verifier, **(verifier_kwargs or {}))
    try:
        results = {name: evaluate_run(records, config, verifier) for name, records in runs.items()}
    finally:
        if owned is not None and hasattr(owned, "close"):
            owned.close()
    report = {"config": dataclasses.asdict(config), "runs": results, "flip": {}}
    if config.base_run is not None:
        base = {(p["benchmark"], p["id"]): p for p in results[config.base_run]["problems"]}
        for name, result in results.items():
            if name == config.base_run:
                continue
            pairs = [(base[(p["benchmark"], p["id"])], p) for p in result["problems"]
                     if (p["benchmark"], p["id"]) in base]
            if not pairs:
                raise ValueError(f"run {name!r} shares no problem (benchmark, id) with base run {config.base_run!r}")
            buckets = flip_rate_by_bucket([b["num_correct"] for b, _ in pairs], [b["n"] for b, _ in pairs],
                                          [t["num_correct"] for _, t in pairs], [t["n"] for _, t in pairs],
                                          config.bucket_edges)
            report["flip"][name] = {
                "num_problems": len(pairs),
                "flip_rate": overall_flip_rate([b["num_correct"] for b, _ in pairs], [t["num_correct"] for _, t in pairs]),
                "buckets": [dataclasses.asdict(b) for b in buckets],
            }
    return report


def write_report(report: Dict[str, Any], out_dir: str, plots: bool = True) -> Dict[str, str]:
    """Tables (report.md, metrics.csv, report.json) and, if `plots`, PNG figures in `out_dir`."""
    paths = write_tables(report, out_dir)
    if plots:
        paths.update(write_plots(report, out_dir))
    return paths
