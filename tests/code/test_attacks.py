"""Adversarial suite of issue 17: programs that try to forge a reward, outlive their limits, grow
the host's memory, or read the trainer's secrets, each asserting the promise it attacks.

The forgery programs (attacks.py) score 1.0 against the harness of commit 5ddab4b, where the
tests ran in the program's interpreter (all but the stdin/stdout scan, whose verdict was already
computed outside); the other attacks each fail when the protection named above them is removed
(docs/sandbox.md lists the mutations that were run).
"""
import ctypes
import dataclasses
import errno
import json
import os
import uuid

import pytest
from attacks import forgery_cases
from host_checks import ShmemPeak, assert_no_survivors, last_json

from quatro_nemo.data.code_datasets import DATASETS
from quatro_nemo.rewards import seccomp_filter
from quatro_nemo.rewards.code import CodeVerifier, stdio_output_matches
from quatro_nemo.rewards.sandbox import STATUS_CPU_LIMIT, STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, Sandbox

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "code")
FORGERIES = forgery_cases()
# A verdict, not a limit: a forgery that merely timed out would prove nothing.
VERDICT_STATUSES = {"wrong_answer", "error", "no_result"}


@pytest.fixture(scope="module")
def patient_sandbox(sandbox):
    """The session's limits with a wall clock that survives a loaded CI machine."""
    return Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=15.0), self_check=False)


@pytest.fixture(scope="module")
def forgery_grades(patient_sandbox):
    with open(os.path.join(FIXTURES, "hub_rows.json")) as f:
        rows = json.load(f)
    problems = [DATASETS[dataset].convert_row(rows[dataset][row], row) for _, dataset, row, _ in FORGERIES]
    verifier = CodeVerifier(sandbox=patient_sandbox, reward="fraction", num_workers=2)
    grades = verifier.grade_batch(problems, [response for *_, response in FORGERIES], stop_on_failure=False)
    return {name: grade for (name, *_), grade in zip(FORGERIES, grades)}


# Protection: the judge / plain-data design (tests and verdict out of the program's reach).
@pytest.mark.parametrize("name", [name for name, *_ in FORGERIES])
def test_forged_reward_is_zero(forgery_grades, name):
    grade = forgery_grades[name]
    assert grade.passed == 0, grade.statuses
    assert set(grade.statuses) <= VERDICT_STATUSES, grade.statuses


_PID1_ESCAPE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
report = {}
for name, request in (("attach", 16), ("seize", 0x4206)):          # PTRACE_ATTACH, PTRACE_SEIZE
    result = libc.ptrace(request, 1, 0, 0)
    report["ptrace_" + name] = 0 if result == 0 else ctypes.get_errno()
for path in ("/proc/1/mem", "/proc/1/fd/0", "/proc/1/environ"):
    try:
        os.close(os.open(path, os.O_RDWR if path.endswith("mem") else os.O_RDONLY))
        report[path] = "opened"
    except OSError as err:
        report[path] = err.errno
if os.fork() == 0:                 # a child that would outlive a PID 1 it had stopped
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
print(json.dumps(report), flush=True)
"""


# Protection: seccomp denies ptrace; PID 1 is an execute-only binary, hence non-dumpable, which
# denies ptrace and /proc/1/{mem,fd,environ} on its own. With a readable PID 1 and no filter the
# attach succeeds, PID 1 stops, and the call hangs until the timeout.
def test_pid1_cannot_be_traced_or_written(sandbox):
    marker = f"pid1-{uuid.uuid4().hex}"
    result = sandbox.run(_PID1_ESCAPE, argv=[marker])
    assert result.status == STATUS_OK, result.stderr
    report = last_json(result.stdout)
    assert report == {"ptrace_attach": errno.EPERM, "ptrace_seize": errno.EPERM, "/proc/1/mem": errno.EACCES,
                      "/proc/1/fd/0": errno.EACCES, "/proc/1/environ": errno.EACCES}
    assert_no_survivors(marker, grace_s=0.0)


# Protection: on timeout the sandbox's PID 1 is SIGKILLed through a pidfd. Here bwrap's
# --die-with-parent is taken away, so nothing else would kill PID 1 once bwrap is gone; the
# process table is read the moment run() returns.
def test_teardown_does_not_need_the_parent_death_signal(sandbox, monkeypatch):
    weakened = Sandbox(sandbox.config, self_check=False)
    original = weakened._bwrap_args
    monkeypatch.setattr(weakened, "_bwrap_args",
                        lambda *a: [arg for arg in original(*a) if arg != "--die-with-parent"])
    marker = f"teardown-{uuid.uuid4().hex}"
    program = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
               "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])\n"
               "time.sleep(60)\n")
    result = weakened.run(program, argv=[marker], timeout_s=1.5)
    assert result.status == STATUS_TIMEOUT
    assert result.wall_s < 1.5 + 5.0                   # killed on time, not when the program ended
    assert_no_survivors(marker, grace_s=0.0)


_SYSCALL_PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
report = {}
for name, number in json.loads(sys.argv[1]).items():
    result = libc.syscall(number, 0, 0, 0, 0, 0, 0)
    report[name] = 0 if result >= 0 else ctypes.get_errno()
print(json.dumps(report))
"""


