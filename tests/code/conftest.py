"""Shared fixtures of the code-execution tests: one sandbox per test session.

These tests need bubblewrap (`apt-get install bubblewrap`) and, for HumanEval+/MBPP+ fixtures,
numpy for the sandbox's interpreter (`apt-get install python3-numpy`). Without bubblewrap they
fail with a clear message instead of silently skipping the security checks; set
QUATRO_SKIP_SANDBOX_TESTS=1 to skip them deliberately on a host that cannot run the sandbox.
"""
import os
import shutil

import pytest

from quatro_nemo.rewards.sandbox import Sandbox, SandboxConfig


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
