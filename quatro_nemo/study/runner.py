"""Run the study's training runs, a few at a time, resumably.

Each run has its own directory ``<study dir>/runs/<run name>`` with its output in ``train.log``:
``recipes/train.py``, or, when the study evaluates its runs, the study's job
(:mod:`quatro_nemo.study.job`: the same training, then the evaluation of the final policy in the
same process). Every run is its own process, forked by one fork server per invocation
(:mod:`quatro_nemo.study.forkserver`), which imports the libraries and builds the task once
(``prewarm``). A run is done once its ``report.json`` exists (training only) or its
``study_eval.jsonl`` does (with evaluation); done runs are skipped, so re-running an interrupted
study continues where it stopped (a run cut short resumes from its last checkpoint, which the
training does by itself). Failed runs are reported, not retried within one invocation.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from quatro_nemo.engine.config import renamed_override
from quatro_nemo.megatron.parallel import standalone_environment
from quatro_nemo.study.evaluation import STUDY_EVAL
from quatro_nemo.study.config import StudyConfigError
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


def prewarm(base_args: Sequence[str]) -> None:
    """Build the warm-start cache once, before several runs would each train it."""
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.task import build_task

    cfg = load_config(list(base_args))
    if cfg.task.name != "countdown":
        return   # other tasks load a pretrained checkpoint: nothing to build
    task = build_task(cfg)
    task.load_base_state(task.model_config(cfg.model))


IDENTITY_FILE = "study_run.json"     # <run dir>/study_run.json: the command the run was started with


class RunIdentityError(StudyConfigError):
    """A run directory was started with other settings than the study's run of that name."""


def run_identity(spec: RunSpec, base_args: Sequence[str], evaluation_args: Optional[EvaluationArgs]) -> List[str]:
    """What a run is: its command line (training and evaluation arguments) without its directory.
    Run names only carry the settings that differ from the defaults, so a study config change
    (more problems, checkpoint evaluations, other study-wide overrides) keeps the names; this is
    what tells the runs apart."""
    return [a for a in command_of(spec, "", base_args, evaluation_args) if not a.startswith("run.dir=")]


def _logged_command(directory: str) -> Optional[List[str]]:
    """The command on the first line of a run's train.log (runs started before study_run.json
    existed), without the interpreter and the run directory; None if there is none."""
    path = os.path.join(directory, "train.log")
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        first = f.readline(1 << 16)
    if not first.startswith("$ "):
        return None
    words = first[2:].split("  (forked", 1)[0].split()[1:]
    return [w for w in words if not w.startswith("run.dir=")]


def check_identity(directory: str, identity: List[str]) -> None:
    """Record a run's identity when it starts; a directory already started with another identity
    is an error naming both (never silently reused, never silently redone). A run recorded with
    QUATRO's flat keys (before its nested sections) is the same run with the new keys."""
    path = os.path.join(directory, IDENTITY_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            recorded = json.load(f).get("command")
    else:
        recorded = _logged_command(directory)
    if recorded is not None:
        recorded = [renamed_override(arg) or arg for arg in recorded]
    if recorded is not None and recorded != identity:
        changed = sorted(set(recorded) ^ set(identity))
        raise RunIdentityError(f"run directory {directory} was started with other settings than this study's run "
                               f"of that name (differing arguments: {changed}); use another study directory (out=) "
                               "or delete that run directory")
    if not os.path.isfile(path):
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"command": identity}, f, indent=1)


def command_of(spec: RunSpec, directory: str, base_args: Sequence[str],
               evaluation_args: Optional[EvaluationArgs]) -> List[str]:
    """The Python command line of one run (after the interpreter): recipes/train.py, or the study
    job (training + evaluation)."""
    train = [*base_args, *spec.overrides, f"run.dir={directory}", "run.progress_bar=false"]
    if evaluation_args is None:
        return [TRAIN, *train]
    return [*JOB, *train, "--evaluate", *evaluation_args(spec)]


class ForkServerError(RuntimeError):
    """The fork server exited while the study still needed it."""


