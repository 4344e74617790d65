"""A study's runs as engine requests, and where their results go: which runs are done, keeping
each run's metrics as it finishes, the committed results, and the progress file.

- A run's request (:meth:`StudyRuns.request`): its algorithm's base config with the run's values
  (``plan.run_config``), in ``<out>/runs/<name>``, with the study's evaluation of its final policy
  (``evaluation``: every top-p at ``n_samples`` for the runs read at every k, else the first top-p
  at ``sweep_n_samples``).
- Done (:meth:`StudyRuns.is_done`): its kept metrics (``<out>/metrics/<name>.jsonl.gz``) carry the
  request's identity (quatro_nemo.study.kept); or a committed results directory's do (``results``,
  e.g. docs/study_results/<name>: they are copied in, :func:`quatro_nemo.study.kept.adopt`); or its
  run directory holds the request's finished, evaluated run (kept now).
- ``publish``: each run kept, the base model's evaluation and each invocation's record are copied
  into ``results`` as they land, to be committed (nothing here commits).
- ``<out>/progress.json``: runs done of the total, failed and stopped runs, and the CPU hours left by
  the estimate (quatro_nemo.study.timing, from the committed full study's timings, on a dedicated
  core), rewritten whenever a run ends.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, List, Optional, Set

from quatro_nemo.engine.api import RunRequest, preflight
from quatro_nemo.engine.heldout import EvalRequest, evaluate_base
from quatro_nemo.engine.run_dir import RunDir
from quatro_nemo.study.config import StudyConfig
from quatro_nemo.study.kept import (BASE, METRICS_DIR, adopt, archive_path, is_kept, keep, keep_run, kept_identity, publish,
                                    read_archive)
from quatro_nemo.study.plan import RunSpec, StudyPlan, run_config, study_base_config
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.runner import REPO, RunResult, run_dir
from quatro_nemo.study.timing import COMMITTED_TIMINGS, RunCosts, measured_costs

PROGRESS_FILE = "progress.json"


def eval_request(cfg: StudyConfig, full: bool) -> EvalRequest:
    """The study's evaluation of a final policy (full: every top-p at ``n_samples``; else the first
    top-p at ``sweep_n_samples``)."""
    ev = cfg.evaluation
    light = not full and ev.sweep_n_samples > 0
    return EvalRequest(num_problems=ev.num_problems, n_samples=ev.sweep_n_samples if light else ev.n_samples,
                       top_p=tuple(ev.top_p[:1] if light else ev.top_p), temperature=float(ev.temperature),
                       seed=ev.seed)


def base_request(cfg: StudyConfig) -> RunRequest:
    """The base model's evaluation (the warm-start every run starts from), as a request that is
    evaluated, never trained."""
    return RunRequest(study_base_config(cfg), eval_request(cfg, full=True))


class StudyRuns:
    """The study's side of :func:`quatro_nemo.study.runner.execute` (its ``StudyRuns`` protocol)."""

    def __init__(self, cfg: StudyConfig, plan: StudyPlan, out_dir: str, results_dir: Optional[str] = None,
                 publish_results: bool = False, log: Callable[[str], None] = print) -> None:
        self.cfg, self.plan, self.out_dir, self.log = cfg, plan, out_dir, log
        self.results_dir, self.publish_results = results_dir, publish_results
        self.done: Set[str] = set()
        self.failed: Dict[str, int] = {}         # name -> exit code, this invocation
        self.stopped: Set[str] = set()
        self._requests: Dict[str, RunRequest] = {}
        self._costs: Optional[Dict[str, float]] = None

    def request(self, spec: RunSpec) -> RunRequest:
        if spec.name not in self._requests:
            config = run_config(self.plan.defaults, spec, run_dir(self.out_dir, spec.name))
            self._requests[spec.name] = RunRequest(config, eval_request(self.cfg, self.plan.needs_full_evaluation(spec)))
        return self._requests[spec.name]

    def is_done(self, spec: RunSpec) -> bool:
        done = spec.name in self.done or self._find_done(spec)
        if done:
            self.done.add(spec.name)
        return done

    def _find_done(self, spec: RunSpec) -> bool:
        name, directory = spec.name, RunDir(run_dir(self.out_dir, spec.name))
        found = [os.path.isfile(archive_path(d, name)) for d in (self.out_dir, self.results_dir) if d]
        if not any(found) and not os.path.isdir(directory.path):
            return False                        # nothing to compare (and no request to build)
        request = self.request(spec)
        if is_kept(self.out_dir, name, request):
            return True
        if adopt(self.results_dir, self.out_dir, name, request):
            self.log(f"[study] {name}: done (kept in {self.results_dir})")
            return True
        if found[0]:
            self.log(f"[study] {name}: its kept metrics are of other settings; it runs again")
        if directory.recorded_identity() is not None:
            preflight(request)                  # another run's directory: an error naming it
            if directory.is_evaluated():        # finished, not yet kept (stopped right after it)
                self._keep(spec)
                return True
        return False

    def ended(self, spec: RunSpec, result: RunResult) -> None:
        if result.status == "done":
            self._keep(spec)
            self.done.add(spec.name)
        elif result.status == "stopped":
            self.stopped.add(spec.name)
        else:
            self.failed[spec.name] = result.returncode
        self.write_progress("running")

    def _keep(self, spec: RunSpec) -> None:
        request = self.request(spec)
        keep_run(self.out_dir, spec.name, request.identity_record(), RunDir(request.config.run.dir))
        self.publish(spec.name)

    def publish(self, name: str) -> None:
        if self.publish_results and self.results_dir:
            self.log(f"[study] kept metrics to commit: {publish(self.out_dir, self.results_dir, name)}")

    def refill(self) -> List[RunSpec]:
        """The plan as the finished runs now decide it (a search adds points)."""
        self.plan = build_plan(self.cfg, self.out_dir, self.plan.defaults)
        return list(self.plan.runs.values())

    def adopt_committed(self) -> StudyPlan:
        """Take in every committed run of the plan (:meth:`is_done`), until a search that follows
        them adds no more runs; the plan then."""
        while True:
            for spec in self.plan.runs.values():
                self.is_done(spec)
            known = set(self.plan.runs)
            if all(spec.name in known for spec in self.refill()):
                return self.plan

    def ensure_base_evaluation(self) -> None:
        """Evaluate the base model once per study (every run starts from the same warm-start)."""
        request = base_request(self.cfg)
        if is_kept(self.out_dir, BASE, request) or adopt(self.results_dir, self.out_dir, BASE, request):
            return
        started = time.time()
        keep(self.out_dir, BASE, request.identity_record(), evaluate_base(request.config, request.evaluation))
        self.log(f"[study] base model evaluated in {time.time() - started:.0f} s")
        self.publish(BASE)

    def cpu_hours_left(self) -> Optional[float]:
        """The runs not done, on a dedicated core, by the committed full study's timings (None
        when those cannot be read)."""
        if self._costs is None:
            try:
                self._costs = measured_costs(os.path.join(REPO, COMMITTED_TIMINGS))
            except (OSError, ValueError):
                return None
        left = [spec for name, spec in self.plan.runs.items() if name not in self.done]
        base_done = os.path.isfile(archive_path(self.out_dir, BASE))
        return round(RunCosts(self.cfg, self.plan, self._costs).cpu_hours(left, base=not base_done), 2)

    def write_progress(self, state: str) -> Dict:
        """``<out>/progress.json`` (state: running, stopped or finished); returns it."""
        progress = {"study": self.cfg.name, "state": state, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "runs_done": len(self.done & set(self.plan.runs)), "runs_total": len(self.plan.runs),
                    "runs_failed": self.failed, "runs_stopped": sorted(self.stopped),
                    "cpu_hours_left": self.cpu_hours_left(), "cpu_hours_estimated_from": COMMITTED_TIMINGS,
                    "out": self.out_dir, "results": self.results_dir if self.publish_results else None}
        tmp = os.path.join(self.out_dir, PROGRESS_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(progress, f, indent=1)
        os.replace(tmp, os.path.join(self.out_dir, PROGRESS_FILE))
        return progress


def record_identities(cfg: StudyConfig, results_dir: str, log: Callable[[str], None] = print) -> int:
    """Give the kept runs of ``results_dir`` that have no identity record (kept before runs had
    identities) the identity of this study's run of that name, the name deciding as the runner's
    check did then: each such file is rewritten with its identity first and every record of it
    unchanged. Returns how many; a kept file the plan does not name is left as it is, and logged."""
    plan = build_plan(cfg, results_dir)
    runs = StudyRuns(cfg, plan, results_dir)
    requests = {name: runs.request(spec) for name, spec in plan.runs.items()}
    requests[BASE] = base_request(cfg)
    recorded = 0
    for file in sorted(os.listdir(os.path.join(results_dir, METRICS_DIR))):
        name = file[:-len(".jsonl.gz")]
        path = archive_path(results_dir, name)
        if not file.endswith(".jsonl.gz") or kept_identity(path) is not None:
            continue
        if name not in requests:
            log(f"[study] {path}: not a run of study '{cfg.name}'; left without an identity")
            continue
        keep(results_dir, name, requests[name].identity_record(), read_archive(path))
        recorded += 1
    return recorded
