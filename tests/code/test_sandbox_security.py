"""Hostile programs against the sandbox. Each test fails if the matching protection is removed
(the comment above each says which). Nothing here sends traffic beyond the loopback interface
and the TEST-NET-1 address 192.0.2.1 (RFC 5737), whose connect must fail before any packet.
"""
import dataclasses
import errno
import hashlib
import os
import signal
import socket
import subprocess
import time
import uuid

import pytest

from host_checks import assert_no_survivors, last_json

from quatro_nemo.rewards import sandbox as sandbox_module
from quatro_nemo.rewards.code import CodeVerifier
from quatro_nemo.rewards.sandbox import (STATUS_CPU_LIMIT, STATUS_ERROR, STATUS_OK, STATUS_OUTPUT_LIMIT,
                                         STATUS_TIMEOUT, Sandbox)


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SANDBOX_SOURCE = os.path.abspath(sandbox_module.__file__)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_limits_and_namespaces_are_in_effect(limits_in_effect, sandbox):
    assert limits_in_effect["Max cpu time"] == str(sandbox.config.cpu_time_s)
    assert limits_in_effect["Max open files"] == str(sandbox.config.max_open_files)
    assert limits_in_effect["Max core file size"] == "0"


# Protection: RLIMIT_CPU and the wall-clock kill.
def test_infinite_loop_is_stopped(sandbox, limits_in_effect):
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass\n")
    elapsed = time.monotonic() - start
    # CPU limit (2 s) normally fires first; on a busy machine the wall clock (3 s) may.
    assert result.status in (STATUS_CPU_LIMIT, STATUS_TIMEOUT)
    assert elapsed < sandbox.config.wall_timeout_s + 1.5


# Protection: wall-clock timeout + SIGKILL of the process group (a sleeping program uses no CPU).
def test_sleeping_program_times_out(sandbox):
    start = time.monotonic()
    result = sandbox.run("import time\ntime.sleep(1000)\n", timeout_s=1.0)
    assert result.status == STATUS_TIMEOUT
    assert result.exit_code is None
    assert time.monotonic() - start < 2.5


# Protection: RLIMIT_NPROC (per sandbox) and PID-namespace teardown of the children.
def test_fork_count_is_capped_and_children_die(sandbox, limits_in_effect):
    marker = f"forkcount-{uuid.uuid4().hex}"
    program = f"""
import os, sys
count = 0
while count < 64:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(20)", "{marker}"])
    count += 1
print(count)
"""
    result = sandbox.run(program, timeout_s=15.0)     # 16 interpreters starting on a loaded CI machine
    assert result.status == STATUS_OK, result.stderr
    assert int(result.stdout.strip()) < sandbox.config.max_processes
    assert_no_survivors(marker)


# Protection: RLIMIT_NPROC + wall clock + PID-namespace teardown; the host keeps working. The
# bomb is bounded (10 doublings: at most 1,024 processes) so that a weakened sandbox cannot
# exhaust the host's PIDs; test_fork_count_is_capped_and_children_die checks the cap itself.
def test_fork_bomb_is_contained(sandbox, limits_in_effect):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    program = ("import os, time\nfor _ in range(10):\n    try:\n        os.fork()\n    except OSError:\n"
               "        pass\ntime.sleep(30)\n")
    result = sandbox.run(program, argv=[marker], timeout_s=1.5)
    assert result.status == STATUS_TIMEOUT
    assert_no_survivors(marker)
    assert subprocess.run(["true"]).returncode == 0            # we can still start processes
    assert sandbox.run("print('after')").stdout == "after\n"


