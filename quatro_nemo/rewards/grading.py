"""Run checks in worker processes, each with its own wall-clock timeout.

Answer checking (sympy through math-verify, or running generated code) can hang or crash on a
pathological input, and `signal.alarm`-based timeouts only work in the main thread of the main
interpreter. This pool runs a picklable, module-level function ``check_fn(arg)`` in worker
processes (each runs the optional ``warmup_fn`` first, so imports never count against a check's
time); a worker that exceeds ``timeout_s`` on one check is killed and replaced, and that
check comes back as ``status="timeout"``. A worker that dies (segfault, out of memory) gives
``status="crash"``; an exception inside ``check_fn`` gives ``status="error"``. The caller always
gets one result per argument, in order: an evaluation can never hang or die because of one answer.

Usage::

    with WorkerPool(my_module.check, num_workers=2, timeout_s=5.0) as pool:
        results = pool.map(args)            # list[CheckResult]
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

STATUS_OK = "ok"
STATUS_TIMEOUT = "timeout"
STATUS_ERROR = "error"
STATUS_CRASH = "crash"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    status: str                    # ok | timeout | error | crash
    value: Any = None              # check_fn's return value when status == "ok"
    message: str = ""              # exception text, or what happened
    seconds: float = 0.0           # wall time the check took in its worker


def _worker_loop(check_fn: Callable[[Any], Any], warmup_fn: Optional[Callable[[], Any]],
                 conn: multiprocessing.connection.Connection) -> None:
    if warmup_fn is not None:
        warmup_fn()                     # imports and first-call costs, before any timed check
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if task is None:
            return
        task_id, arg = task
        start = time.perf_counter()
        try:
            value = check_fn(arg)
            reply = (task_id, STATUS_OK, value, "")
        except Exception as err:  # noqa: BLE001 - any failure of one check is that check's result
            reply = (task_id, STATUS_ERROR, None, f"{type(err).__name__}: {err}"[:500])
        conn.send(reply + (time.perf_counter() - start,))


class _Worker:
    def __init__(self, ctx: Any, check_fn: Callable[[Any], Any], warmup_fn: Optional[Callable[[], Any]],
                 startup_timeout_s: float):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_loop, args=(check_fn, warmup_fn, child_conn), daemon=True)
        self.process.start()
        child_conn.close()
        self.task: Optional[Tuple[int, float]] = None      # (task index, deadline)
        self.startup_timeout_s = startup_timeout_s

    def wait_ready(self) -> None:
        """The first check's timeout must not pay for imports: wait for the warm-up to finish."""
        try:
            ready = self.conn.poll(self.startup_timeout_s) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(f"grading worker not ready within {self.startup_timeout_s:g} s "
                               f"(exit code {self.process.exitcode})")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (never imports torch to find out)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def default_start_method() -> str:
    """How the next worker starts; decided as each worker starts, replacements included.

    fork on Linux while CUDA is not initialised in this process (the CPU runs, the evaluation
    recipe before its model): workers start in milliseconds from the caller's warm imports and
    need no ``if __name__ == "__main__"`` guard in the calling script. Workers only run the check
    function, so the usual hazard of forking a threaded parent (a lock held by another thread)
    does not reach them in practice.

    forkserver once CUDA is initialised: on a GPU run the pool starts at the first rollout's
    grading, after CUDA, NCCL and vLLM are up, and a fork would copy a process that holds a CUDA
    context (which the child cannot use; CUDA documents fork after initialisation as
    unsupported), NCCL's communicators and, over InfiniBand, host memory registered with the
    network card (whose copy-on-write after a fork is the classic RDMA hazard). The fork server is
    a fresh interpreter (multiprocessing starts it by fork + exec) that imports the caller's main
    module (the recipes import their heavy modules inside ``main()``: recipes/train.py) and forks
    each worker from itself; a worker then imports the check's module and runs its warm-up.

    spawn on other systems."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver" if cuda_initialized() else "fork"


class WorkerPool:
    """A fixed number of worker processes running ``check_fn``, each call with a timeout."""

    def __init__(self, check_fn: Callable[[Any], Any], num_workers: int = 2, timeout_s: float = 5.0,
                 start_method: Optional[str] = None, warmup_fn: Optional[Callable[[], Any]] = None,
                 startup_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.check_fn = check_fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._start_method = start_method      # None: default_start_method() as each worker starts
        self.warmup_fn = warmup_fn
        self.startup_timeout_s = startup_timeout_s
        self._workers: List[_Worker] = []
        self.num_restarts = 0

    @property
    def start_method(self) -> str:
        """The start method of the next worker (the one given, else :func:`default_start_method`)."""
        return self._start_method or default_start_method()

    def _new_worker(self) -> _Worker:
        return _Worker(multiprocessing.get_context(self.start_method), self.check_fn, self.warmup_fn,
                       self.startup_timeout_s)

    def _ensure_workers(self) -> None:
        new = [self._new_worker() for _ in range(self.num_workers - len(self._workers))]
        for worker in new:                                  # warm up in parallel
            worker.wait_ready()
        self._workers.extend(new)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        replacement = self._new_worker()
        replacement.wait_ready()
        self._workers[self._workers.index(worker)] = replacement
        self.num_restarts += 1

    def map(self, args: Sequence[Any]) -> List[CheckResult]:
        """Run check_fn on every argument; one CheckResult per argument, in order."""
        results: List[Optional[CheckResult]] = [None] * len(args)
        if not args:
            return []
        self._ensure_workers()
        pending = list(range(len(args) - 1, -1, -1))           # a stack, first task on top
        started: Dict[int, float] = {}
        while pending or any(w.task is not None for w in self._workers):
            for worker in self._workers:
                if worker.task is None and pending:
                    idx = pending.pop()
                    started[idx] = time.perf_counter()
                    worker.task = (idx, started[idx] + self.timeout_s)
                    try:
                        worker.conn.send((idx, args[idx]))
                    except (OSError, BrokenPipeError):
                        # the worker died while idle: restart it and retry this task
                        worker.task = None
                        pending.append(idx)
                        self._replace(worker)
            busy = [w for w in self._workers if w.task is not None]
            now = time.perf_counter()
            wait_s = max(0.0, min(w.task[1] for w in busy) - now)
            ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=wait_s)
            for worker in busy:
                idx, deadline = worker.task
                if worker.conn in ready:
                    try:
                        task_id, status, value, message, seconds = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=5.0)
                        code = worker.process.exitcode
                        results[idx] = CheckResult(STATUS_CRASH, None, f"worker died (exit code {code})",
                                                   time.perf_counter() - started[idx])
                        worker.task = None
                        self._replace(worker)
                        continue
                    results[task_id] = CheckResult(status, value, message, seconds)
                    worker.task = None
                elif time.perf_counter() >= deadline:
                    results[idx] = CheckResult(STATUS_TIMEOUT, None, f"no result within {self.timeout_s:g} s",
                                               time.perf_counter() - started[idx])
                    worker.task = None
                    self._replace(worker)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; call close() explicitly
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# -- checks from many threads, each in a separate interpreter under its own time bound ----------
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LENGTH = struct.Struct("!Q")
_MAX_REPLY_BYTES = 1 << 20
_READY = b"R"


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("checker process ended")
        data += chunk
    return data


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has data (or EOF) within `timeout_s` (poll: the caller may hold fds >= 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _serve_checks(target: str, memory_bytes: int) -> None:
    """Main loop of a checker process: requests (length-prefixed pickles of an argument tuple
    from the trusted caller) on stdin, replies (length-prefixed JSON) on stdout."""
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    os.write(1, _READY)
    while True:
        try:
            (size,) = _LENGTH.unpack(_read_exactly(0, _LENGTH.size))
        except EOFError:
            return
        args = pickle.loads(_read_exactly(0, size))
        try:
            reply = [STATUS_OK, function(*args)]
        except Exception as err:  # noqa: BLE001 - any failure of one check is that check's result
            reply = [STATUS_ERROR, f"{type(err).__name__}: {err}"[:500]]
        data = json.dumps(reply).encode()
        os.write(1, _LENGTH.pack(len(data)) + data)


class _CheckerProcess:
    def __init__(self, target: str, memory_bytes: int, startup_timeout_s: float):
        code = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from quatro_nemo.rewards.grading import "
                f"_serve_checks; _serve_checks({target!r}, {memory_bytes})")
        # A fresh interpreter (fork + exec in C): the caller, which may hold CUDA, is never forked.
        self.process = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, close_fds=True)
        # Imports are not the first check's time: wait for the process to say it is ready.
        out = self.process.stdout.fileno()
        if not (_readable(out, startup_timeout_s) and os.read(out, 1) == _READY):
            self.kill()
            raise RuntimeError(f"checker process for {target} not ready within {startup_timeout_s:g} s")

    def call(self, args: Tuple[Any, ...], timeout_s: float) -> CheckResult:
        start = time.perf_counter()
        request = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        out = self.process.stdout.fileno()
        try:
            self.process.stdin.write(_LENGTH.pack(len(request)) + request)
            self.process.stdin.flush()
            if not _readable(out, timeout_s):
                return CheckResult(STATUS_TIMEOUT, None, f"no result within {timeout_s:g} s",
                                   time.perf_counter() - start)
            (size,) = _LENGTH.unpack(_read_exactly(out, _LENGTH.size))
            if size > _MAX_REPLY_BYTES:
                raise EOFError(f"reply of {size} bytes")
            status, value = json.loads(_read_exactly(out, size))
        except (OSError, EOFError, ValueError) as err:
            return CheckResult(STATUS_CRASH, None, f"checker process failed: {err}", time.perf_counter() - start)
        return CheckResult(status, value if status == STATUS_OK else None, "" if status == STATUS_OK else value,
                           time.perf_counter() - start)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()


class CheckerProcesses:
    """Runs ``target`` ("module:function", a module-level function of this package whose result
    is JSON data) in separate interpreters, one call at a time per process, callable from many
    threads at once. Each call has its own wall-clock bound (``timeout_s``: the process is killed
    and the call's status is "timeout") and the processes their own address-space limit, so a
    check that is slow or large on hostile data stalls neither the caller's interpreter (its
    GIL, the other threads' timers) nor its memory. Processes start on demand (one per
    concurrent caller at most) and are reused."""

    def __init__(self, target: str, timeout_s: float = 10.0, memory_bytes: int = 2 << 30,
                 startup_timeout_s: float = 120.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.target, self.timeout_s, self.memory_bytes = target, float(timeout_s), int(memory_bytes)
        self.startup_timeout_s = startup_timeout_s
        self._idle: List[_CheckerProcess] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _kill_all, self._idle)

    def call(self, *args: Any) -> CheckResult:
        with self._lock:
            checker = self._idle.pop() if self._idle else None
        if checker is None:
            checker = _CheckerProcess(self.target, self.memory_bytes, self.startup_timeout_s)
        result = checker.call(args, self.timeout_s)
        if result.status in (STATUS_OK, STATUS_ERROR):
            with self._lock:
                self._idle.append(checker)
        else:
            checker.kill()
        return result

    def close(self) -> None:
        with self._lock:
            _kill_all(self._idle)


def _kill_all(checkers: List[_CheckerProcess]) -> None:
    while checkers:
        checkers.pop().kill()
