"""A fork server for the study's runs: pay interpreter start-up, library imports and task
generation once per study invocation instead of once per run.

    python -m quatro_nemo.study.forkserver

Every study run is one call of a Python function (the study's: ``job.run_job(request)``, the
engine's front door). Started as its own process, each run paid ~7 of its ~80 seconds before
training (docs/study.md, "Budget"): the interpreter, torch + megatron + Hydra, and the Countdown
task's generation. This server does that once (a ``preload`` call: ``job.preload`` with the
study's base config), then forks one child per run. A child is still a separate process with its
own parallel state, RNG seeds, checkpoint writer and exit code, so a run is the same computation
as before, bit for bit (tests/study/test_forkserver.py); only what it would have rebuilt
identically is inherited.

Protocol (one JSON object per line; a call is a pickled ``(function, args)``, :func:`encode_call`).
On stdin::

    {"preload": CALL}                          run in the server itself, answered {"preloaded": true}
    {"name": NAME, "call": CALL, "log": PATH}  fork a child that runs CALL

On stdout: ``{"ready": true}`` once the signals are blocked, ``{"started": NAME, "pid": PID}`` per fork and ``{"finished": NAME, "code": EXIT_CODE,
"cpu": SECONDS}`` when the child has exited. The exit code is the interpreter's for a script: the
function's int result (0 for None), a SystemExit's code, 1 after an uncaught exception (its
traceback in the log). CPU seconds come from ``wait4``: the child's user + system time and that
of the processes it waited for. The child's stdout and stderr go to its ``log`` (appended). End
of stdin: the server waits for its children, reports them and exits 0. A preload that fails
ends the server (exit 1, its traceback on stderr).

Signals: the server blocks SIGINT and SIGTERM (the caller signals the children it was told
about; a child unblocks them before it runs), so it can always report how each child ended.
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import pickle
import select
import signal
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Light at top level: a child's checkpoint writer spawns a process that imports the server's
# __main__ module (this one) again (tests/test_entry_point_imports.py).

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def encode_call(function: Callable[..., Any], *args: Any) -> str:
    """A module-level function and its arguments as protocol text (pickled by reference)."""
    return base64.b64encode(pickle.dumps((function, args))).decode("ascii")


def decode_call(text: str):
    return pickle.loads(base64.b64decode(text))


def run_call(function: Callable[..., Any], args: Sequence[Any]) -> int:
    """Call ``function(*args)`` as the interpreter runs a script; its exit code."""
    try:
        result = function(*args)
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:   # noqa: BLE001 - reported in the run's log, like an uncaught exception
        traceback.print_exc()
        return 1


def _child(call: str, log_path: str) -> None:
    """In the forked child: signals delivered again (one sent since the fork is pending and takes
    effect now), stdout/stderr to the log, run, exit."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        try:
            function, args = decode_call(call)
        except BaseException:   # noqa: BLE001 - an unpicklable call is this run's error
            traceback.print_exc()
        else:
            code = run_call(function, args)
    finally:
        # What the interpreter does at exit (multiprocessing's finalizers stop the checkpoint
        # writer's Manager), then leave without unwinding into the server's loop.
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ForkServer:
    """The server's state: its children by pid."""

    def __init__(self, out) -> None:
        self.out = out
        self.children: Dict[int, str] = {}

    def send(self, message: Dict) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def handle(self, request: Dict) -> None:
        if "preload" in request:
            function, args = decode_call(request["preload"])
            function(*args)            # an exception ends the server: the caller reads its stderr
            self.send({"preloaded": True})
        else:
            self.fork(request)

    def fork(self, request: Dict) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request["call"], request["log"])
        self.children[pid] = request["name"]
        self.send({"started": request["name"], "pid": pid})

    def reap(self, block: bool) -> None:
        while self.children:
            pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                return
            name = self.children.pop(pid, None)
            if name is not None:
                self.send({"finished": name, "code": os.waitstatus_to_exitcode(status),
                           "cpu": usage.ru_utime + usage.ru_stime})

    def serve(self, requests_fd: int, poll_s: float = 0.1) -> None:
        pending = b""
        while True:
            readable, _, _ = select.select([requests_fd], [], [], poll_s)
            if readable:
                chunk = os.read(requests_fd, 1 << 20)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(json.loads(line))
            self.reap(block=False)
        self.reap(block=True)


def main(argv: Optional[List[str]] = None) -> int:
    if list(sys.argv[1:] if argv is None else argv):
        print("usage: python -m quatro_nemo.study.forkserver  (requests on stdin: see the module docstring)",
              file=sys.stderr)
        return 2
    # Blocked, not ignored: a child inherits the mask and unblocks it first thing, so a signal sent
    # to it between the fork and then is pending, not lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    server = ForkServer(sys.stdout)
    server.send({"ready": True})
    server.serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