# Protection: RLIMIT_AS (256 MiB here). Weakened, the program stops itself at 1.5 GiB. The run gets
# 10 s of CPU instead of 2: on a loaded machine, faulting in and zero-filling 256 MiB has taken over
# 2 s of CPU (page reclaim is charged to the program), and the CPU limit then fired first
# (status cpu_limit), which says nothing about the memory limit this test is for.
def test_unbounded_allocation_fails(sandbox, limits_in_effect):
    program = ("chunks = []\nfor _ in range(150):\n    chunks.append(bytearray(10 * 2**20))\n"
               "print('ALLOCATED 1.5 GiB')\n")
    generous_cpu = Sandbox(dataclasses.replace(sandbox.config, cpu_time_s=10))
    result = generous_cpu.run(program, timeout_s=15.0)
    assert result.status == STATUS_ERROR, (result.status, result.wall_s)
    assert "MemoryError" in result.stderr
    assert "ALLOCATED" not in result.stdout


# Protection: RLIMIT_FSIZE on stdout (a file). Weakened, the program stops itself at 64 MiB.
def test_huge_output_is_capped(sandbox, limits_in_effect):
    program = "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 65536)\nprint('DONE')\n"
    result = sandbox.run(program)
    assert result.status == STATUS_OUTPUT_LIMIT
    assert len(result.stdout) <= sandbox.config.max_output_bytes
    assert "DONE" not in result.stdout


# Protection: the tmpfs working directory is size-limited and discarded.
def test_scratch_directory_is_limited_and_thrown_away(sandbox):
    program = """
import json, os
written = 0
try:
    for i in range(64):
        with open(f"f{i}", "wb") as f:
            f.write(b"y" * (512 * 1024))
        written += 512 * 1024
except OSError as err:
    error = err.errno
else:
    error = None
print(json.dumps({"written": written, "error": error, "cwd": os.getcwd()}))
"""
    result = sandbox.run(program)
    report = last_json(result.stdout)
    assert report["error"] == errno.ENOSPC
    assert report["written"] <= sandbox.config.scratch_bytes
    leftover = sandbox.run("import os\nprint(sorted(os.listdir('.')))")
    assert leftover.stdout.strip() == "[]"                     # a fresh directory each run


# Protection: seccomp refuses every socket (no network at all, not even the network namespace's
# own loopback, whose TCP buffers would be host memory; no AF_UNIX buffers outside the memory
# cgroup); the network namespace too.
def test_network_is_unreachable(sandbox):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    program = f"""
import json, socket
report = {{}}
for name, family, kind in (("inet", socket.AF_INET, socket.SOCK_STREAM), ("inet6", socket.AF_INET6, socket.SOCK_DGRAM),
                           ("netlink", socket.AF_NETLINK, socket.SOCK_RAW), ("packet", socket.AF_PACKET, socket.SOCK_RAW)):
    try:
        sock = socket.socket(family, kind)
        sock.settimeout(2.0)
        sock.connect(("127.0.0.1", {port})) if family == socket.AF_INET else None
        report[name] = "created"
    except OSError as err:
        report[name] = err.errno
try:
    socket.socketpair()
    report["unix"] = "created"
except OSError as err:
    report["unix"] = err.errno
print(json.dumps(report))
"""
    try:
        result = sandbox.run(program)
        report = last_json(result.stdout)
        with pytest.raises(BlockingIOError):
            listener.accept()                                   # nobody reached our listener
    finally:
        listener.close()
    assert report == {"inet": errno.EPERM, "inet6": errno.EPERM, "netlink": errno.EPERM, "packet": errno.EPERM,
                      "unix": errno.EPERM}


