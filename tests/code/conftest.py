"""Shared fixtures of the code-execution tests: one sandbox per test session.

These tests need bubblewrap (`apt-get install bubblewrap`) and, for HumanEval+/MBPP+ fixtures,
numpy for the sandbox's interpreter (`apt-get install python3-numpy`). Without bubblewrap they
fail with a clear message instead of silently skipping the security checks; set
QUATRO_SKIP_SANDBOX_TESTS=1 to skip them deliberately on a host that cannot run the sandbox.
"""
import os
import shutil

import pytest
from host_checks import last_json

from quatro_nemo.rewards.sandbox import PID1_PATH, Sandbox, SandboxConfig


def _require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.environ.get("QUATRO_SKIP_SANDBOX_TESTS") == "1":
            pytest.skip("bubblewrap missing and QUATRO_SKIP_SANDBOX_TESTS=1")
        pytest.fail("bubblewrap (bwrap) is not installed: apt-get install bubblewrap (see docs/sandbox.md)")


# Tight limits keep the hostile programs quick and cheap on a shared 2-core machine.
TEST_LIMITS = SandboxConfig(wall_timeout_s=3.0, cpu_time_s=2, memory_bytes=256 << 20,
                            max_output_bytes=1 << 20, max_processes=16, scratch_bytes=8 << 20)


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    _require_bwrap()
    return Sandbox(TEST_LIMITS)


_LIMITS_PROBE = """
import json, os
limits = {}
with open("/proc/self/limits") as f:
    for line in f.readlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        limits[name] = soft
print(json.dumps({"limits": limits, "pid1": open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode(),
                  "visible_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""


@pytest.fixture(scope="module")
def limits_in_effect(sandbox):
    """Checked before any program that would hurt the host if a limit were missing (fork bombs,
    huge allocations, huge output): a weakened sandbox fails here and the hostile program never
    runs. Reads the kernel's view of the limits from inside the sandbox."""
    report = last_json(sandbox.run(_LIMITS_PROBE).stdout)
    limits, cfg = report["limits"], sandbox.config
    problems = []
    if limits.get("Max processes") != str(cfg.max_processes):
        problems.append(f"RLIMIT_NPROC is {limits.get('Max processes')}")
    if limits.get("Max address space") != str(cfg.memory_bytes):
        problems.append(f"RLIMIT_AS is {limits.get('Max address space')}")
    if limits.get("Max file size") != str(cfg.max_output_bytes + 1):
        problems.append(f"RLIMIT_FSIZE is {limits.get('Max file size')}")
    if report["pid1"] != PID1_PATH or len(report["visible_pids"]) > 3:
        problems.append(f"not in a fresh PID namespace (pid 1 {report['pid1']!r}, {len(report['visible_pids'])} pids)")
    if problems:
        pytest.fail("sandbox weakened, refusing to run hostile programs: " + "; ".join(problems))
    return limits
