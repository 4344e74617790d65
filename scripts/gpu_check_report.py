#!/usr/bin/env python
"""The verdict of scripts/gpu_check.sh: what each part measured, asserted, next to the plan.

    python scripts/gpu_check_report.py CHECK_DIR

Reads what the script left in ``CHECK_DIR``: ``commands.tsv`` (part, command, seconds, exit code of
every command), ``PART.skipped``, ``env.json``, ``engine.json``, ``hf.json`` and, per training part
(``vllm``, ``megatron``, ``packed``), its run directory ``PART/`` (config.yaml, metrics.jsonl),
``PART.log``, ``PART.plan.json`` (recipes/plan_memory.py) and ``PART.steps*.memory`` (nvidia-smi
samples, MiB). A part passes when each of its commands exited 0 and its checks hold:

- training parts: steps 1..N logged (N: the last command's ``trainer.steps``), the later command
  resumed, an optimizer step in every step with a finite gradient norm; every step's engine gap
  within :data:`ENGINE_GAP_LIMITS` (logged at least once); for ``vllm``, every push's
  ``engine_push/*_rel_err`` below :data:`PUSH_REL_ERR_MAX` (logged at least once) and no
  weight-load warning of vLLM (:data:`WEIGHT_LOAD_WARNING`) in its log about a layer with weights;
- ``engine``: the probe ran every stage and vLLM logged no weight-load warning during its push;
- ``hf``: the logits and the exported tensors matched (scripts/gpu_check_hf.py).

The run phases' figures (quatro_nemo/engine/phase_peaks.py) are printed next to the planner's
phases (``phases`` of the plan, GB per rank; "not planned" where the plan has none): reported, not
asserted. Prints one ``GPU_CHECK_RESULT {json}`` line (also ``CHECK_DIR/gpu_check.json``, and
``$OUT/gpu_check.json`` when ``$OUT`` is set). Exit code 0 when at least one part ran and every part
that ran passed.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from quatro_nemo.engine.logging import PHASES_KIND, read_metrics  # noqa: E402

TRAINING_PARTS = ("vllm", "megatron", "packed")
STEPS_LABEL = re.compile(r"trainer\.steps=(\d+)")
ENGINE_GAP_LIMITS = {"engine_gap/token_abs_mean": (0.0, 0.03), "engine_gap/seq_ratio_mean": (0.9, 1.1)}
PUSH_REL_ERR_MAX = 0.02
# vLLM's in-place reload (vllm/model_executor/model_loader/reload/layerwise.py and inplace.py, 0.32.0):
# "<layer class>: Failed to load weights" (a layer with loadable tensors received none: its previous
# tensors are put back) and "Following weights were not loaded from checkpoint: {...}".
WEIGHT_LOAD_WARNING = re.compile(r"(\w+): Failed to load weights|weights were not loaded")
# Layers whose only tensors are computed, never in a checkpoint: the rotary embeddings' cos/sin
# cache (a buffer vLLM counts as loadable; every reload warns about it and puts it back).
NO_CHECKPOINT_TENSORS = re.compile(r"\w*RotaryEmbedding")
PLANNED_PHASES = ("startup", "resume", "rollout", "train", "eval", "save")
GB = 1e9


def read_json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def read_commands(check_dir: str) -> List[Dict[str, Any]]:
    rows = []
    with open(os.path.join(check_dir, "commands.tsv")) as handle:
        for line in handle:
            part, label, seconds, code = line.rstrip("\n").split("\t")
            rows.append({"part": part, "command": label, "seconds": int(seconds), "exit_code": int(code)})
    return rows


def check(checks: List[Dict[str, Any]], name: str, ok: bool, detail: str = "") -> None:
    checks.append({"check": name, "ok": bool(ok), "detail": detail})


# --------------------------------------------------------------------------------------------
# Training parts
# --------------------------------------------------------------------------------------------


def peak_memory_gb(check_dir: str, part: str) -> Optional[float]:
    """Highest nvidia-smi ``memory.used`` sample of the part's commands, in GB (1e9 bytes)."""
    samples = []
    for path in glob.glob(os.path.join(check_dir, f"{part}.steps*.memory")):
        with open(path) as handle:
            samples.extend(float(line) for line in handle if line.strip())
    return max(samples) * 2**20 / GB if samples else None


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


