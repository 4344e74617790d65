"""One study end to end: plan -> runs (resumable, a few processes at a time) -> claims -> report."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict

from quatro_nemo.data.schema import iter_jsonl
from quatro_nemo.engine.config import load_config
from quatro_nemo.study.analysis import Study, advantage_table, evaluate_claims, load_runs
from quatro_nemo.study.config import QUATRO, StudyConfig
from quatro_nemo.study.plan import StudyPlan, build_plan, sweep_line, sweep_lines, train_args
from quatro_nemo.study.report import write_study_report
from quatro_nemo.study.runner import execute, is_done, prewarm, run_dir


def write_report(cfg: StudyConfig, plan: StudyPlan, run_dirs: Dict[str, str], out_dir: str,
                 info: Dict[str, Any]) -> Dict[str, Any]:
    """Load the finished runs, test the claims, write report.md / report.json / PNGs."""
    study = Study(cfg, plan, load_runs(run_dirs))
    quatro = plan.defaults.algorithm_fields[QUATRO]
    n = load_config(train_args(cfg)).rollout.n
    deltas = sorted(set(cfg.deltas.values) | {quatro["delta"]})
    advantages = advantage_table(deltas, n, quatro["lambda_min"])
    claims = evaluate_claims(study, advantages)
    info = dict(info, scale_note=cfg.description or None)
    paths = write_study_report(study, claims, advantages, out_dir, info)
    return {"paths": paths, "claims": claims, "study": study}


INVOCATIONS_FILE = "invocations.jsonl"


def record_invocation(out_dir: str, minutes: float, runs_executed: int) -> Dict[str, float]:
    """Append this invocation to ``<out>/invocations.jsonl``; returns :func:`invocation_totals`."""
    with open(os.path.join(out_dir, INVOCATIONS_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps({"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "minutes": round(minutes, 2),
                            "runs_executed": runs_executed}) + "\n")
    return invocation_totals(out_dir)


def invocation_totals(out_dir: str) -> Dict[str, float]:
    """Total wall time of the invocations that trained runs, so a study finished over several
    (interrupted, extended with more seeds) reports its whole cost against the budget; {} if
    none is recorded."""
    path = os.path.join(out_dir, INVOCATIONS_FILE)
    if not os.path.exists(path):
        return {}
    training = [r for _, r in iter_jsonl(path) if r["runs_executed"] > 0]
    return {"total_wall_minutes": sum(r["minutes"] for r in training), "training_invocations": len(training)}


def run_study(cfg: StudyConfig, out_dir: str, log: Callable[[str], None] = print) -> Dict[str, Any]:
    started = time.time()
    # Absolute: the trainings run with the repository as working directory (runner.execute).
    out_dir = os.path.abspath(out_dir)
    plan = build_plan(cfg)
    base = train_args(cfg)
    pending = [s for s in plan.runs.values() if not is_done(run_dir(out_dir, s.name))]
    log(f"[study] {cfg.name}: {len(plan.runs)} runs, {len(plan.runs) - len(pending)} already done; "
        f"output {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    if len(pending) > 1:
        prewarm(base)   # the warm-start cache once, not in every concurrent run
    results = execute(list(plan.runs.values()), out_dir, base, cfg.workers, log=log)
    failed = [r.name for r in results if r.status == "failed"]
    info = {"wall_minutes": (time.time() - started) / 60.0, "failed_runs": failed,
            "runs_executed": sum(r.status == "done" for r in results),
            "runs_skipped": sum(r.status == "skipped" for r in results)}
    info.update(record_invocation(out_dir, info["wall_minutes"], info["runs_executed"]))
    out = write_report(cfg, plan, {name: run_dir(out_dir, name) for name in plan.runs}, out_dir, info)
    minutes, total = info["wall_minutes"], info["total_wall_minutes"]
    log(f"[study] report: {out['paths']['markdown']} ({minutes:.1f} min"
        + (f"; {total:.1f} min over {info['training_invocations']} invocations" if info["training_invocations"] > 1 else "")
        + (f", OVER the {cfg.time_budget_minutes:g} min budget" if total > cfg.time_budget_minutes else "")
        + (f"; {len(failed)} failed run(s): {failed}" if failed else "") + ")")
    out["info"] = info
    return out


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
    return write_report(cfg, plan, run_dirs, out_dir, {"collected_from": sweep_dir})
