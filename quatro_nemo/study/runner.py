"""Run the study's training runs as independent processes, a few at a time, resumably.

Each run is one process in its own directory ``<study dir>/runs/<run name>`` with its output in
``train.log``: ``recipes/train.py``, or, when the study evaluates its runs, the study's job
(:mod:`quatro_nemo.study.job`: the same training, then the evaluation of the final policy in the
same process). A run is done once its ``report.json`` exists (training only) or its
``study_eval.jsonl`` does (with evaluation); done runs are skipped, so re-running an interrupted
study continues where it stopped (a run cut short resumes from its last checkpoint, which the
training does by itself). Failed runs are reported, not retried within one invocation.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from quatro_nemo.megatron.parallel import standalone_environment
from quatro_nemo.study.evaluation import STUDY_EVAL
from quatro_nemo.study.plan import RunSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "recipes", "train.py")
JOB = ["-m", "quatro_nemo.study.job"]      # training then evaluation, one process

# spec -> the arguments of the study's evaluation of that run (quatro_nemo.study.evaluation)
EvaluationArgs = Callable[[RunSpec], List[str]]


def run_dir(study_dir: str, name: str) -> str:
    return os.path.join(study_dir, "runs", name)


def is_trained(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "report.json"))


def is_done(directory: str, evaluated: bool = True) -> bool:
    """Trained, and evaluated by the study when it evaluates its runs."""
    return os.path.isfile(os.path.join(directory, STUDY_EVAL if evaluated else "report.json"))


@dataclass
class RunResult:
    name: str
    status: str              # done (this time) | skipped (already done) | failed
    seconds: float = 0.0
    returncode: Optional[int] = None
    cpu_seconds: Optional[float] = None   # user + system time of the run's process


def _reap(process: subprocess.Popen) -> Optional[tuple]:
    """(exit code, CPU seconds) of a process that has exited, else None. ``os.wait4`` returns the
    child's resource usage, which ``Popen.poll`` would discard."""
    pid, status, usage = os.wait4(process.pid, os.WNOHANG)
    if pid == 0:
        return None
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_utime + usage.ru_stime


def prewarm(base_args: Sequence[str]) -> None:
    """Build the warm-start cache once, before several runs would each train it."""
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.task import build_task

    cfg = load_config(list(base_args))
    if cfg.task.name != "countdown":
        return   # other tasks load a pretrained checkpoint: nothing to build
    task = build_task(cfg)
    task.load_base_state(task.model_config(cfg.model))


def command_of(spec: RunSpec, directory: str, base_args: Sequence[str],
               evaluation_args: Optional[EvaluationArgs]) -> List[str]:
    """The process of one run: recipes/train.py, or the study job (training + evaluation)."""
    train = [*base_args, *spec.overrides, f"run.dir={directory}", "run.progress_bar=false"]
    if evaluation_args is None:
        return [sys.executable, TRAIN, *train]
    return [sys.executable, *JOB, *train, "--evaluate", *evaluation_args(spec)]


def execute(runs: Sequence[RunSpec], study_dir: str, base_args: Sequence[str], workers: int,
            log: Callable[[str], None] = print, poll_s: float = 0.5,
            evaluation_args: Optional[EvaluationArgs] = None) -> List[RunResult]:
    """Run every spec not yet done (trained, and evaluated with `evaluation_args`), at most
    `workers` processes at a time; return what happened."""
    results: List[RunResult] = []
    pending: List[RunSpec] = []
    evaluated = evaluation_args is not None
    for spec in runs:
        if is_done(run_dir(study_dir, spec.name), evaluated):
            results.append(RunResult(spec.name, "skipped"))
        else:
            pending.append(spec)
    # Heavier runs (more inner loops) first, so the last minutes are not one long run alone.
    pending.sort(key=lambda s: -s.setting.inner_loops)
    # Each run is its own one-process world: never inherit a rendezvous (prewarm, or a study started
    # under torchrun/SLURM, may have set MASTER_PORT, and two runs on one port collide).
    env = dict(standalone_environment(), PYTHONUNBUFFERED="1")
    active: Dict[str, tuple] = {}
    total = len(pending)
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    try:
        _loop(pending, active, results, total, study_dir, base_args, workers, env, log, poll_s, evaluation_args)
    except KeyboardInterrupt:
        # SIGTERM makes train.py checkpoint and exit 75: the next invocation resumes these runs.
        for process, handle, _ in active.values():
            process.terminate()
        for process, handle, _ in active.values():
            process.wait()
            handle.close()
        raise StudyInterrupted(results, runs_started=total - len(pending)) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return results


class StudyInterrupted(KeyboardInterrupt):
    """SIGTERM / Ctrl-C stopped :func:`execute`: ``results`` of the runs finished before it and
    the number of runs it had started (their partial training resumes in the next invocation),
    so the caller can still record what this invocation cost."""

    def __init__(self, results: List[RunResult], runs_started: int):
        super().__init__(f"study interrupted after starting {runs_started} run(s)")
        self.results, self.runs_started = results, runs_started


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _loop(pending, active, results, total, study_dir, base_args, workers, env, log, poll_s,
          evaluation_args) -> None:
    while pending or active:
        while pending and len(active) < workers:
            spec = pending.pop(0)
            directory = run_dir(study_dir, spec.name)
            os.makedirs(directory, exist_ok=True)
            command = command_of(spec, directory, base_args, evaluation_args)
            handle = open(os.path.join(directory, "train.log"), "a")
            handle.write("$ " + " ".join(command) + "\n")
            handle.flush()
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
            active[spec.name] = (process, handle, time.time())
        time.sleep(poll_s)
        for name, (process, handle, started) in list(active.items()):
            reaped = _reap(process)
            if reaped is None:
                continue
            code, cpu = reaped
            handle.close()
            del active[name]
            ok = code == 0 and is_done(run_dir(study_dir, name), evaluation_args is not None)
            results.append(RunResult(name, "done" if ok else "failed", time.time() - started, code, cpu))
            finished = sum(r.status != "skipped" for r in results)
            log(f"[study] {finished}/{total} {name}: {'ok' if ok else f'FAILED (exit {code})'} "
                f"in {time.time() - started:.0f} s" + ("" if ok else f"; see {run_dir(study_dir, name)}/train.log"))