class ForkServer:
    """The caller's side of :mod:`quatro_nemo.study.forkserver`: start runs, collect how they ended."""

    def __init__(self, study_dir: str, env: Dict[str, str], prewarm_args: Optional[Sequence[str]]) -> None:
        self.log_path = os.path.join(study_dir, "forkserver.log")
        command = [sys.executable, "-m", "quatro_nemo.study.forkserver"]
        if prewarm_args is not None:
            command += ["--prewarm", *prewarm_args]
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log)
        self.running: set = set()            # requested, not yet reported finished
        self.pids: Dict[str, int] = {}       # of those, the ones the server has forked
        self._ready = False
        self._reports: List[Dict] = []
        self._buffer = b""
        while not self._ready:
            self._read(timeout=None)

    def start(self, name: str, argv: Sequence[str], log_path: str) -> None:
        request = {"name": name, "argv": list(argv), "log": log_path}
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            self._died()
        self.running.add(name)

    def finished(self, timeout: Optional[float]) -> List[Dict]:
        """``{"finished": name, "code": ..., "cpu": ...}`` of the runs that ended since the last
        call (waits up to ``timeout`` seconds when there is none yet; None: until one ends)."""
        if not self._reports:
            self._read(timeout)
        reports, self._reports = self._reports, []
        return reports

    def terminate(self) -> None:
        """SIGTERM to every run still going (it checkpoints and exits 75)."""
        while any(name not in self.pids for name in self.running):
            self._read(timeout=None)         # the server forks every request it has read
        for name in self.running:
            try:
                os.kill(self.pids[name], signal.SIGTERM)
            except ProcessLookupError:
                pass

    def close(self) -> List[Dict]:
        """End of requests: wait until the server has reported every run; their reports."""
        reports: List[Dict] = []
        self.process.stdin.close()
        while self.running or self._reports:
            reports += self.finished(timeout=None)
        self.process.wait()
        return reports

    def _read(self, timeout: Optional[float]) -> None:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            return
        chunk = os.read(self.process.stdout.fileno(), 65536)
        if not chunk:
            self._died()
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for message in (json.loads(line) for line in lines if line.strip()):
            if message.get("ready"):
                self._ready = True
            elif "started" in message:
                self.pids[message["started"]] = message["pid"]
            elif "finished" in message:
                self.running.discard(message["finished"])
                self.pids.pop(message["finished"], None)
                self._reports.append(message)

    def _died(self) -> None:
        code = self.process.wait()
        with open(self.log_path) as log:
            tail = log.read()[-3000:]
        raise ForkServerError(f"the study's fork server exited with {code}; {self.log_path}:\n{tail}")


def execute(runs: Sequence[RunSpec], study_dir: str, base_args: Sequence[str], workers: int,
            log: Callable[[str], None] = print, poll_s: float = 0.5,
            evaluation_args: Optional[EvaluationArgs] = None, preload: bool = False,
            refill: Optional[Callable[[], Sequence[RunSpec]]] = None) -> List[RunResult]:
    """Run every spec not yet done (trained, and evaluated with `evaluation_args`), in the order
    given, at most `workers` processes at a time; return what happened.

    ``preload``: the fork server imports the libraries and builds the task of ``base_args``
    before the first run. ``refill``: called after each run ends, returns the runs the study
    needs now (a search adds runs once the ones it depends on are done); those not yet known
    start next, before the remaining ones."""
    results: List[RunResult] = []
    pending: List[RunSpec] = []
    evaluated = evaluation_args is not None

    def identify(spec: RunSpec) -> None:
        directory = run_dir(study_dir, spec.name)
        if os.path.isdir(directory):
            check_identity(directory, run_identity(spec, base_args, evaluation_args))

    for spec in runs:
        identify(spec)
        if is_done(run_dir(study_dir, spec.name), evaluated):
            results.append(RunResult(spec.name, "skipped"))
        else:
            pending.append(spec)
    queue = _Queue(pending, {spec.name for spec in runs}, refill, study_dir, evaluated, identify)
    queue.refill()
    if not queue.pending:
        return results
    # Each run is its own one-process world: never inherit a rendezvous (prewarm, or a study started
    # under torchrun/SLURM, may have set MASTER_PORT, and two runs on one port collide).
    env = dict(standalone_environment(), PYTHONUNBUFFERED="1")
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    server = None
    started: Dict[str, float] = {}    # the runs going: when each started
    try:
        os.makedirs(study_dir, exist_ok=True)
        server = ForkServer(study_dir, env, list(base_args) if preload else None)
        _loop(server, queue, started, results, study_dir, base_args, workers, log, poll_s, evaluation_args)
        server.close()
    except KeyboardInterrupt:
        # SIGTERM makes a run checkpoint and exit 75: the next invocation resumes it. A run past its
        # training finishes instead: it counts as done here, like any other.
        if server is not None:
            server.terminate()
            for report in server.close():
                result = _ended(report, started, study_dir, evaluation_args is not None)
                if result.status == "done":
                    results.append(result)
                    log(f"[study] {result.name}: ok in {result.seconds:.0f} s (finished while the study stopped)")
        raise StudyInterrupted(results, runs_started=queue.started) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return results