def phase_figures(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per phase, over every ``phases`` record: its seconds each time, the largest peaks and
    ``device_peak_gb`` (torch's peak reserved plus what the device held outside torch's allocator
    at the phase's end: CUDA context, NCCL, vLLM's pool)."""
    phases: Dict[str, Dict[str, Any]] = {}
    for record in records:
        names = sorted({key.split("/")[0] for key in record if "/" in key})
        for name in names:
            figures = {key.split("/", 1)[1]: value for key, value in record.items() if key.startswith(name + "/")}
            into = phases.setdefault(name, {"seconds": []})
            into["seconds"].append(figures["seconds"])
            if "peak_reserved_gb" in figures:
                figures["device_peak_gb"] = (figures["peak_reserved_gb"] + figures["device_used_gb"]
                                             - figures["reserved_gb"])
            for key in ("peak_allocated_gb", "peak_reserved_gb", "device_peak_gb", "host_peak_gb"):
                if key in figures:
                    into[key] = max(into.get(key, 0.0), figures[key])
    return phases


def against_plan(phases: Dict[str, Dict[str, Any]], plan: Optional[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per planned phase: the planner's GPU GB per rank (None: "not planned") and the measured peak
    (the device's on CUDA, else the host's), with their ratio where both are the device's; for the
    save, the planned and measured host memory per rank as well."""
    planned = (plan or {}).get("phases") or {}
    out = {}
    for name in PLANNED_PHASES:
        measured = phases.get(name, {})
        value = measured.get("device_peak_gb", measured.get("host_peak_gb"))
        entry = {"planned_gb": planned.get(name), "measured_gb": value,
                 "measured_on": "device" if "device_peak_gb" in measured else "host"}
        if entry["planned_gb"] and value is not None and entry["measured_on"] == "device":
            entry["measured_over_planned"] = value / entry["planned_gb"]
        out[name] = entry
    if plan and "host_save_gb_per_rank" in plan:
        out["save"]["host_planned_gb"] = plan["host_save_gb_per_rank"]
        out["save"]["host_measured_gb"] = phases.get("save", {}).get("host_peak_gb")
    return out


def check_optimizer_steps(checks, train: List[Dict[str, Any]]) -> None:
    """Every step took an optimizer step (scripts/gpu_check_train.py's reward gives each group a
    learning signal), with a finite gradient norm."""
    steps = [(r.get("optimizer_steps", 0), r.get("grad_norm")) for r in train]
    check(checks, "an optimizer step every step, finite gradient norm",
          bool(steps) and all(n >= 1 and isinstance(g, (int, float)) and g == g and abs(g) != float("inf")
                              for n, g in steps),
          ", ".join(f"{n} (grad norm {g})" for n, g in steps))


def check_engine_gap(checks, train: List[Dict[str, Any]]) -> None:
    logged = [r for r in train if "engine_gap/token_abs_mean" in r]
    check(checks, "engine gap logged", bool(logged), f"{len(logged)} of {len(train)} steps")
    for key, (low, high) in ENGINE_GAP_LIMITS.items():
        values = [r[key] for r in logged]
        check(checks, f"{key} in [{low}, {high}]", all(low <= v <= high for v in values),
              ", ".join(f"{v:.4g}" for v in values))


def check_weight_loads(checks, lines: List[str]) -> None:
    """No weight-load warning of vLLM (:data:`WEIGHT_LOAD_WARNING`) about a layer with weights."""
    found = [(line.strip(), WEIGHT_LOAD_WARNING.search(line)) for line in lines]
    found = [(line, match) for line, match in found if match]
    benign = [line for line, match in found if match.group(1) and NO_CHECKPOINT_TENSORS.fullmatch(match.group(1))]
    wrong = [line for line, _ in found if line not in benign]
    check(checks, "no weight-load warning of vLLM", not wrong,
          "; ".join(wrong[:3]) or (f"{len(benign)} about rotary embeddings' computed caches" if benign else ""))


def check_push(checks, train: List[Dict[str, Any]], log: str) -> None:
    pushed = [r for r in train if any(k.startswith("engine_push/") for k in r)]
    check(checks, "push check logged", bool(pushed), f"{len(pushed)} of {len(train)} steps")
    worst: Dict[str, float] = {}
    for record in pushed:
        for key, value in record.items():
            if key.startswith("engine_push/"):
                worst[key] = max(worst.get(key, 0.0), float(value))
    check(checks, f"engine_push/*_rel_err < {PUSH_REL_ERR_MAX}",
          all(v < PUSH_REL_ERR_MAX for v in worst.values()),
          ", ".join(f"{k}={v:.3g}" for k, v in sorted(worst.items())))
    check_weight_loads(checks, log.splitlines())


def training_result(check_dir: str, part: str, commands: List[Dict[str, Any]]) -> Dict[str, Any]:
    run_dir = os.path.join(check_dir, part)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    records = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    train = [r for r in records if r["kind"] == "train"]
    log_path = os.path.join(check_dir, f"{part}.log")
    log = open(log_path).read() if os.path.exists(log_path) else ""
    runs = [int(m.group(1)) for c in commands for m in [STEPS_LABEL.search(c["command"])] if m]
    checks: List[Dict[str, Any]] = []
    expected = list(range(1, max(runs) + 1)) if runs else []
    steps = [r["step"] for r in train]
    check(checks, f"steps {expected} logged", steps == expected and bool(expected), f"logged {steps}")
    if len(runs) > 1:
        resumed = f"| steps {runs[-2]}->{runs[-1]} |" in log   # recipes/train.py's start line
        check(checks, f"resumed at step {runs[-2]}", resumed)
    check_optimizer_steps(checks, train)
    check_engine_gap(checks, train)
    if part == "vllm":
        check_push(checks, train, log)
    phases = phase_figures([r for r in records if r["kind"] == PHASES_KIND])
    plan = read_json(os.path.join(check_dir, f"{part}.plan.json"))
    result: Dict[str, Any] = {"steps": steps, "checks": checks, "phases": phases,
                              "plan": {k: plan.get(k) for k in ("train_phase_gb", "rollout_phase_gb", "gpu_memory_gb",
                                                                 "phases", "host_save_gb_per_rank") if k in plan}
                              if plan else None,
                              "phases_vs_plan": against_plan(phases, plan),
                              "peak_gpu_memory_gb": peak_memory_gb(check_dir, part)}
    if train:
        config = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
        sequences = int(config.trainer.prompts_per_step) * int(config.rollout.n)
        result["per_step"] = [step_figures(r, sequences) for r in train]
    return result


# --------------------------------------------------------------------------------------------
# The other parts
# --------------------------------------------------------------------------------------------


def engine_result(check_dir: str) -> Dict[str, Any]:
    figures = read_json(os.path.join(check_dir, "engine.json")) or {"error": "no engine.json"}
    checks: List[Dict[str, Any]] = []
    check(checks, "every stage ran", "error" not in figures, figures.get("error", ""))
    check_weight_loads(checks, figures.get("push_log", []))
    return {"figures": figures, "checks": checks}


def hf_result(check_dir: str) -> Dict[str, Any]:
    figures = read_json(os.path.join(check_dir, "hf.json")) or {"error": "no hf.json"}
    checks: List[Dict[str, Any]] = []
    check(checks, "logits and exported tensors match", figures.get("ok", False),
          figures.get("error", f"logits_rel_err={figures.get('logits_rel_err')}, "
                               f"export mismatches {figures.get('export_mismatches')}"))
    return {"figures": figures, "checks": checks}


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def gb(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f} GB"


def training_lines(part: str, result: Dict[str, Any]) -> List[str]:
    lines = []
    if result.get("per_step"):
        last = result["per_step"][-1]  # the first step includes warm-up and compilation
        offload = (f" | training state offload {last['offload_s']:.3f} s, reload {last['reload_s']:.3f} s"
                   if "offload_s" in last else "")
        lines.append(f"{part}: steps {result['steps']} | step {last['step']}: {last['step_s']:.2f} s (rollout "
                     f"{last['rollout_s']:.2f} s, update {last['update_s']:.2f} s), {last['rollout_tokens_per_s']:.0f} "
                     f"generated tokens/s in rollout, {last['step_tokens_per_s']:.0f} per step | nvidia-smi peak "
                     f"{gb(result['peak_gpu_memory_gb'])}{offload}")
    # one line per phase, the planned ones first: seconds of each occurrence, peaks, the plan
    for name in list(PLANNED_PHASES) + sorted(set(result["phases"]) - set(PLANNED_PHASES)):
        figures, entry = result["phases"].get(name), result["phases_vs_plan"].get(name, {})
        if figures is None:
            lines.append(f"{part}: phase {name:<8} not measured")
            continue
        planned = "not planned" if entry.get("planned_gb") is None else f"planned {entry['planned_gb']:.2f} GB"
        if "measured_over_planned" in entry:
            planned += f", device peak / planned {entry['measured_over_planned']:.2f}"
        host = (f" | host per rank planned {gb(entry['host_planned_gb'])}, measured {gb(entry['host_measured_gb'])}"
                if "host_planned_gb" in entry else "")
        seconds = " + ".join(f"{s:.1f}" for s in figures["seconds"])
        lines.append(f"{part}: phase {name:<8} {seconds} s | peak allocated {gb(figures.get('peak_allocated_gb'))}, "
                     f"reserved {gb(figures.get('peak_reserved_gb'))}, device {gb(figures.get('device_peak_gb'))}, "
                     f"host {gb(figures.get('host_peak_gb'))} | {planned}{host}")
    return lines


def engine_lines(result: Dict[str, Any]) -> List[str]:
    f = result["figures"]
    parts = [f"{key} {f[key]:.1f} s" for key in ("construction_s", "sleep_s", "wake_weights_s", "push_s", "wake_kv_s")
             if key in f]
    if "sleep_still_in_use_gib" in f:
        parts.append(f"asleep: vLLM freed {f['sleep_freed_gib']} GiB, {f['sleep_still_in_use_gib']} GiB still in use")
    parts += [f"{n} sequences {d['tokens_per_s']:,.0f} tokens/s" for n, d in f.get("decode", {}).items()]
    return ["engine: " + (", ".join(parts) or f.get("error", "nothing measured"))]


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: gpu_check_report.py CHECK_DIR")
    check_dir = argv[0]
    commands = read_commands(check_dir)
    skipped = {os.path.basename(p)[:-len(".skipped")]: open(p).read().strip()
               for p in glob.glob(os.path.join(check_dir, "*.skipped"))}
    ran = [part for part in dict.fromkeys(c["part"] for c in commands) if part != "env"]
    parts: Dict[str, Dict[str, Any]] = {}
    lines: List[str] = []
    for part in ran:
        mine = [c for c in commands if c["part"] == part]
        if part in TRAINING_PARTS:
            result = training_result(check_dir, part, mine)
            lines += training_lines(part, result)
        elif part == "engine":
            result = engine_result(check_dir)
            lines += engine_lines(result)
        else:
            result = hf_result(check_dir)
        failed_commands = [f"{c['command']}: exit code {c['exit_code']}" for c in mine if c["exit_code"] != 0]
        check(result["checks"], "every command exited 0", not failed_commands, "; ".join(failed_commands))
        result["seconds"] = sum(c["seconds"] for c in mine)
        result["ok"] = all(c["ok"] for c in result["checks"])
        parts[part] = result
        for item in result["checks"]:
            lines.append(f"{part}: {'ok  ' if item['ok'] else 'FAIL'} {item['check']}"
                         + (f" ({item['detail']})" if item["detail"] else ""))
    summary = {"env": read_json(os.path.join(check_dir, "env.json")), "parts": parts, "skipped": skipped,
               "commands": commands,
               "failures": sorted(p for p, r in parts.items() if not r["ok"]) or ([] if parts else ["no part ran"])}
    for line in lines:
        print(f"[gpu_check] {line}")
    for part, reason in skipped.items():
        print(f"[gpu_check] {part}: skipped ({reason})")
    print(f"[gpu_check] {'PASSED' if not summary['failures'] else 'FAILED: ' + ', '.join(summary['failures'])} "
          f"in {sum(c['seconds'] for c in commands)} s of commands", flush=True)
    text = json.dumps(summary)
    print("GPU_CHECK_RESULT " + text, flush=True)
    for folder in (check_dir, os.environ.get("OUT")):
        if folder:
            with open(os.path.join(folder, "gpu_check.json"), "w") as handle:
                handle.write(text)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
