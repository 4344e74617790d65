"""scripts/gpu_check.sh on the CPU: the GPU check's own logic (recipes/train.py for each backend,
resume from its checkpoint, planner next to the measurements, the summary) with a tiny Qwen2 and
``trainer.device=cpu``, so the script cannot rot between GPU sessions. Its vLLM half runs the real
engine (vLLM's CPU build) in tests/vllm/test_gpu_check_real_engine.py; here, where ``vllm`` does
not import, it is skipped cleanly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A tiny Qwen2 with 64-wide heads (vLLM's CPU attention kernel refuses smaller ones) and an
# explicit KV cache (the CPU build would take half the machine's free memory).
TINY_CPU = ["trainer.device=cpu", "model.vocab_size=32", "model.hidden_size=128", "model.num_layers=2",
            "model.num_attention_heads=2", "model.num_query_groups=2", "model.ffn_hidden_size=256",
            "model.max_position_embeddings=64", "model.params_dtype=float32", "trainer.prompts_per_step=4",
            "rollout.n=2", "rollout.max_new_tokens=8", "eval.num_problems=2", "eval.n_samples=2",
            "parallel.micro_batch_size=4", "vllm.kv_cache_memory_gb=0.25", "vllm.enforce_eager=true"]


def gpu_check(tmp_path, backends=None, **extra_env):
    # the script runs in the test's own environment (.venv, or .venv-cluster where vLLM is)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_DIR": str(tmp_path / "check"), "PYTHON": sys.executable,
           **extra_env}
    env.pop("OUT", None)
    env.pop("PYTHONPATH", None)
    if backends:
        env["GPU_CHECK_BACKENDS"] = backends
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *TINY_CPU],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
    result = json.loads(lines[-1][len("GPU_CHECK_RESULT "):]) if lines else None
    return done, result


@pytest.mark.slow
def test_gpu_check_skips_the_vllm_half_cleanly_without_vllm(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, env={"PATH": os.environ["PATH"]})
    if probe.returncode == 0:
        pytest.skip("vllm is installed here")
    done, result = gpu_check(tmp_path, backends="vllm")
    assert "[gpu_check] vllm: skipped (vllm is not importable here)" in done.stdout, done.stdout + done.stderr
    assert result["skipped"] == {"vllm": "vllm is not importable"} and result["backends"] == {}
    assert done.returncode == 1 and result["failures"] == ["no backend ran"]


@pytest.mark.slow
def test_gpu_check_fails_when_its_time_budget_is_spent(tmp_path):
    done, result = gpu_check(tmp_path, backends="megatron", GPU_CHECK_BUDGET_S="0")
    assert "[gpu_check] megatron: out of time (GPU_CHECK_BUDGET_S=0 spent)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1 and result["failures"] == ["megatron"]
    assert result["backends"]["megatron"]["steps"] == []
