"""One study end to end: plan -> base-model evaluation -> runs (engine requests, trained then
evaluated, resumable, a few processes at a time, each run's metrics kept as it finishes) ->
claims -> report.

The report is built from ``<out>/metrics/`` alone (one gzip JSON-lines file per run:
quatro_nemo.study.kept; ``base.jsonl.gz`` for the base model), so ``recipes/study.py
report_only=true`` redoes the analysis without the run directories. A run kept in the committed
results (``results``: docs/study_results/<name>) with the same identity is done on any machine;
with ``publish`` every run kept here is copied there as it finishes (quatro_nemo.study.results).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from quatro_nemo.engine.api import config_identity, identity_record
from quatro_nemo.engine.run_dir import RunDir
from quatro_nemo.study.adaptive_report import write_adaptive_report
from quatro_nemo.study.analysis import EVAL_KIND, Study, advantage_table, evaluate_claims, load_base, load_runs
from quatro_nemo.study.config import QUATRO, StudyConfig
from quatro_nemo.study.forkserver import encode_call
from quatro_nemo.study.job import preload
from quatro_nemo.study.kept import keep_run
from quatro_nemo.study.plan import RunSpec, StudyPlan, sweep_line, sweep_lines
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.report import write_study_report
from quatro_nemo.study.results import StudyRuns
from quatro_nemo.study.runner import RunResult, StudyInterrupted, execute
from quatro_nemo.study.timing import record_invocation


def _loop_evaluation(directory: RunDir) -> List[Dict[str, Any]]:
    """A run trained outside the study (a SLURM sweep): its loop's last held-out record, at the
    run's own eval.top_p, stands in for the study's evaluation."""
    evals = [r for r in directory.metrics() if r["kind"] == "eval"]
    if not evals:
        return []
    return [dict(evals[-1], kind=EVAL_KIND, top_p=float(directory.saved_config().eval.top_p))]


def keep_collected(run_dirs: Dict[str, str], study_dir: str) -> int:
    """Keep every trained run of a SLURM sweep in ``<study_dir>/metrics/<name>.jsonl.gz``, with
    the identity of its own config (not evaluated by the study); returns how many are kept."""
    kept = 0
    for name, path in run_dirs.items():
        directory = RunDir(path)
        if not directory.is_trained():
            continue
        evals = directory.evaluation() or _loop_evaluation(directory)
        if evals:
            identity = identity_record({"config": config_identity(directory.saved_config()), "evaluation": None})
            keep_run(study_dir, name, identity, directory, evals)
            kept += 1
    return kept


def write_report(cfg: StudyConfig, plan: StudyPlan, study_dir: str, out_dir: str,
                 info: Dict[str, Any]) -> Dict[str, Any]:
    """Load the kept metrics of ``study_dir``, test the claims, write report.md / report.json / PNGs."""
    if cfg.kind == "adaptive":
        return write_adaptive_report(cfg, plan, study_dir, out_dir, info)
    study = Study(cfg, plan, load_runs(study_dir, list(plan.runs)), load_base(study_dir))
    quatro = plan.defaults.algorithm_fields[QUATRO]
    n = plan.defaults.bases[QUATRO].rollout.n
    deltas = sorted(set(cfg.deltas.values) | {quatro["delta"]})
    advantages = advantage_table(deltas, n, quatro["lambda_min"])
    claims = evaluate_claims(study, advantages)
    info = dict(info, scale_note=cfg.description or None)
    paths = write_study_report(study, claims, advantages, out_dir, info)
    return {"paths": paths, "claims": claims, "study": study}


def _record_invocation(study: StudyRuns, minutes: float, results: List[RunResult], **extra: Any) -> Dict[str, float]:
    """This invocation in ``<out>/invocations.jsonl`` (and the results' when publishing); the totals."""
    args = (minutes, _count_done(results), _run_seconds(results))
    if study.publish_results and study.results_dir:
        record_invocation(study.results_dir, *args, **extra)
    return record_invocation(study.out_dir, *args, **extra)


def run_study(cfg: StudyConfig, out_dir: str, log: Callable[[str], None] = print, results_dir: Optional[str] = None,
              publish: bool = False) -> Dict[str, Any]:
    """Train and evaluate every run not yet done, then write the report. ``results_dir``: a
    committed results directory whose kept runs count as done; ``publish``: copy each run kept
    here into it (module docstring)."""
    started = time.time()
    # Absolute: the trainings run with the repository as working directory (runner.execute).
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    study = StudyRuns(cfg, build_plan(cfg, out_dir), out_dir, results_dir, publish, log)
    plan = study.adopt_committed()
    log(f"[study] {cfg.name}: {len(plan.runs)} runs, {len(study.done)} already done; output {out_dir}"
        + (f"; kept runs published to {results_dir}" if publish and results_dir else ""))
    # The warm-start cache is built once, here by the base evaluation or else by the fork server's
    # preload, before any run is forked: never by concurrent runs.
    study.ensure_base_evaluation()
    study.write_progress("running")
    base = next(iter(plan.defaults.bases.values()))
    try:
        results = execute(start_order(cfg, plan), out_dir, study, cfg.workers, log=log,
                          preload=encode_call(preload, base), refill=study.refill)
    except StudyInterrupted as stop:
        totals = _record_invocation(study, (time.time() - started) / 60.0, stop.results,
                                    runs_started=stop.runs_started, interrupted=True)
        progress = study.write_progress("stopped")
        log(f"[study] interrupted; {progress['runs_done']}/{progress['runs_total']} runs done, "
            f"{progress['cpu_hours_left']} CPU hours left by the estimate; {totals.get('total_wall_minutes', 0):.1f} "
            f"min so far over {totals.get('training_invocations', 0)} invocation(s); run the same command to continue")
        raise
    failed = [r.name for r in results if r.status == "failed"]
    info = {"wall_minutes": (time.time() - started) / 60.0, "failed_runs": failed,
            "runs_executed": _count_done(results),
            "runs_skipped": sum(r.status == "skipped" for r in results)}
    info.update(_record_invocation(study, info["wall_minutes"], results))
    plan = build_plan(cfg, out_dir, plan.defaults)   # every search decision made
    out = write_report(cfg, plan, out_dir, out_dir, info)
    study.write_progress("finished")
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
    keep_collected(run_dirs, out_dir)
    return write_report(cfg, build_plan(cfg, out_dir, plan.defaults), out_dir, out_dir, {"collected_from": sweep_dir})