# Protection: each entry of the seccomp filter (arguments are zeros: harmless if allowed).
def test_denied_syscalls_fail_with_eperm(sandbox):
    numbers = {name: number for name, number in seccomp_filter.syscall_numbers().items()
               if name in seccomp_filter.DENIED_SYSCALLS}
    result = sandbox.run(_SYSCALL_PROBE, argv=[json.dumps(numbers)])
    assert last_json(result.stdout) == {name: errno.EPERM for name in numbers}


_FILL = """
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
chunk = b"x" * (1 << 20)
report = {}
for target in ("/", "/dev", "/dev/shm", "/tmp", "/sandbox"):
    written, error = 0, None
    try:
        while written < (256 << 20):                 # bounded: a weakened sandbox stops here
            with open(f"{target.rstrip('/')}/fill{target.replace('/', '_')}{written >> 20}", "wb") as f:
                f.write(chunk)
            written += len(chunk)
    except OSError as err:
        error = err.errno
    report[target] = [written, error]
segments, errors = 0, set()
for _ in range(4):                                   # SysV shared memory: 4 x 64 MiB, touched
    shmid = libc.shmget(0, 64 << 20, 0o1600)         # IPC_PRIVATE, IPC_CREAT | 0600
    if shmid < 0:
        errors.add(ctypes.get_errno())
        continue
    libc.shmat.restype = ctypes.c_void_p
    address = libc.shmat(shmid, None, 0)
    ctypes.memset(address, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(address))             # detached, the segment stays in the namespace
    segments += 1
report["sysv"] = [segments, sorted(errors)]
print(json.dumps(report), flush=True)
time.sleep(1.0)                                      # hold it while the host looks
"""


# Protection: / and /dev remounted read-only, /dev/shm and /sandbox one sized tmpfs, no /tmp,
# SysV IPC denied by seccomp. The host's Shmem (tmpfs + shared memory) is watched meanwhile.
def test_writable_mounts_and_shared_memory_are_bounded(sandbox, limits_in_effect):
    cfg = sandbox.config
    with ShmemPeak() as shmem:
        result = sandbox.run(_FILL, timeout_s=30.0)
    report = last_json(result.stdout)
    assert report["/"][0] == 0 and report["/dev"][0] == 0, report
    assert report["/tmp"][0] == 0, report
    # /dev/shm and /sandbox are one tmpfs: one budget for both
    assert report["/dev/shm"][1] == errno.ENOSPC and report["/sandbox"][1] == errno.ENOSPC, report
    assert report["/dev/shm"][0] + report["/sandbox"][0] <= cfg.scratch_bytes, report
    assert report["sysv"] == [0, [errno.EPERM]], report
    # All writes together stay under the mount's size (+ slack for the rest of the machine).
    assert shmem.peak_growth < cfg.scratch_bytes + (128 << 20), shmem.peak_growth