@dataclass
class _Queue:
    """The runs still to start, and the runs the study asked for so far."""

    pending: List[RunSpec]
    known: set
    source: Optional[Callable[[], Sequence[RunSpec]]]
    study_dir: str
    evaluated: bool
    identify: Callable[[RunSpec], None]          # check_identity of a run that has a directory
    started: int = 0

    def refill(self) -> None:
        if self.source is None:
            return
        new = [spec for spec in self.source() if spec.name not in self.known]
        self.known.update(spec.name for spec in new)
        for spec in new:
            self.identify(spec)
        self.pending[:0] = [spec for spec in new if not is_done(run_dir(self.study_dir, spec.name), self.evaluated)]

    def pop(self) -> RunSpec:
        self.started += 1
        return self.pending.pop(0)


class StudyInterrupted(KeyboardInterrupt):
    """SIGTERM / Ctrl-C stopped :func:`execute`: ``results`` of the runs finished before it and
    the number of runs it had started (their partial training resumes in the next invocation),
    so the caller can still record what this invocation cost."""

    def __init__(self, results: List[RunResult], runs_started: int):
        super().__init__(f"study interrupted after starting {runs_started} run(s)")
        self.results, self.runs_started = results, runs_started


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _ended(report: Dict, started: Dict[str, float], study_dir: str, evaluated: bool) -> RunResult:
    """The fork server's report that a run's process exited, as that run's result."""
    name, code = report["finished"], report["code"]
    seconds = time.time() - started.pop(name)
    ok = code == 0 and is_done(run_dir(study_dir, name), evaluated)
    return RunResult(name, "done" if ok else "failed", seconds, code, report["cpu"])


def _loop(server: ForkServer, queue: _Queue, started: Dict[str, float], results, study_dir, base_args,
          workers, log, poll_s, evaluation_args) -> None:
    while queue.pending or started:
        while queue.pending and len(started) < workers:
            spec = queue.pop()
            directory = run_dir(study_dir, spec.name)
            check_identity(directory, run_identity(spec, base_args, evaluation_args))
            command = command_of(spec, directory, base_args, evaluation_args)
            log_path = os.path.join(directory, "train.log")
            with open(log_path, "a") as handle:
                handle.write(f"$ {sys.executable} " + " ".join(command) + "  (forked by the study's fork server)\n")
            server.start(spec.name, command, log_path)
            started[spec.name] = time.time()
        for report in server.finished(timeout=poll_s):
            result = _ended(report, started, study_dir, evaluation_args is not None)
            results.append(result)
            finished, ok = sum(r.status != "skipped" for r in results), result.status == "done"
            log(f"[study] {finished}/{finished + len(started) + len(queue.pending)} {result.name}: "
                f"{'ok' if ok else f'FAILED (exit {result.returncode})'} in {result.seconds:.0f} s"
                + ("" if ok else f"; see {run_dir(study_dir, result.name)}/train.log"))
            queue.refill()
