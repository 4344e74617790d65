"""Run the study's training runs, a few at a time, resumably.

Each run is a request to the engine's front door (``quatro_nemo.engine.api.RunRequest``: train,
then evaluate the final policy) with its own directory ``<study dir>/runs/<run name>`` (output in
``train.log``), claimed for that request before it starts (``api.preflight``: a directory of
another run is an error, never silently reused). Every run is its own process, forked by one fork
server per invocation (:mod:`quatro_nemo.study.forkserver`), which imports the libraries and
builds the task once (``preload``), and runs :func:`quatro_nemo.study.job.run_job` on the
request. Which runs are done is the study's to say (``StudyRuns.is_done``: its kept metrics,
quatro_nemo.study.kept); done runs are skipped, so re-running an interrupted study continues
where it stopped (a run cut short resumes from its last checkpoint, which the training does by
itself). Failed runs are reported, not retried within one invocation; a run stopped by a signal
(exit 75, checkpointed) is reported as stopped.
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
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from quatro_nemo.engine.api import RunRequest, preflight
from quatro_nemo.engine.run_dir import RunDir
from quatro_nemo.megatron.parallel import standalone_environment
from quatro_nemo.study.forkserver import encode_call
from quatro_nemo.study.job import run_job
from quatro_nemo.study.plan import RunSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREEMPTED_EXIT_CODE = 75           # a training stopped by SIGTERM/SIGUSR1 after its checkpoint


def run_dir(study_dir: str, name: str) -> str:
    return os.path.join(study_dir, "runs", name)


@dataclass
class RunResult:
    name: str
    status: str              # done (this time) | skipped (already done) | failed | stopped (exit 75: resumes)
    seconds: float = 0.0
    returncode: Optional[int] = None
    cpu_seconds: Optional[float] = None   # user + system time of the run's process


class StudyRuns(Protocol):
    """What :func:`execute` asks of the study about its runs (the driver's ``StudyRuns``)."""

    def request(self, spec: RunSpec) -> RunRequest:
        """The run's request; its ``run.dir`` is :func:`run_dir` of the study directory."""

    def is_done(self, spec: RunSpec) -> bool:
        """Whether the run is finished and kept (a run finished but not yet kept is kept now)."""

    def ended(self, spec: RunSpec, result: RunResult) -> None:
        """A run's process ended (``result.status``: done, failed or stopped); a done run's records
        are complete in its directory."""


class ForkServerError(RuntimeError):
    """The fork server exited while the study still needed it."""


class ForkServer:
    """The caller's side of :mod:`quatro_nemo.study.forkserver`: start runs, collect how they ended."""

    def __init__(self, study_dir: str, env: Dict[str, str], preload: Optional[str] = None) -> None:
        """``preload``: a call (``forkserver.encode_call``) the server runs in itself first."""
        self.log_path = os.path.join(study_dir, "forkserver.log")
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "quatro_nemo.study.forkserver"], cwd=REPO, env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self.running: set = set()            # requested, not yet reported finished
        self.pids: Dict[str, int] = {}       # of those, the ones the server has forked
        self._ready, self._preloaded = False, preload is None
        self._reports: List[Dict] = []
        self._buffer = b""
        if preload is not None:
            self._send({"preload": preload})
        while not (self._ready and self._preloaded):
            self._read(timeout=None)

    def start(self, name: str, call: str, log_path: str) -> None:
        """Fork a child that runs ``call`` (``forkserver.encode_call``), its output in ``log_path``."""
        self._send({"name": name, "call": call, "log": log_path})
        self.running.add(name)

    def _send(self, message: Dict) -> None:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            self._died()

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
            elif message.get("preloaded"):
                self._preloaded = True
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


