"""The wall time of a study, estimated from the per-run timings of one that finished (the quick one).

A finished study records each run's wall seconds in ``invocations.jsonl``, the seconds of its
evaluation in its evaluation records (``job_seconds``) and each training step's ``time/step`` in
its training records. Two linear models are fitted by least squares over its runs:

    time/step  = a + b * optimizer steps in the rollout step
    evaluation = c + r * sampled responses (problems x samples x top-p values)

and the overhead of a run (start-up, task generation, checkpoint, report) is the median of its
wall time minus its evaluation and its logged step times. Each run's wall-clock figures are first
scaled by its CPU time / wall time (its process's user + system time, recorded by the runner):
on a machine shared with other work a run waits for the CPU, and the estimate is for a machine
that runs the study alone (each run one single-threaded process, ``workers`` at a time on as many
cores). The target study's runs are then costed from their composed
settings (steps, K, mini-batches, evaluation kind) and divided over its ``workers``, plus the base
model's evaluation, which runs alone. The timings carry the machine and the contention of the
measured study, so measure with the same ``workers`` on the machine the study will run on. A
study that searches its sweeps (``sweeps.search``) is costed with the runs the search would add
given the measured study's results, and every point those results cannot decide. The held-out
checkpoints during training (``checkpoints``) are costed as evaluations of their samples.
``recipes/study.py estimate=true`` measures on the committed full study
(``docs/study_results/full``, 152 runs timed on this 2-core machine).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from quatro_nemo.data.schema import iter_jsonl
from quatro_nemo.study.analysis import EVAL_KIND
from quatro_nemo.study.config import StudyConfig
from quatro_nemo.study.kept import archive_path, read_archive
from quatro_nemo.study.plan import RunSpec, StudyPlan
from quatro_nemo.study.planner import build_plan

INVOCATIONS_FILE = "invocations.jsonl"


def record_invocation(out_dir: str, minutes: float, runs_executed: int,
                      run_seconds: Optional[Dict[str, List[float]]] = None,
                      runs_started: Optional[int] = None, interrupted: bool = False) -> Dict[str, float]:
    """Append this invocation to ``<out>/invocations.jsonl`` (with each executed run's [wall, CPU]
    seconds, for :func:`measured_costs`); returns :func:`invocation_totals`.
    ``runs_started`` (default: ``runs_executed``) counts runs it trained at all, finished or not:
    an interrupted invocation that trained runs costs wall time too."""
    record = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "minutes": round(minutes, 2),
              "runs_executed": runs_executed,
              "runs_started": runs_executed if runs_started is None else runs_started,
              "run_seconds": run_seconds or {}}
    if interrupted:
        record["interrupted"] = True
    os.makedirs(out_dir, exist_ok=True)
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


def _line(x: List[float], y: List[float]) -> Tuple[float, float]:
    """Least-squares intercept and slope (slope 0 and the mean when x does not vary)."""
    x_arr, y_arr = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if np.ptp(x_arr) == 0:
        return float(np.mean(y_arr)), 0.0
    slope, intercept = np.polyfit(x_arr, y_arr, 1)
    return float(intercept), float(slope)


def measured_costs(timed_dir: str) -> Dict[str, float]:
    """The fitted per-step, per-sample and overhead costs (seconds) of a finished study."""
    seconds: Dict[str, List[float]] = {}     # name -> [wall, CPU]
    for _, record in iter_jsonl(f"{timed_dir}/{INVOCATIONS_FILE}"):
        seconds.update(record.get("run_seconds") or {})
    if not seconds:
        raise ValueError(f"{timed_dir}/{INVOCATIONS_FILE} records no per-run timings (a study run by this version "
                         "records them)")
    step_x, step_y, overheads, eval_x, eval_y = [], [], [], [], []
    for name, (wall, cpu) in seconds.items():
        busy = min(1.0, cpu / wall)           # the share of its wall time the run had a CPU
        records = read_archive(archive_path(timed_dir, name))
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == EVAL_KIND]
        step_x += [r["optimizer_steps"] for r in train]
        step_y += [busy * r["time/step"] for r in train]
        evaluate = busy * evals[0]["job_seconds"]["evaluate"]
        overheads.append(cpu - evaluate - sum(busy * r["time/step"] for r in train))
        eval_x.append(sum(r["num_problems"] * r["n_samples"] for r in evals))
        eval_y.append(evaluate)
    a, b = _line(step_x, step_y)
    c, r = _line(eval_x, eval_y)
    return {"step_s": a, "step_s_per_optimizer_step": b, "train_overhead_s": float(np.median(overheads)),
            "eval_s": c, "eval_s_per_sample": r, "runs_measured": len(seconds)}


COMMITTED_TIMINGS = "docs/study_results/full"     # estimate=true: the committed full study's timings


class RunCosts:
    """Each run's seconds on a dedicated core, by the fitted costs (:func:`measured_costs`)."""

    def __init__(self, cfg: StudyConfig, plan: StudyPlan, costs: Dict[str, float]) -> None:
        self.cfg, self.plan, self.costs = cfg, plan, costs
        self.trainer = next(iter(plan.defaults.bases.values())).trainer
        ev = cfg.evaluation
        self.minis = math.ceil(self.trainer.prompts_per_step / (self.trainer.mini_batch_prompts or self.trainer.prompts_per_step))
        self.full_samples = ev.num_problems * ev.n_samples * len(ev.top_p)
        self.light_samples = ev.num_problems * ev.sweep_n_samples if ev.sweep_n_samples else self.full_samples
        # the loop's held-out checkpoints (study config ``checkpoints``): at step 0 and every `every` steps
        ck = cfg.checkpoints
        evaluations = (self.trainer.steps // ck.every + 1) if ck.every else 0
        self.checkpoint_s = evaluations * (costs["eval_s"] + costs["eval_s_per_sample"] * ev.num_problems * ck.n_samples)

    def run_seconds(self, spec: RunSpec) -> float:
        c = self.costs
        optimizer_steps = spec.setting.inner_loops * self.minis
        train_s = c["train_overhead_s"] + self.trainer.steps * (c["step_s"] + c["step_s_per_optimizer_step"] * optimizer_steps)
        samples = self.full_samples if self.plan.needs_full_evaluation(spec) else self.light_samples
        return train_s + c["eval_s"] + c["eval_s_per_sample"] * samples + self.checkpoint_s

    def base_seconds(self) -> float:
        """The base model's evaluation (once per study, alone)."""
        return self.costs["eval_s"] + self.costs["eval_s_per_sample"] * self.full_samples

    def cpu_hours(self, specs: Iterable[RunSpec], base: bool) -> float:
        return (sum(self.run_seconds(spec) for spec in specs) + (self.base_seconds() if base else 0.0)) / 3600.0


def estimate_minutes(cfg: StudyConfig, timed_dir: str) -> Dict[str, Any]:
    """Estimated wall minutes of the study `cfg` from the timings of the finished study in `timed_dir`."""
    costs = measured_costs(timed_dir)
    # A search follows the measured study's results; where it has none, the point is run (upper bound).
    plan = build_plan(cfg, timed_dir, unknown_holds=True)
    model = RunCosts(cfg, plan, costs)
    by_k: Dict[int, List[float]] = {}
    for spec in plan.runs.values():
        by_k.setdefault(spec.setting.inner_loops, []).append(model.run_seconds(spec))
    total_s = sum(sum(v) for v in by_k.values())
    minutes = (total_s / cfg.workers + model.base_seconds()) / 60.0
    return {"study": cfg.name, "runs": len(plan.runs), "steps_per_run": model.trainer.steps, "workers": cfg.workers,
            "estimated_minutes": round(minutes, 1), "budget_minutes": cfg.time_budget_minutes,
            "cpu_hours": round(model.cpu_hours(plan.runs.values(), base=True), 1),   # each run one single-threaded process
            "fits_budget": minutes <= cfg.time_budget_minutes,
            "mean_run_minutes_by_inner_loops": {k: round(float(np.mean(v)) / 60.0, 2) for k, v in sorted(by_k.items())},
            "measured_on": timed_dir, "costs": {k: round(v, 4) for k, v in costs.items()}}