_KEYCTL, _ADD_KEY = seccomp_filter.syscall_numbers()["keyctl"], seccomp_filter.syscall_numbers()["add_key"]
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_READ, _KEYCTL_REVOKE = 1, 11, 3
_KEY_SPEC_SESSION_KEYRING = -3

_KEYRING_READ = f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
buffer = ctypes.create_string_buffer(1 << 16)
found, errors = [], set()
size = libc.syscall({_KEYCTL}, {_KEYCTL_READ}, {_KEY_SPEC_SESSION_KEYRING}, buffer, 1 << 16)
if size < 0:
    errors.add(ctypes.get_errno())
key_ids = list(ctypes.cast(buffer, ctypes.POINTER(ctypes.c_int32))[:max(size, 0) // 4])
for key_id in key_ids:
    size = libc.syscall({_KEYCTL}, {_KEYCTL_READ}, key_id, buffer, 1 << 16)
    if size >= 0:
        found.append(buffer.raw[:size].decode(errors="replace"))
print(json.dumps({{"found": found, "errors": sorted(errors)}}))
"""


# Protection: keyctl/add_key/request_key denied by seccomp. The trainer joins a fresh session
# keyring holding a secret; uid changes keep the keyring "possessed", so without the filter the
# sandbox reads it.
def test_session_keyring_is_not_readable(sandbox):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        pytest.skip(f"keyrings unavailable on this host (errno {ctypes.get_errno()}): nothing to leak")
    secret = f"SECRET-{uuid.uuid4().hex}"
    key_id = libc.syscall(_ADD_KEY, b"user", b"quatro-test", secret.encode(), len(secret), _KEY_SPEC_SESSION_KEYRING)
    assert key_id > 0, ctypes.get_errno()
    try:
        result = sandbox.run(_KEYRING_READ)
    finally:
        libc.syscall(_KEYCTL, _KEYCTL_REVOKE, key_id)
    assert secret not in result.stdout + result.stderr
    assert last_json(result.stdout) == {"found": [], "errors": [errno.EPERM]}


def _stdio_problem(expected_output: str):
    return {"id": "echo", "tests": {"kind": "stdio", "cases": [{"input": "", "output": expected_output}]}}


# Protection: integers compared exactly, decimals only when the expected answer is one; no
# Python-only numeric syntax.
@pytest.mark.parametrize("expected, printed, reward", [
    ("1000000007\n", "1000000000", 0.0),        # within 1e-6 relative: no longer accepted
    ("1000\n", "1_000", 0.0),                   # float("1_000") == 1000.0
    ("255\n", "0xff", 0.0),
    ("7\n", "7.0", 0.0),                        # an integer answer is not a float
    ("inf\n", "infinity", 0.0),
    ("0.333333333\n", "0.3333333333", 1.0),     # decimals keep their tolerance
    ("12 -5\n", "12 -5.0000000001", 0.0),
    ("1e-3\n", "0.001", 1.0),
])
def test_stdio_numbers_are_not_loosely_equal(expected, printed, reward):
    assert stdio_output_matches(printed + "\n", expected) == (reward == 1.0)


def test_stdio_integer_tolerance_attack_scores_zero(sandbox):
    verifier = CodeVerifier(sandbox=sandbox)
    responses = ["```python\nprint(1000000000)\n```", "```python\nprint('1_000_000_007')\n```",
                 "```python\nprint(1000000007)\n```"]
    assert verifier.score_batch([_stdio_problem("1000000007\n")] * 3, responses) == [0.0, 0.0, 1.0]


# Protection: statuses come from the CPU accounting and the output files' sizes, not from
# signals a program can choose or text it can print.
def test_status_reports_the_limit_that_stopped_the_program(sandbox, limits_in_effect):
    ignoring_sigxcpu = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    result = sandbox.run(ignoring_sigxcpu, timeout_s=60.0)
    assert result.status == STATUS_CPU_LIMIT, (result.status, result.cpu_s)
    assert result.cpu_s >= sandbox.config.cpu_time_s
    fake_efbig = "import sys\nsys.stderr.write('OSError: [Errno 27] File too large\\n')\nsys.exit(1)\n"
    assert sandbox.run(fake_efbig).status == STATUS_ERROR
