"""The short final report of a run (report.md + report.json): base model vs trained model.

Everything is read back from the run directory (metrics.jsonl and the evaluation samples), so the
report of a resumed run is the report of the whole run.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from quatro_nemo.data.schema import iter_jsonl
from quatro_nemo.engine.logging import read_metrics
from quatro_nemo.eval.flip import flip_rate_by_bucket
from quatro_nemo.eval.passk import distinct_correct_per_solved


def _samples(run_dir: str, step: int) -> Optional[List[Dict[str, Any]]]:
    path = os.path.join(run_dir, "eval", f"samples_step{step:06d}.jsonl")
    return [record for _, record in iter_jsonl(path)] if os.path.exists(path) else None


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _metric_order(key: str):
    """reward, pass@1, pass@2, ..., ucc@1, ..., then the rest (k numerically, not as text)."""
    family, _, k = key.partition("@")
    rank = {"reward/mean": 0, "pass": 1, "ucc": 2, "ucr": 3, "entropy": 4}.get(family, 5)
    return (rank, int(k) if k.isdigit() else 0, key)


def _success_histogram(samples: List[Dict[str, Any]]) -> List[str]:
    """The base model's per-prompt success rates (docs: the testbed needs a spread from 0 to 1)."""
    rates = [r["num_correct"] / len(r["rewards"]) for r in samples]
    edges = [i / 10 for i in range(11)]
    counts = [sum(lo <= x < hi for x in rates) for lo, hi in zip(edges[:-1], edges[1:])]
    counts[-1] += sum(x == 1.0 for x in rates)
    header = " | ".join(f"[{lo:.1f}, {hi:.1f}{']' if hi == 1.0 else ')'}" for lo, hi in zip(edges[:-1], edges[1:]))
    return ["## Base model: per-prompt held-out success rate", "",
            f"| {header} |", "|" + "---|" * 10, "| " + " | ".join(str(c) for c in counts) + " |",
            "", f"{sum(x == 0 for x in rates)} of {len(rates)} prompts never solved, "
            f"{sum(x == 1 for x in rates)} always solved.", ""]


def _distinct_correct_per_solved(samples: List[Dict[str, Any]]) -> Optional[float]:
    """:func:`~quatro_nemo.eval.passk.distinct_correct_per_solved` of evaluation sample rows; None
    if no problem was solved or the rows have no clusters."""
    if not all("cluster_sizes" in r for r in samples):
        return None
    return distinct_correct_per_solved([r["num_correct"] for r in samples], [len(r["cluster_sizes"]) for r in samples])


def heldout_table(base: Dict[str, Any], final: Dict[str, Any]) -> List[str]:
    """The held-out evaluation records of step 0 and the last step, side by side (markdown lines,
    with the section heading): report.md's first section, which the training loop also prints."""
    keys = sorted((k for k in final if k.startswith(("reward/", "pass@", "ucc@", "ucr", "entropy", "response_length"))),
                  key=_metric_order)
    lines = [f"## Held-out evaluation ({final.get('num_problems')} problems x {final.get('n_samples')} samples)",
             "", "| metric | base model (step 0) | trained (step %d) | change |" % final["step"],
             "|---|---|---|---|"]
    for key in keys:
        b, f = base.get(key), final.get(key)
        change = f - b if isinstance(b, (int, float)) and isinstance(f, (int, float)) else ""
        lines.append(f"| {key} | {_fmt(b)} | {_fmt(f)} | {_fmt(change) if change != '' else ''} |")
    return lines


def write_report(run_dir: str, cfg, task_properties: Dict[str, Any]) -> Dict[str, Any]:
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    base = evals[0] if evals and evals[0]["step"] == 0 else None
    final = evals[-1] if evals else None
    summary: Dict[str, Any] = {"algorithm": cfg.algorithm_name, "steps": cfg.trainer.steps,
                               "base": base, "final": final, "task": task_properties}

    lines = [f"# QUATRO-nemo run report: `{cfg.algorithm_name}`", "",
             f"Run directory `{run_dir}`; {cfg.trainer.steps} rollout steps of {cfg.trainer.prompts_per_step} "
             f"prompts x {cfg.rollout.n} responses, K = {cfg.trainer.inner_loops} inner loop(s), lr {cfg.trainer.lr}.",
             ""]
    if base and final:
        summary["heldout_reward_improvement"] = final["reward/mean"] - base["reward/mean"]
        lines += heldout_table(base, final) + [""]
        base_samples, final_samples = _samples(run_dir, base["step"]), _samples(run_dir, final["step"])
        if base_samples and final_samples:
            diversity = [_distinct_correct_per_solved(base_samples), _distinct_correct_per_solved(final_samples)]
            if None not in diversity:
                summary["distinct_correct_per_solved"] = {"base": diversity[0], "final": diversity[1]}
                lines += [f"Distinct correct answers per solved problem (the UCC@k clusters: solutions equal "
                          f"after normalisation count once): base {_fmt(diversity[0])}, trained {_fmt(diversity[1])}.",
                          ""]
            n_base = [len(r["rewards"]) for r in base_samples]
            n_final = [len(r["rewards"]) for r in final_samples]
            buckets = flip_rate_by_bucket([r["num_correct"] for r in base_samples], n_base,
                                          [r["num_correct"] for r in final_samples], n_final)
            summary["flip_buckets"] = [b.__dict__ for b in buckets]
            lines += ["## Difficulty buckets of the base model (flip rate, App. C.7)", "",
                      "| bucket | problems | base-unsolved | flipped | flip rate | improved | mean pass@1 change |",
                      "|---|---|---|---|---|---|---|"]
            for b in buckets:
                lines.append(f"| {b.name} [{b.low}, {b.high}) | {b.num_problems} | {b.num_base_unsolved} | "
                             f"{b.num_flipped} | {_fmt(b.flip_rate)} | {_fmt(b.improvement_rate)} | "
                             f"{_fmt(b.mean_pass1_delta)} |")
            lines.append("")
            lines += _success_histogram(base_samples)
    if train:
        lines += ["## Training", "",
                  f"- rollout reward: first step {_fmt(train[0]['reward/mean'])}, last step {_fmt(train[-1]['reward/mean'])}",
                  f"- policy entropy: first {_fmt(train[0]['entropy'])}, last {_fmt(train[-1]['entropy'])}",
                  f"- mean step time: {_fmt(sum(r.get('time/step', 0.0) for r in train) / len(train))} s", ""]
    if task_properties:
        lines += ["## The task (measured)", "", "```json", json.dumps(task_properties, indent=1, default=str), "```", ""]
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary
