"""One study end to end: plan -> base-model evaluation -> runs (trained then evaluated, resumable,
a few processes at a time) -> kept metrics -> claims -> report.

The report is built from ``<out>/metrics/`` alone (one gzip JSON-lines file per run: its training
records and its held-out evaluation; ``base.jsonl.gz`` for the base model), so
``recipes/study.py report_only=true`` redoes the analysis without the run directories.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf

from quatro_nemo.data.schema import iter_jsonl
from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.logging import read_metrics
from quatro_nemo.study.analysis import (BASE, EVAL_KIND, Study, advantage_table, archive_path, evaluate_claims,
                                        load_base, load_runs, read_archive, run_from_records,
                                        write_archive)
from quatro_nemo.study.config import QUATRO, StudyConfig
from quatro_nemo.study.evaluation import STUDY_EVAL, evaluate_base
from quatro_nemo.study.adaptive import build_adaptive_plan
from quatro_nemo.study.adaptive_report import write_adaptive_report
from quatro_nemo.study.plan import (Defaults, RewardOf, RunSpec, StudyPlan, build_paper_plan, read_defaults, sweep_line,
                                    sweep_lines, train_args)
from quatro_nemo.study.report import write_study_report
from quatro_nemo.study.runner import RunResult, StudyInterrupted, execute, is_done, is_trained, run_dir


def evaluation_args(cfg: StudyConfig, full: bool) -> List[str]:
    """Arguments of ``python -m quatro_nemo.study.evaluation`` for a run (full: every top-p at
    ``n_samples``; else the first top-p at ``sweep_n_samples``)."""
    ev = cfg.evaluation
    light = not full and ev.sweep_n_samples > 0
    top_ps = ev.top_p[:1] if light else ev.top_p
    return ["--problems", str(ev.num_problems), "--n", str(ev.sweep_n_samples if light else ev.n_samples),
            "--top-p", *(repr(float(p)) for p in top_ps), "--temperature", repr(float(ev.temperature)),
            "--seed", str(ev.seed)]




def ensure_base_evaluation(cfg: StudyConfig, study_dir: str, log: Callable[[str], None] = print) -> None:
    """Evaluate the base model once per study (every run starts from the same warm-start)."""
    path = archive_path(study_dir, BASE)
    if os.path.isfile(path):
        return
    ev = cfg.evaluation
    started = time.time()
    write_archive(path, evaluate_base(train_args(cfg), ev.num_problems, ev.n_samples, ev.top_p, ev.temperature,
                                      ev.seed))
    log(f"[study] base model evaluated in {time.time() - started:.0f} s")


def _loop_evaluation(directory: str) -> List[Dict[str, Any]]:
    """A run trained outside the study (a SLURM sweep): its loop's last held-out record, at the
    run's own eval.top_p, stands in for the study's evaluation."""
    evals = [r for r in read_metrics(os.path.join(directory, "metrics.jsonl")) if r["kind"] == "eval"]
    if not evals:
        return []
    top_p = OmegaConf.load(os.path.join(directory, "config.yaml")).eval.top_p
    return [dict(evals[-1], kind=EVAL_KIND, top_p=float(top_p))]


def archive_runs(run_dirs: Dict[str, str], study_dir: str) -> int:
    """Keep every finished run's metrics in ``<study_dir>/metrics/<name>.jsonl.gz``: its training
    records and its study evaluation records. Returns how many runs are kept."""
    kept = 0
    for name, directory in run_dirs.items():
        if not is_trained(directory):
            continue
        evaluation = os.path.join(directory, STUDY_EVAL)
        evals = ([r for _, r in iter_jsonl(evaluation)] if os.path.isfile(evaluation)
                 else _loop_evaluation(directory))
        if not evals:
            continue
        # training records, and the loop's held-out checkpoints (study config ``checkpoints``)
        train = [r for r in read_metrics(os.path.join(directory, "metrics.jsonl")) if r["kind"] in ("train", "eval")]
        write_archive(archive_path(study_dir, name), train + evals)
        kept += 1
    return kept


def finished_rewards(cfg: StudyConfig, study_dir: str) -> RewardOf:
    """A run's final held-out reward at the claims' top-p (``evaluation.top_p[0]``) from its kept
    metrics (``<study_dir>/metrics``) or its run directory's study evaluation; None while neither
    exists. What the sweeps' search (``plan.searched_points``) judges by."""
    top_p = float(cfg.evaluation.top_p[0])
    known: Dict[str, float] = {}

    def reward_of(spec: RunSpec) -> Optional[float]:
        if spec.name not in known:
            archive, evaluation = archive_path(study_dir, spec.name), os.path.join(run_dir(study_dir, spec.name), STUDY_EVAL)
            records = (read_archive(archive) if os.path.isfile(archive) else
                       [r for _, r in iter_jsonl(evaluation)] if os.path.isfile(evaluation) else [])
            run = run_from_records(spec.name, records)     # None: no study evaluation yet
            final = None if run is None else run.final(top_p)
            if final is None:
                return None
            known[spec.name] = final["reward/mean"]
        return known[spec.name]
    return reward_of


def build_plan(cfg: StudyConfig, results_dir: Optional[str] = None, defaults: Optional[Defaults] = None,
               unknown_holds: bool = False) -> StudyPlan:
    """The study's runs, by its kind: the paper's comparison (``plan.build_paper_plan``) or the
    adaptive-delta study (``adaptive.build_adaptive_plan``). ``results_dir``: the study directory
    whose finished runs a search follows (none: the whole grid); ``unknown_holds``:
    ``plan.searched_points``."""
    if cfg.kind == "adaptive":
        return build_adaptive_plan(cfg, read_defaults(cfg, [QUATRO]))
    rewards = None if results_dir is None else finished_rewards(cfg, results_dir)
    return build_paper_plan(cfg, rewards, defaults, unknown_holds)


def write_report(cfg: StudyConfig, plan: StudyPlan, study_dir: str, out_dir: str,
                 info: Dict[str, Any]) -> Dict[str, Any]:
    """Load the kept metrics of ``study_dir``, test the claims, write report.md / report.json / PNGs."""
    if cfg.kind == "adaptive":
        return write_adaptive_report(cfg, plan, study_dir, out_dir, info)
    study = Study(cfg, plan, load_runs(study_dir, list(plan.runs)), load_base(study_dir))
    quatro = plan.defaults.algorithm_fields[QUATRO]
    n = load_config(train_args(cfg)).rollout.n
    deltas = sorted(set(cfg.deltas.values) | {quatro["delta"]})
    advantages = advantage_table(deltas, n, quatro["lambda_min"])
    claims = evaluate_claims(study, advantages)
    info = dict(info, scale_note=cfg.description or None)
    paths = write_study_report(study, claims, advantages, out_dir, info)
    return {"paths": paths, "claims": claims, "study": study}


INVOCATIONS_FILE = "invocations.jsonl"


def record_invocation(out_dir: str, minutes: float, runs_executed: int,
                      run_seconds: Optional[Dict[str, List[float]]] = None,
                      runs_started: Optional[int] = None, interrupted: bool = False) -> Dict[str, float]:
    """Append this invocation to ``<out>/invocations.jsonl`` (with each executed run's [wall, CPU]
    seconds, for :mod:`quatro_nemo.study.timing`); returns :func:`invocation_totals`.
    ``runs_started`` (default: ``runs_executed``) counts runs it trained at all, finished or not:
    an interrupted invocation that trained runs costs wall time too."""
    record = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "minutes": round(minutes, 2),
              "runs_executed": runs_executed,
              "runs_started": runs_executed if runs_started is None else runs_started,
              "run_seconds": run_seconds or {}}
    if interrupted:
        record["interrupted"] = True
    with open(os.path.join(out_dir, INVOCATIONS_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return invocation_totals(out_dir)


def invocation_totals(out_dir: str) -> Dict[str, float]:
    """Total wall time of the invocations that trained runs, so a study finished over several
    (interrupted, extended with more seeds) reports its whole cost against the budget; {} if
    none is recorded."""
    path = os.path.join(out_dir, INVOCATIONS_FILE)
    if not os.path.exists(path):
        return {}
    training = [r for _, r in iter_jsonl(path) if r.get("runs_started", r["runs_executed"]) > 0]
    return {"total_wall_minutes": sum(r["minutes"] for r in training), "training_invocations": len(training)}


def run_study(cfg: StudyConfig, out_dir: str, log: Callable[[str], None] = print) -> Dict[str, Any]:
    started = time.time()
    # Absolute: the trainings run with the repository as working directory (runner.execute).
    out_dir = os.path.abspath(out_dir)
    plan = build_plan(cfg, out_dir)
    base = train_args(cfg)
    pending = [s for s in plan.runs.values() if not is_done(run_dir(out_dir, s.name))]
    log(f"[study] {cfg.name}: {len(plan.runs)} runs, {len(plan.runs) - len(pending)} already done; "
        f"output {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    # The warm-start cache is built once, here by the base evaluation or else by the fork server's
    # preload (execute(preload=True)), before any run is forked: never by concurrent runs.
    ensure_base_evaluation(cfg, out_dir, log)
    runs = start_order(cfg, plan)
    try:
        results = execute(runs, out_dir, base, cfg.workers, log=log, preload=True,
                          evaluation_args=lambda spec: evaluation_args(cfg, plan.needs_full_evaluation(spec)),
                          refill=lambda: list(build_plan(cfg, out_dir, plan.defaults).runs.values()))
    except StudyInterrupted as stop:
        totals = record_invocation(out_dir, (time.time() - started) / 60.0, _count_done(stop.results),
                                   _run_seconds(stop.results), runs_started=stop.runs_started, interrupted=True)
        log(f"[study] interrupted; {totals.get('total_wall_minutes', 0):.1f} min so far over "
            f"{totals.get('training_invocations', 0)} invocation(s); run the same command to continue")
        raise
    failed = [r.name for r in results if r.status == "failed"]
    info = {"wall_minutes": (time.time() - started) / 60.0, "failed_runs": failed,
            "runs_executed": _count_done(results),
            "runs_skipped": sum(r.status == "skipped" for r in results)}
    info.update(record_invocation(out_dir, info["wall_minutes"], info["runs_executed"], _run_seconds(results)))
    plan = build_plan(cfg, out_dir, plan.defaults)   # every search decision made
    archive_runs({name: run_dir(out_dir, name) for name in plan.runs}, out_dir)
    out = write_report(cfg, plan, out_dir, out_dir, info)
    minutes, total = info["wall_minutes"], info["total_wall_minutes"]
    log(f"[study] report: {out['paths']['markdown']} ({minutes:.1f} min"
        + (f"; {total:.1f} min over {info['training_invocations']} invocations" if info["training_invocations"] > 1 else "")
        + (f", OVER the {cfg.time_budget_minutes:g} min budget" if total > cfg.time_budget_minutes else "")
        + (f"; {len(failed)} failed run(s): {failed}" if failed else "") + ")")
    out["info"] = info
    return out


def start_order(cfg: StudyConfig, plan: StudyPlan) -> List[RunSpec]:
    """The runs in the order they start, by claim priority, seed-major, so that a study stopped
    at any point has decided what matters first and every method of a family has the same seeds:

    1. the primary family (QUATRO and ``primary_baselines`` at the default; every compared method
       when there is no primary family): seed 1 of each, then seed 2, ...;
    2. the secondary family (the other compared methods), seed-major;
    3. the stress points (every method and arm of every point), seed-major;
    4. the rest (sweeps, ablation, deltas, an adaptive study's arms), seed-major, the sweeps'
       default runs first within a seed (a search adds a method's next points only once they are
       done) and heavier runs (more inner loops) before lighter ones.

    A run in two parts takes its earlier place. Runs a search adds later start before the
    remaining ones (runner.execute)."""
    primary = {QUATRO, *cfg.primary_baselines} if cfg.primary_baselines else set(plan.compare)
    tiers: Dict[str, tuple] = {}        # run name -> (tier, seed, place in the tier's method order)

    def rank(tier: int, settings: List, seeds: List[int]) -> None:
        for place, setting in enumerate(settings):
            for spec in plan.runs_of(setting, seeds):
                tiers[spec.name] = min(tiers.get(spec.name, (tier, spec.seed, place)), (tier, spec.seed, place))

    rank(0, [s for a, s in plan.compare.items() if a in primary], plan.seeds)
    rank(1, [s for a, s in plan.compare.items() if a not in primary], plan.seeds)
    rank(2, [s for point in plan.stress.values() for s in point.values()], plan.stress_seeds)
    sweep_defaults = {axis[x] for sweep, x in ((plan.sweep_inner, 1), (plan.sweep_lr, 1.0))
                      for axis in sweep.values() if x in axis}

    def key(spec: RunSpec) -> tuple:
        if spec.name in tiers:
            return tiers[spec.name]
        return (3, spec.seed, (spec.setting not in sweep_defaults, -spec.setting.inner_loops))
    return sorted(plan.runs.values(), key=key)     # stable: plan order within equal keys


def _count_done(results: List[RunResult]) -> int:
    return sum(r.status == "done" for r in results)


def _run_seconds(results: List[RunResult]) -> Dict[str, List[float]]:
    """Each run executed to the end: [wall, CPU] seconds (the timing model's input)."""
    return {r.name: [round(r.seconds, 2), round(r.cpu_seconds, 2)] for r in results if r.status == "done"}


def emit_sweep(cfg: StudyConfig, path: str) -> int:
    """Write the SLURM sweep file (slurm/sweep.sh format); returns the number of runs."""
    plan = build_plan(cfg)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(sweep_lines(cfg, plan)) + "\n")
    return len(plan.runs)


def collect_sweep(cfg: StudyConfig, sweep_dir: str, out_dir: str) -> Dict[str, Any]:
    """Report on a SLURM sweep submitted from `emit_sweep`'s file: sweep.sh records each task's
    override set in <sweep_dir>/tasks.tsv and runs it in <sweep_dir>/task-<i>."""
    plan = build_plan(cfg)
    by_line = {sweep_line(cfg, spec): name for name, spec in plan.runs.items()}
    tasks = os.path.join(sweep_dir, "tasks.tsv")
    if not os.path.isfile(tasks):
        raise FileNotFoundError(f"{tasks} not found: is {sweep_dir} a directory written by slurm/sweep.sh?")
    run_dirs = {}
    with open(tasks) as f:
        for line in f:
            task, _, overrides = line.rstrip("\n").partition("\t")
            name = by_line.get(overrides.strip())
            if name is not None:
                run_dirs[name] = os.path.join(sweep_dir, task)
    archive_runs(run_dirs, out_dir)
    return write_report(cfg, build_plan(cfg, out_dir, plan.defaults), out_dir, out_dir, {"collected_from": sweep_dir})
