"""``scripts/gpu_check.sh``, the first thing a user runs on a new cluster, runs its own sequence here
with the real engine (vLLM's CPU build) and the device forced to the CPU: the engine probe
(construction, push, decode), the vLLM backend with its push check, the megatron backend (each 2
steps, then a resumed 3rd), the report's assertions and its phases (the HF round trip: the .venv
test in tests/conversion/test_gpu_check_smoke.py)."""
from __future__ import annotations

import pytest

from tests.conversion.test_gpu_check_smoke import gpu_check

pytestmark = pytest.mark.slow


def test_gpu_check_passes_every_part_with_the_real_engine(tmp_path):
    done, result = gpu_check(tmp_path, "engine vllm megatron")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert result["failures"] == [] and result["skipped"] == {}
    parts = result["parts"]
    assert all(check["ok"] for part in parts.values() for check in part["checks"])

    engine = parts["engine"]["figures"]
    assert engine["sleep_mode"] is False and "sleep_s" not in engine   # the CPU build has no sleep mode
    assert engine["construction_s"] > 0 and engine["push_s"] > 0 and engine["push_log"]
    assert engine["vllm_log_messages"] > 0   # vLLM's log reaches the probe (its sleep line on a GPU)
    assert {n: d["tokens"] for n, d in engine["decode"].items()} == {"4": 4 * 8, "8": 8 * 8}

    for backend in ("vllm", "megatron"):
        run = parts[backend]
        assert run["steps"] == [1, 2, 3] and run["peak_gpu_memory_gb"] is None  # no nvidia-smi here
        names = [check["check"] for check in run["checks"]]
        assert "resumed at step 2" in names and "engine gap logged" in names
        # every phase of the plan measured: seconds, and the host's peak (no CUDA here)
        for phase in ("startup", "resume", "rollout", "train", "eval", "save"):
            figures = run["phases"][phase]
            assert figures["seconds"] and all(s >= 0 for s in figures["seconds"]), (backend, phase)
            assert figures["host_peak_gb"] > 0.1 and "peak_allocated_gb" not in figures, (backend, phase)
        assert len(run["phases"]["startup"]["seconds"]) == 2 and len(run["phases"]["resume"]["seconds"]) == 1
    assert "push check logged" in [check["check"] for check in parts["vllm"]["checks"]]
    assert parts["vllm"]["per_step"][-1]["offload_s"] >= 0   # the training state's round trip around vLLM
    log = (tmp_path / "check" / "vllm.log").read_text()
    assert "has no sleep mode" in log  # the real CPU engine, not a stand-in
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "commands.tsv", "engine.log", "env.log", "gpu_check.json", "megatron.log", "vllm.log"]
