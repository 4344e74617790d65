"""scripts/gpu_check.py --cpu-smoke: the prepared GPU check's code paths at toy sizes on the CPU,
so the script cannot rot between GPU sessions."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_check():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("GPU_CHECK_RESULT ")][-1]
    result = json.loads(line[len("GPU_CHECK_RESULT "):])
    assert result["failures"] == []
    assert result["checks"]["hf_conversion"]["ok"] is True
    assert result["checks"]["quatro_steps"]["finite_loss"] is True
    assert result["checks"]["packing"]["ok"] is True  # token budget vs padded (no THD without TE)