# Protection: mount namespace (host paths absent, /usr and /code read-only) and the uid drop.
def test_files_outside_cannot_be_read_or_written(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)                                    # readable by anyone on the host
    sandbox_sha = _sha256(SANDBOX_SOURCE)
    tag = uuid.uuid4().hex
    targets_to_write = [str(secret), str(tmp_path / "new.txt"), os.path.join(PROJECT_ROOT, f"pwned-{tag}"),
                        f"/tmp/pwned-{tag}", f"/usr/pwned-{tag}", "/code/program.py", "/proc/sys/kernel/hostname"]
    program = f"""
import json
report = {{"read": {{}}, "write": {{}}}}
for path in {[SANDBOX_SOURCE, str(secret), "/etc/passwd", "/root/.bashrc"]!r}:
    try:
        with open(path) as f:
            report["read"][path] = f.read(100)
    except OSError as err:
        report["read"][path] = type(err).__name__
for path in {targets_to_write!r}:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        report["write"][path] = "WROTE"
    except OSError as err:
        report["write"][path] = type(err).__name__
print(json.dumps(report))
"""
    result = sandbox.run(program)
    report = last_json(result.stdout)
    for path, outcome in report["read"].items():
        assert outcome in ("FileNotFoundError", "PermissionError"), (path, outcome)
    for path, outcome in report["write"].items():
        assert outcome != "WROTE", path
    assert secret.read_text() == "SECRET-CONTENT"
    assert not (tmp_path / "new.txt").exists()
    leaked = [p for p in targets_to_write if tag in p and os.path.exists(p)]
    for path in leaked:
        os.remove(path)
    assert not leaked
    assert _sha256(SANDBOX_SOURCE) == sandbox_sha


# Protection: PID namespace (the trainer is invisible; the sandbox's init ignores kill).
def test_killing_the_parent_and_the_trainer_is_contained(sandbox):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        program = f"""
import json, os, signal
report = {{"ppid": os.getppid()}}
for name, pid, sig in (("parent", os.getppid(), signal.SIGKILL), ("trainer", {os.getpid()}, signal.SIGUSR1)):
    try:
        os.kill(pid, sig)
        report[name] = "sent"
    except OSError as err:
        report[name] = type(err).__name__
print(json.dumps(report))
"""
        result = sandbox.run(program)
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not received, "the sandboxed program signalled the test process"
    report = last_json(result.stdout)
    assert report["trainer"] == "ProcessLookupError"          # not even visible
    assert report["ppid"] == 1                                # its parent is the sandbox's own init
    assert result.status == STATUS_OK
    assert sandbox.run("print('still working')").stdout == "still working\n"


# Protection: PID namespace + --die-with-parent + killpg: nothing outlives the sandbox, even
# a child that left the process group with setsid(), whether the parent exits or times out.
@pytest.mark.parametrize("parent_behaviour", ["exits", "hangs"])
def test_children_do_not_outlive_the_sandbox(sandbox, parent_behaviour):
    marker = f"orphan-{uuid.uuid4().hex}"
    program = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    os._exit(0)
time.sleep(0.3)
print("parent done", flush=True)
if {parent_behaviour == "hangs"}:
    time.sleep(1000)
"""
    result = sandbox.run(program, timeout_s=1.5)
    assert result.status == (STATUS_OK if parent_behaviour == "exits" else STATUS_TIMEOUT)
    assert "parent done" in result.stdout
    assert_no_survivors(marker)


def test_hostile_programs_do_not_affect_the_rest_of_the_batch(sandbox, limits_in_effect):
    problem = {"id": "add", "benchmark": "fixture", "prompt": "add", "answer": "",
               "tests": {"kind": "stdio", "cases": [{"input": "2 3\n", "output": "5\n"},
                                                    {"input": "10 -4\n", "output": "6\n"}]}}
    correct = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    hostile = [
        "```python\nimport os, time\nfor _ in range(10):\n    try:\n        os.fork()\n    except OSError:\n"
        "        pass\ntime.sleep(30)\n```",
        "```python\nwhile True:\n    pass\n```",
        "```python\nimport sys\nwhile True:\n    sys.stdout.write('5\\n' * 10000)\n```",
        "```python\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n```",
        "```python\nx = bytearray(2**31)\n```",
    ]
    responses = [hostile[0], correct, hostile[1], correct, hostile[2], hostile[3], correct, hostile[4]]
    verifier = CodeVerifier(sandbox=sandbox, num_workers=2)
    scores = verifier.score_batch([problem] * len(responses), responses)
    assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
