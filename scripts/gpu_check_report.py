#!/usr/bin/env python
"""The summary of scripts/gpu_check.sh: per backend, what recipes/train.py logged against what
recipes/plan_memory.py predicted.

    python scripts/gpu_check_report.py CHECK_DIR BACKEND...

Reads ``CHECK_DIR/plan.json`` (plan_memory.py --json), and per backend ``CHECK_DIR/BACKEND/``
(the run directory: config.yaml, metrics.jsonl), ``CHECK_DIR/BACKEND.log`` (both train.py
commands) and ``CHECK_DIR/BACKEND.steps*.memory`` (nvidia-smi samples, MiB; absent without a
GPU). A backend passes when its run logged steps 1, 2, 3 and the second command resumed at step 2.
Prints a table and one ``GPU_CHECK_RESULT {json}`` line (also written to ``$OUT/gpu_check.json``
when ``$OUT`` is set). Exit code 0 when every backend passed.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from quatro_nemo.engine.logging import read_metrics  # noqa: E402

EXPECTED_STEPS = [1, 2, 3]
RESUME_BANNER = "steps 2->3"  # recipes/train.py's start line of the second command


def peak_memory_gb(check_dir: str, backend: str) -> Optional[float]:
    """Highest nvidia-smi ``memory.used`` sample of the backend's commands, in GB (1e9 bytes)."""
    samples = []
    for path in glob.glob(os.path.join(check_dir, f"{backend}.steps*.memory")):
        with open(path) as handle:
            samples.extend(float(line) for line in handle if line.strip())
    return max(samples) * 2**20 / 1e9 if samples else None


def step_figures(record: Dict[str, Any], sequences: int) -> Dict[str, float]:
    """Step time and tokens/s of one logged training step (generated tokens = sequences x mean
    response length); with vLLM, the seconds its rollout spent moving the training state to the
    (pinned, on a GPU) host buffers and back (``time/offload``, ``time/reload``)."""
    generated = sequences * record["response_length/mean"]
    figures = {"step": record["step"], "step_s": record["time/step"], "rollout_s": record["time/rollout"],
               "update_s": record["time/update"], "generated_tokens": generated,
               "rollout_tokens_per_s": generated / record["time/rollout"],
               "step_tokens_per_s": generated / record["time/step"]}
    if "time/offload" in record:
        figures.update(offload_s=record["time/offload"], reload_s=record["time/reload"])
    return figures


def backend_result(check_dir: str, backend: str) -> Dict[str, Any]:
    run_dir = os.path.join(check_dir, backend)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    train = [r for r in read_metrics(metrics_path) if r["kind"] == "train"] if os.path.exists(metrics_path) else []
    log_path = os.path.join(check_dir, f"{backend}.log")
    log = open(log_path).read() if os.path.exists(log_path) else ""
    result: Dict[str, Any] = {"steps": [r["step"] for r in train], "resumed": RESUME_BANNER in log,
                              "peak_gpu_memory_gb": peak_memory_gb(check_dir, backend)}
    if train:
        config = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
        sequences = int(config.trainer.prompts_per_step) * int(config.rollout.n)
        result["per_step"] = [step_figures(r, sequences) for r in train]
    result["ok"] = result["steps"] == EXPECTED_STEPS and result["resumed"]
    return result


def format_table(results: Dict[str, Dict[str, Any]], plan: Dict[str, Any]) -> List[str]:
    lines = [f"planner (recipes/plan_memory.py): training phase {plan['train_phase_gb']:.2f} GB, "
             f"rollout phase with vLLM {plan['rollout_phase_gb']:.2f} GB of {plan['gpu_memory_gb']:.0f} GB"]
    for backend, result in results.items():
        if not result.get("per_step"):
            lines.append(f"{backend}: no training step logged (see {backend}.log)")
            continue
        last = result["per_step"][-1]  # the first step includes warm-up and compilation
        peak = result["peak_gpu_memory_gb"]
        offload = (f" | training state offload {last['offload_s']:.3f} s, reload {last['reload_s']:.3f} s"
                   if "offload_s" in last else "")
        lines.append(
            f"{backend}: steps {result['steps']} resumed={result['resumed']} | step {last['step']}: "
            f"{last['step_s']:.2f} s (rollout {last['rollout_s']:.2f} s, update {last['update_s']:.2f} s), "
            f"{last['rollout_tokens_per_s']:.0f} generated tokens/s in rollout, {last['step_tokens_per_s']:.0f} per "
            f"step | peak GPU memory {'n/a (no nvidia-smi)' if peak is None else f'{peak:.2f} GB'}{offload}")
    return lines


def main(argv: List[str]) -> int:
    if not argv:
        raise SystemExit("usage: gpu_check_report.py CHECK_DIR [BACKEND ...]")
    check_dir, backends = argv[0], argv[1:]
    with open(os.path.join(check_dir, "plan.json")) as handle:
        plan = json.load(handle)
    results = {backend: backend_result(check_dir, backend) for backend in backends}
    skipped = {os.path.basename(p)[:-len(".skipped")]: open(p).read().strip()
               for p in glob.glob(os.path.join(check_dir, "*.skipped"))}
    for line in format_table(results, plan):
        print(f"[gpu_check] {line}")
    for backend, reason in skipped.items():
        print(f"[gpu_check] {backend}: skipped ({reason})")
    summary = {"plan": {k: plan[k] for k in ("train_phase_gb", "rollout_phase_gb", "gpu_memory_gb")},
               "backends": results, "skipped": skipped,
               "failures": sorted(b for b, r in results.items() if not r["ok"]) or ([] if results else ["no backend ran"])}
    line = json.dumps(summary)
    print("GPU_CHECK_RESULT " + line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as handle:
            handle.write(line)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
