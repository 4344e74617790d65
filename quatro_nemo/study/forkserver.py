"""A fork server for the study's runs: pay interpreter start-up, library imports and task
generation once per study invocation instead of once per run.

    python -m quatro_nemo.study.forkserver [--prewarm BASE_ARG...]

Every study run is a Python command line (``-m quatro_nemo.study.job ARGS`` or ``SCRIPT ARGS``).
Started as its own process, each paid ~7 of its ~80 seconds before training (docs/study.md,
"Budget"): the interpreter, torch + megatron + Hydra, and the Countdown task's generation. This
server does that once (``--prewarm``: :func:`quatro_nemo.study.job.preload` with the study's base
arguments), then forks one child per run. A child is still a separate process with its own
parallel state, RNG seeds, checkpoint writer and exit code, so a run is the same computation as
before, bit for bit (tests/study/test_forkserver.py); only what it would have rebuilt identically
is inherited.

Protocol (one JSON object per line). On stdin, one request per run::

    {"name": NAME, "argv": ["-m", MODULE, ARG...] or [SCRIPT, ARG...], "log": PATH}

On stdout: ``{"ready": true}`` once preloaded, ``{"started": NAME, "pid": PID}`` per fork and
``{"finished": NAME, "code": EXIT_CODE, "cpu": SECONDS}`` when the child has exited (CPU
seconds from ``wait4``: the child's user + system time and that of the processes it waited for,
as for any child). The child's stdout and stderr go to its ``log`` (appended). End of stdin: the
server waits for its children, reports them and exits 0.

Signals: the server blocks SIGINT and SIGTERM (the caller signals the children it was told
about; a child unblocks them before it runs), so it can always report how each child ended.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import traceback
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Light at top level, like the job: a child's checkpoint writer spawns a process that imports the
# child's __main__ module.

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_command(argv: Sequence[str]) -> int:
    """Run a Python command line (``-m MODULE ARGS`` or ``SCRIPT ARGS``) as ``__main__`` in this
    process, as the interpreter would; its exit code."""
    argv = list(argv)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:   # noqa: BLE001 - reported in the run's log, like an uncaught exception
        traceback.print_exc()
        return 1


def _child(argv: Sequence[str], log_path: str) -> None:
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
        code = run_command(argv)
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

    def fork(self, request: Dict) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request["argv"], request["log"])
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
                chunk = os.read(requests_fd, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.fork(json.loads(line))
            self.reap(block=False)
        self.reap(block=True)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Blocked, not ignored: a child inherits the mask and unblocks it first thing, so a signal sent
    # to it between the fork and then is pending, not lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    if argv[:1] == ["--prewarm"]:
        from quatro_nemo.study.job import preload

        preload(argv[1:])
    server = ForkServer(sys.stdout)
    server.send({"ready": True})
    server.serve(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
