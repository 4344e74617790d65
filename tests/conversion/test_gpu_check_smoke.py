"""scripts/gpu_check.sh on the CPU: the script itself (its parts, budget, skips and summary) with a
tiny Qwen2 and ``trainer.device=cpu``, so it cannot rot between GPU sessions; its report's
assertions fail on hand-made runs that a wrong engine would leave. The real engine (vLLM's CPU
build) runs its vLLM parts in tests/vllm/test_gpu_check_real_engine.py; here, where ``vllm`` does not
import, they are skipped cleanly."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A tiny Qwen2 with 64-wide heads (vLLM's CPU attention kernel refuses smaller ones) and an
# explicit KV cache (the CPU build would take half the machine's free memory). Full recompute
# (conf/gpu_check.yaml's, the 7B config's) does not run on the CPU: megatron's recompute replays
# the forward inside backward, where get_default_causal_mask allocates on "cuda" past the CPU shim.
TINY_CPU = ["trainer.device=cpu", "model.vocab_size=32", "model.hidden_size=128", "model.num_layers=2",
            "model.num_attention_heads=2", "model.num_query_groups=2", "model.ffn_hidden_size=256",
            "model.max_position_embeddings=64", "model.params_dtype=float32", "trainer.prompts_per_step=4",
            "rollout.n=2", "rollout.max_new_tokens=8", "eval.num_problems=2", "eval.n_samples=2",
            "parallel.micro_batch_size=4", "vllm.kv_cache_memory_gb=0.25", "vllm.enforce_eager=true",
            "model.extra.recompute_granularity=null", "model.extra.recompute_method=null",
            "model.extra.recompute_num_layers=null"]


def gpu_check(tmp_path, parts, **extra_env):
    """Run the script with GPU_CHECK_PARTS=parts; (the finished process, the GPU_CHECK_RESULT)."""
    # the script runs in the test's own environment (.venv, or .venv-cluster where vLLM is)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_DIR": str(tmp_path / "check"), "PYTHON": sys.executable,
           "GPU_CHECK_PARTS": parts, "GPU_CHECK_DECODE_SEQUENCES": "4 8", "GPU_CHECK_DECODE_TOKENS": "8",
           "OUT": str(tmp_path / "out"), **extra_env}
    env.pop("PYTHONPATH", None)
    os.makedirs(env["OUT"], exist_ok=True)
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *TINY_CPU],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
    result = json.loads(lines[-1][len("GPU_CHECK_RESULT "):]) if lines else None
    return done, result


@pytest.mark.slow
def test_gpu_check_skips_the_vllm_parts_cleanly_and_runs_the_hf_round_trip(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, env={"PATH": os.environ["PATH"]})
    if probe.returncode == 0:
        pytest.skip("vllm is installed here")
    done, result = gpu_check(tmp_path, "engine vllm hf")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for part in ("engine", "vllm"):
        assert f"[gpu_check] {part}: skipped (vllm is not importable)" in done.stdout
    assert result["skipped"] == {"engine": "vllm is not importable", "vllm": "vllm is not importable"}
    assert result["failures"] == [] and list(result["parts"]) == ["hf"]
    hf = result["parts"]["hf"]["figures"]
    assert hf["ok"] and hf["logits_rel_err"] < 1e-4 and hf["export_mismatches"] == [] and hf["device"] == "cpu"
    assert result["env"]["gpu"] == {"cuda_available": False} and "megatron-core" in result["env"]["versions"]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == result  # $OUT gets the summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["commands.tsv", "env.log", "gpu_check.json",
                                                                     "hf.log"]


@pytest.mark.slow
def test_gpu_check_fails_when_its_time_budget_is_spent(tmp_path):
    done, result = gpu_check(tmp_path, "packed megatron", GPU_CHECK_BUDGET_S="0")
    # Transformer Engine never imports on the CPU
    assert "[gpu_check] packed: skipped (transformer_engine is not importable (THD packing needs it))" in done.stdout
    assert "[gpu_check] megatron: out of time before train.py trainer.steps=2 (GPU_CHECK_BUDGET_S=0 spent)" \
        in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1 and result["failures"] == ["megatron"]
    assert result["parts"]["megatron"]["steps"] == [] and result["env"] is None   # no time even for the dump


# --------------------------------------------------------------------------------------------
# The report's assertions, on hand-made check folders (what a run with a wrong engine leaves)
# --------------------------------------------------------------------------------------------


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", os.path.join(ROOT, "scripts",
                                                                                    "gpu_check_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_record(step, gap=1e-3, ratio=1.0, push=None):
    record = {"step": step, "kind": "train", "response_length/mean": 8.0, "time/step": 2.0, "time/rollout": 1.0,
              "time/update": 0.5, "engine_gap/token_abs_mean": gap, "engine_gap/seq_ratio_mean": ratio,
              "optimizer_steps": 1, "grad_norm": 0.7}
    record.update({f"engine_push/{kind}_rel_err": value for kind, value in (push or {}).items()})
    return record


def _check_folder(tmp_path, part, train, log_lines=(), plan=None):
    """A check folder as scripts/gpu_check.sh leaves it after one part's two train.py commands."""
    folder = tmp_path / "check"
    (folder / part).mkdir(parents=True)
    (folder / "commands.tsv").write_text(f"{part}\ttrain.py trainer.steps=2\t10\t0\n"
                                         f"{part}\ttrain.py trainer.steps=3\t10\t0\n")
    (folder / part / "config.yaml").write_text("trainer: {prompts_per_step: 4}\nrollout: {n: 2}\n")
    phases = {"step": 3, "kind": "phases", "save/seconds": 2.5, "save/peak_allocated_gb": 3.0,
              "save/peak_reserved_gb": 4.0, "save/reserved_gb": 3.5, "save/device_used_gb": 5.0,
              "save/host_peak_gb": 9.0, "eval/seconds": 1.0, "eval/host_peak_gb": 8.0}   # eval: as on the CPU
    (folder / part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*train, phases]))
    (folder / f"{part}.log").write_text("\n".join(["[quatro] quatro | world 1 | steps 2->3 | run dir x",
                                                   *log_lines]))
    if plan is not None:
        (folder / f"{part}.plan.json").write_text(json.dumps(plan))
    return folder


def _failed_checks(module, folder, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    code = module.main([str(folder)])
    summary = json.loads((folder / "gpu_check.json").read_text())
    failed = [c["check"] for part in summary["parts"].values() for c in part["checks"] if not c["ok"]]
    return code, failed, summary


GOOD_PUSH = {"qkv": 3e-3, "gate_up": 3e-3, "logits": 2e-3}


def test_report_fails_when_no_part_ran(tmp_path, monkeypatch):
    folder = tmp_path / "check"
    folder.mkdir()
    (folder / "commands.tsv").write_text("env\tgpu_check_env.py\t12\t0\n")
    (folder / "packed.skipped").write_text("transformer_engine is not importable\n")
    code, failed, summary = _failed_checks(_report_module(), folder, monkeypatch)
    assert code == 1 and summary["failures"] == ["no part ran"] and summary["parts"] == {}
    assert summary["skipped"] == {"packed": "transformer_engine is not importable"}


def test_report_passes_a_clean_vllm_run_and_compares_its_phases_with_the_plan(tmp_path, monkeypatch):
    plan = {"train_phase_gb": 20.0, "phases": {"save": 10.0, "eval": 5.0}, "host_save_gb_per_rank": 12.0}
    # every reload warns about the rotary embedding's computed cos/sin cache (vLLM 0.32.0, seen on the CPU build)
    rotary = "WARNING 12-04 16:11:06 [layerwise.py:266] RotaryEmbedding: Failed to load weights"
    folder = _check_folder(tmp_path, "vllm", [_train_record(s, push=GOOD_PUSH) for s in (1, 2, 3)], [rotary], plan)
    code, failed, summary = _failed_checks(_report_module(), folder, monkeypatch)
    assert (code, failed, summary["failures"]) == (0, [], [])
    save = summary["parts"]["vllm"]["phases_vs_plan"]["save"]
    # the device's peak: torch's peak reserved (4) + what the device held outside it at the end (5 - 3.5)
    assert save["measured_gb"] == pytest.approx(5.5) and save["measured_over_planned"] == pytest.approx(0.55)
    assert (save["host_planned_gb"], save["host_measured_gb"]) == (12.0, 9.0)
    assert summary["parts"]["vllm"]["phases_vs_plan"]["resume"]["planned_gb"] is None   # "not planned"
    # a host's peak (no CUDA figures) is no GPU's: the planned GPU memory and it are not compared
    held_out = summary["parts"]["vllm"]["phases_vs_plan"]["eval"]
    assert (held_out["planned_gb"], held_out["measured_gb"], held_out["measured_on"]) == (5.0, 8.0, "host")
    assert "measured_over_planned" not in held_out


@pytest.mark.parametrize("train,log_lines,failure", [
    ([_train_record(s, gap=0.05 if s == 2 else 1e-3, push=GOOD_PUSH) for s in (1, 2, 3)], (),
     "engine_gap/token_abs_mean in [0.0, 0.03]"),
    ([_train_record(s, ratio=1.3, push=GOOD_PUSH) for s in (1, 2, 3)], (), "engine_gap/seq_ratio_mean in [0.9, 1.1]"),
    ([_train_record(s, push={**GOOD_PUSH, "gate_up": 1.4}) for s in (1, 2, 3)], (),
     "engine_push/*_rel_err < 0.02"),
    ([_train_record(s) for s in (1, 2, 3)], (), "push check logged"),
    ([_train_record(s, push=GOOD_PUSH) for s in (1, 2, 3)],
     ("WARNING 12-04 [layerwise.py:266] Qwen2ForCausalLM: Failed to load weights",), "no weight-load warning of vLLM"),
    ([_train_record(s, push=GOOD_PUSH) for s in (1, 2, 3)],
     ("WARNING [inplace.py:120] Following weights were not loaded from checkpoint: {'lm_head.weight'}",),
     "no weight-load warning of vLLM"),
    ([_train_record(s, push=GOOD_PUSH) for s in (1, 3)], (), "steps [1, 2, 3] logged"),
    ([{**_train_record(s, push=GOOD_PUSH), "optimizer_steps": 0, "grad_norm": None} for s in (1, 2, 3)], (),
     "an optimizer step every step, finite gradient norm"),
], ids=["token-gap", "sequence-ratio", "push-norms", "no-push-check", "failed-to-load", "not-loaded", "lost-step",
        "no-update"])
def test_report_fails_a_vllm_run_that_a_wrong_engine_would_leave(tmp_path, monkeypatch, train, log_lines, failure):
    folder = _check_folder(tmp_path, "vllm", train, log_lines)
    code, failed, summary = _failed_checks(_report_module(), folder, monkeypatch)
    assert code == 1 and summary["failures"] == ["vllm"] and failed == [failure]
