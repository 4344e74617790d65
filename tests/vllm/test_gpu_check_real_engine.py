"""``scripts/gpu_check.sh``, the first thing a user runs on a new cluster, runs its own sequence here
with the real engine (vLLM's CPU build) and the device forced to the CPU: for the megatron and
vLLM backends, recipes/train.py for 2 steps, then again for 3 (resuming from the step-2
checkpoint), the planner's figures beside the measurements (with vLLM, the training state's
offload/reload seconds), and the summary line."""
from __future__ import annotations

import pytest

from tests.conversion.test_gpu_check_smoke import gpu_check

pytestmark = pytest.mark.slow


def test_gpu_check_trains_resumes_and_reports_both_backends_with_the_real_engine(tmp_path):
    done, result = gpu_check(tmp_path, backends="megatron vllm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert result["failures"] == [] and result["skipped"] == {}
    assert result["plan"]["train_phase_gb"] > 0 and result["plan"]["rollout_phase_gb"] > 0
    for backend in ("megatron", "vllm"):
        run = result["backends"][backend]
        assert run["steps"] == [1, 2, 3] and run["resumed"] is True
        assert run["peak_gpu_memory_gb"] is None  # no nvidia-smi here
        for step in run["per_step"]:
            assert step["generated_tokens"] > 0 and step["rollout_tokens_per_s"] > 0 and step["step_s"] > 0
            # the training state's round trip around vLLM's rollouts (resumed runs included)
            assert (step["offload_s"] >= 0 and step["reload_s"] >= 0) if backend == "vllm" else "offload_s" not in step
    assert "vllm: steps [1, 2, 3]" in done.stdout and "training state offload" in done.stdout
    log = (tmp_path / "check" / "vllm.log").read_text()
    assert "steps 2->3" in log  # the second command resumed
    assert "has no sleep mode" in log  # the real CPU engine, not a stand-in
