#!/usr/bin/env python
"""Print the per-GPU memory and throughput plan of a run config; refuse layouts that cannot fit.

    python recipes/plan_memory.py config=quatro_1p5b
    python recipes/plan_memory.py config=quatro_7b cluster.nodes=2 parallel.micro_batch_size=2
    python recipes/plan_memory.py config=quatro_7b --json        # machine-readable
    python recipes/plan_memory.py config=quatro_7b --json-file=plan.json   # the table, and the JSON to a file
    python recipes/plan_memory.py config=quatro_7b --measured-peak-gb=41.3   # next to a measurement

Takes the same arguments as recipes/train.py (Hydra overrides and config=NAME, composed with
Hydra's compose API; no Hydra flags). It prints every phase of the run (start-up, resume,
rollout, training, held-out evaluation, checkpoint save: GB per GPU), the host memory of a save
per rank and per node, and the seconds a preemption signal must leave. Exit code 0: every phase
fits; 2: a config error or a phase that cannot fit (the message names the settings to change).
The JSON (``--json``, ``--json-file``) holds every figure of the plan, among them ``phases``
(``{"startup": GB, "resume": GB, "rollout": GB, "train": GB, "eval": GB, "save": GB}`` per GPU,
1e9 bytes), ``host_save_gb_per_rank`` and ``host_save_gb_per_node``. Pure arithmetic
(quatro_nemo/engine/memory_plan.py; the table's layout is this file's): no GPU needed; it plans for the packages of the machine it
runs on (Transformer Engine, apex), so run it where the training runs.

``--measured-peak-gb=X`` (e.g. ``torch.cuda.max_memory_allocated() / 1e9`` of a run of the same
config, as scripts/gpu_check.sh prints) adds a line comparing it with the plan's
``peak_allocated_gb``; with ``--json`` the object gains ``measured_peak_gb`` and
``measured_over_planned``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.engine.config import CONFIG_ERROR_EXIT_CODE, ConfigError, load_config, memory_plan  # noqa: E402
from quatro_nemo.engine.memory_plan import MemoryPlan  # noqa: E402


def plan_for_arguments(argv) -> MemoryPlan:
    """Compose and validate the config like recipes/train.py (Hydra's compose API) and plan it
    (raises ConfigError)."""
    return memory_plan(load_config(argv))


PHASE_LABELS = {"startup": "start-up (engine built, then asleep)", "resume": "resume (+ Adam's moments, load)",
                "rollout": "rollout (vLLM awake)", "train": "training", "eval": "held-out evaluation",
                "save": "checkpoint save"}


def compare_peak(plan: MemoryPlan, measured_gb: float) -> str:
    """One line: a measured peak (``torch.cuda.max_memory_allocated()`` over a run, or the CPU's
    resident growth) next to :attr:`peak_allocated_gb`, the largest phase without the reserve."""
    largest = max(plan.phases, key=plan.phases.get)
    return (f"peak memory per rank: measured {measured_gb:.2f} GB, planned {plan.peak_allocated_gb:.2f} GB "
            f"(the {PHASE_LABELS[largest].split(' (')[0]} phase, without the {plan.reserve_gb:g} GB reserve); "
            f"measured / planned = {measured_gb / plan.peak_allocated_gb:.2f}")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as an aligned table, one term per line, each phase, the host during a save, the
    seconds, then its notes."""
    sharding = f"sharded over DP={plan.data_parallel}" if plan.distributed_optimizer else "not sharded"
    rows = [
        ("layout", f"TP={plan.tensor_parallel} PP={plan.pipeline_parallel} DP={plan.data_parallel} "
                   f"on {plan.world_size} {plan.device.upper()} ranks, full recompute: {plan.full_recompute}"),
        ("parameters (total / per GPU)", f"{plan.total_parameters / 1e9:.3f} B / {plan.parameters_per_gpu / 1e9:.3f} B"),
        ("weights", f"{plan.weights_gb:7.2f} GB"),
        ("gradient buffer (float32, DDP)", f"{plan.grads_gb:7.2f} GB"),
        ("optimizer (main params + Adam)", f"{plan.optimizer_gb:7.2f} GB ({sharding}; Adam's moments "
                                           f"{plan.adam_moments_gb:.2f})"),
        ("activations (in flight)", f"{plan.activations_gb:7.2f} GB"),
        ("logits + loss (last stage)", f"{plan.logits_gb:7.2f} GB"),
        ("log-prob forward (pi_old, pi_ref, eval)", f"{plan.logprob_forward_gb:7.2f} GB"),
        ("optimizer-step temporaries", f"{plan.optimizer_step_transient_gb:7.2f} GB (not with activations)"),
        ("checkpoint load transient", f"{plan.load_transient_gb:7.2f} GB"),
        ("reference policy weights", f"{plan.reference_gb:7.2f} GB"),
        ("vLLM while training (asleep)", f"{plan.vllm_while_training_gb:7.2f} GB"),
        ("= training peak of tensors", f"{plan.train_peak_allocated_gb:7.2f} GB"),
        ("reserve (context, NCCL, fragmentation)", f"{plan.reserve_gb:7.2f} GB"),
    ]
    if plan.uses_vllm:
        rows += [
            ("training state kept during rollout", f"{plan.resident_during_rollout_gb:7.2f} GB"),
            ("weight push to vLLM (transient)", f"{plan.weight_push_gb:7.2f} GB"),
            ("vLLM (weights + KV cache + activations)", f"{plan.vllm_gb:7.2f} GB (of the device's "
                                                        f"{plan.device_total_gb:.1f} GB)"),
            ("KV cache per engine", f"{plan.kv_cache_gb:7.2f} GB ({plan.kv_bytes_per_token / 1e3:.1f} kB/token)"),
            ("rollout token budget per engine", f"{plan.rollout_token_budget:,} tokens = "
                                                f"{plan.max_concurrent_sequences} full-length sequences at once"),
            ("rollout sequences per engine", f"{plan.sequences_per_engine} in {plan.rollout_waves} wave(s)"),
            ("vllm.max_num_seqs", f"{plan.max_num_seqs} (planner: {plan.proposed_max_num_seqs})"),
        ]
    rows += [(f"= {PHASE_LABELS[name]}", f"{needed:7.2f} GB of {plan.gpu_memory_gb:.0f} GB")
             for name, needed in plan.phases.items() if needed > 0]
    rows += [
        ("checkpoint written per rank", f"{plan.checkpoint_written_gb_per_rank:7.2f} GB"),
        ("host per rank during a save", f"{plan.host_save_gb_per_rank:7.2f} GB (optimizer kept on the host "
                                        f"{plan.host_offload_gb_per_rank:.2f}, staging, process)"),
        ("= host per node during a save", f"{plan.host_save_gb_per_node:7.1f} GB of {plan.host_memory_gb:.0f} GB"),
        ("micro-batches per optimizer step", f"{plan.num_microbatches} x {plan.optimizer_steps_per_rollout} "
                                             f"optimizer step(s) per rollout"),
        ("tokens per step (upper bound)", f"{plan.tokens_per_step:,}"),
        ("training compute per step", f"{plan.train_tflops_per_step:,.0f} TFLOP "
                                      f"(~{plan.estimated_train_seconds:.0f} s at the assumed MFU)"),
        ("seconds: step / eval / save", f"~{plan.step_seconds:.0f} (rollout {plan.rollout_seconds:.0f}) / "
                                        f"~{plan.eval_seconds:.0f} / ~{plan.save_seconds:.0f}"),
        ("preemption lead (#SBATCH --signal)", f"~{plan.preemption_lead_seconds:.0f} s (step + eval + save)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines + [f"note: {note}" for note in plan.notes])


MEASURED_FLAG = "--measured-peak-gb="
JSON_FILE_FLAG = "--json-file="


def main(argv) -> int:
    as_json = "--json" in argv
    measured = [arg for arg in argv if arg.startswith(MEASURED_FLAG)]
    json_files = [arg[len(JSON_FILE_FLAG):] for arg in argv if arg.startswith(JSON_FILE_FLAG)]
    argv = [arg for arg in argv if arg != "--json" and arg not in measured and not arg.startswith(JSON_FILE_FLAG)]
    try:
        measured_gb = float(measured[-1][len(MEASURED_FLAG):]) if measured else None
    except ValueError:
        print(f"plan error: {measured[-1]}: expected {MEASURED_FLAG}<number>", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    try:
        plan = plan_for_arguments(argv)
    except ConfigError as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    figures = dataclasses.asdict(plan)
    if measured_gb is not None:
        figures.update(measured_peak_gb=measured_gb, measured_over_planned=measured_gb / plan.peak_allocated_gb)
    for path in json_files:
        with open(path, "w") as out:
            out.write(json.dumps(figures, indent=2) + "\n")
    if as_json:
        print(json.dumps(figures, indent=2))
    else:
        print(format_plan(plan))
        if measured_gb is not None:
            print(compare_peak(plan, measured_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