def execute(runs: Sequence[RunSpec], study_dir: str, study: StudyRuns, workers: int,
            log: Callable[[str], None] = print, poll_s: float = 0.5, preload: Optional[str] = None,
            refill: Optional[Callable[[], Sequence[RunSpec]]] = None) -> List[RunResult]:
    """Run every spec not yet done (``study.is_done``), in the order given, at most ``workers``
    processes at a time; return what happened.

    ``preload``: a call (``forkserver.encode_call``, e.g. ``job.preload`` of the study's base
    config) the fork server runs before the first run. ``refill``: called after each run ends,
    returns the runs the study needs now (a search adds runs once the ones it depends on are
    done); those not yet known start next, before the remaining ones."""
    results: List[RunResult] = []
    pending: List[RunSpec] = []
    for spec in runs:
        if study.is_done(spec):
            results.append(RunResult(spec.name, "skipped"))
        else:
            pending.append(spec)
    queue = _Queue(pending, {spec.name for spec in runs}, refill, study)
    queue.refill()
    if not queue.pending:
        return results
    # Each run is its own one-process world: never inherit a rendezvous (prewarm, or a study started
    # under torchrun/SLURM, may have set MASTER_PORT, and two runs on one port collide).
    env = dict(standalone_environment(), PYTHONUNBUFFERED="1")
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    server = None
    started: Dict[str, Tuple[RunSpec, float]] = {}    # the runs going: their spec and start time
    try:
        os.makedirs(study_dir, exist_ok=True)
        server = ForkServer(study_dir, env, preload)
        _loop(server, queue, started, results, study_dir, study, workers, log, poll_s)
        server.close()
    except KeyboardInterrupt:
        # SIGTERM makes a run checkpoint and exit 75: the next invocation resumes it. A run past its
        # training finishes instead: it counts as done here, like any other.
        if server is not None:
            server.terminate()
            for report in server.close():
                result = _ended(report, started, study_dir, study)
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
    study: StudyRuns
    started: int = 0

    def refill(self) -> None:
        if self.source is None:
            return
        new = [spec for spec in self.source() if spec.name not in self.known]
        self.known.update(spec.name for spec in new)
        self.pending[:0] = [spec for spec in new if not self.study.is_done(spec)]

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


def _ended(report: Dict, started: Dict[str, Tuple[RunSpec, float]], study_dir: str, study: StudyRuns) -> RunResult:
    """The fork server's report that a run's process exited, as that run's result (told to
    ``study.ended``): done when it exited 0 with its records complete, stopped when a signal made
    it checkpoint and exit 75 (the next invocation resumes it), failed otherwise."""
    name, code = report["finished"], report["code"]
    spec, since = started.pop(name)
    request = study.request(spec)
    directory = RunDir(request.config.run.dir)
    complete = directory.is_evaluated() if request.evaluation is not None else directory.is_trained(request.config.trainer.steps)
    status = ("done" if code == 0 and complete else "stopped" if code == PREEMPTED_EXIT_CODE else "failed")
    result = RunResult(name, status, time.time() - since, code, report["cpu"])
    study.ended(spec, result)
    return result


def _loop(server: ForkServer, queue: _Queue, started: Dict[str, Tuple[RunSpec, float]], results, study_dir,
          study: StudyRuns, workers, log, poll_s) -> None:
    while queue.pending or started:
        while queue.pending and len(started) < workers:
            spec = queue.pop()
            request = study.request(spec)
            directory = preflight(request)         # never another run's directory, silently
            log_path = directory.file("train.log")
            with open(log_path, "a") as handle:
                handle.write(f"$ {spec.name}: run {request.digest()} (forked by the study's fork server)\n")
            server.start(spec.name, encode_call(run_job, request), log_path)
            started[spec.name] = (spec, time.time())
        for report in server.finished(timeout=poll_s):
            result = _ended(report, started, study_dir, study)
            results.append(result)
            finished = sum(r.status != "skipped" for r in results)
            outcome = {"done": "ok", "stopped": "stopped (exit 75: resumes from its checkpoint next time)"}
            log(f"[study] {finished}/{finished + len(started) + len(queue.pending)} {result.name}: "
                f"{outcome.get(result.status, f'FAILED (exit {result.returncode})')} in {result.seconds:.0f} s"
                + ("" if result.status == "done" else f"; see {run_dir(study_dir, result.name)}/train.log"))
            queue.refill()
