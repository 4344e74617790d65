"""The study's held-out evaluation: a trained run's final policy, or the base model, at each top-p.

Each run of the study trains with the loop's own evaluation off (``eval.num_problems=0``); its
final checkpoint is then evaluated here with the study's settings (``evaluation`` in the study
config): ``n_samples`` responses per held-out problem at every ``top_p``, scored with the
engine's metrics (:func:`quatro_nemo.engine.evaluation.evaluate_policy`: reward, Pass@k and
UCC@k for k = 1, 2, 4, ..., n, UCR, token entropy). The base model is the same for every run
of a study (one warm-start), so it is evaluated once and reused.

Every evaluation draws its sampling noise from the same seed (``evaluation.seed``, not the run's
seed; :func:`quatro_nemo.engine.evaluation.eval_noise_seed` of it), keyed by problem and sample
index, so all runs and the base model are compared on the same problems *and* the same random
numbers: the evaluation is paired across methods as the training is paired by seed.

Usually run inside the study's job (:mod:`quatro_nemo.study.job`, right after the training);
this module's command line evaluates a run trained before.

Records (one per top-p) are JSON lines with ``kind = "study_eval"``: the metrics above, the
number of distinct correct solutions per solved problem (``distinct_correct_per_solved``), the
fraction of problems solved at least once, and the per-problem correct and distinct-correct
counts (``num_correct``, ``num_distinct``) from which the success-rate spread is read.

    python -m quatro_nemo.study.evaluation RUN_DIR --out FILE [--n 128 --problems 64 --top-p 0.7 1.0 --seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from quatro_nemo.eval.passk import distinct_correct_per_solved

STUDY_EVAL = "study_eval.jsonl"     # a run's evaluation records, written last (the run's "done" mark)


def summarize_rows(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-problem counts and the diversity figures of one evaluation's sample rows (the rows
    :func:`quatro_nemo.engine.evaluation.evaluate_policy` returns: num_correct and the sizes of the
    distinct-correct clusters)."""
    num_correct = [int(r["num_correct"]) for r in rows]
    num_distinct = [len(r["cluster_sizes"]) for r in rows]
    per_solved = distinct_correct_per_solved(num_correct, num_distinct)
    return {"num_correct": num_correct, "num_distinct": num_distinct,
            "solved_fraction": sum(c > 0 for c in num_correct) / len(rows) if rows else 0.0,
            "distinct_correct_per_solved": 0.0 if per_solved is None else per_solved}


def study_eval_settings(cfg, n_samples: int, top_p: float, temperature: float, seed: int):
    """The study's EvalSettings for a run config: the run's response length, micro-batching and
    UCC criterion; the study's samples, sampling and noise seed (``seed``: the same for every run
    and the base model)."""
    from quatro_nemo.engine.evaluation import eval_noise_seed, training_eval_settings

    return dataclasses.replace(training_eval_settings(cfg), n_samples=n_samples, top_p=float(top_p),
                               temperature=float(temperature), seed=eval_noise_seed(seed))


def evaluate_model(policy, task, problems: Sequence[Dict[str, Any]], settings, top_ps: Sequence[float],
                   step: int) -> List[Dict[str, Any]]:
    """One record per top-p for `policy` (a built megatron model) on `problems`, with `settings`
    (an EvalSettings) at each top-p. Needs megatron initialised (TP=1, PP=1)."""
    import torch

    from quatro_nemo.engine.evaluation import evaluate_policy
    from quatro_nemo.engine.rollout import MegatronRolloutBackend

    policy.eval()
    backend = MegatronRolloutBackend(policy, stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
    records = []
    for top_p in top_ps:
        with torch.no_grad():
            metrics, rows = evaluate_policy(policy, backend, task, problems,
                                            dataclasses.replace(settings, top_p=float(top_p)))
        records.append(dict(kind="study_eval", step=step, top_p=float(top_p), **metrics, **summarize_rows(rows)))
    return records


def evaluate_run(run_dir: str, num_problems: int, n_samples: int, top_ps: Sequence[float], temperature: float,
                 seed: int) -> List[Dict[str, Any]]:
    """The final checkpoint of a finished run (its config.yaml rebuilds task and model)."""
    from omegaconf import OmegaConf

    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine.config import validate
    from quatro_nemo.engine.task import build_task
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.models import build_model

    cfg = validate(OmegaConf.load(os.path.join(run_dir, "config.yaml")))
    step = ckpt.latest_step(run_dir)
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint to evaluate")
    parallel.initialize_parallel(1, 1, seed=seed)
    try:
        task = build_task(cfg)
        policy = build_model(task.model_config(cfg.model))
        ckpt.load_model_weights(run_dir, step, policy)   # any training layout loads into TP=1, PP=1
        settings = study_eval_settings(cfg, n_samples, top_ps[0], temperature, seed)
        return evaluate_model(policy, task, task.heldout_problems[:num_problems], settings, top_ps, step)
    finally:
        parallel.destroy_parallel()


def evaluate_base(train_args: Sequence[str], num_problems: int, n_samples: int, top_ps: Sequence[float],
                  temperature: float, seed: int) -> List[Dict[str, Any]]:
    """The base model (the warm-start every run starts from), composed from the study's training
    arguments; records at step 0."""
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.task import build_task
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model

    cfg = load_config(list(train_args))
    task = build_task(cfg)
    model_cfg = task.model_config(cfg.model)
    state = task.load_base_state(model_cfg)        # before megatron: may train the warm-start
    parallel.initialize_parallel(1, 1, seed=seed)
    try:
        policy = build_model(model_cfg)
        load_full_state_dict(policy, state)
        settings = study_eval_settings(cfg, n_samples, top_ps[0], temperature, seed)
        return evaluate_model(policy, task, task.heldout_problems[:num_problems], settings, top_ps, 0)
    finally:
        parallel.destroy_parallel()


def write_records(path: str, records: Sequence[Dict[str, Any]]) -> None:
    """JSON lines, written to a temporary name and renamed (a present file is a complete one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)
    os.replace(tmp, path)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Evaluate a finished study run (see the module docstring).")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help=f"records file (default: RUN_DIR/{STUDY_EVAL})")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from quatro_nemo.megatron.quiet import quiet_library_warnings

    torch.set_num_threads(1)
    quiet_library_warnings()
    records = evaluate_run(args.run_dir, args.problems, args.n, args.top_p, args.temperature, args.seed)
    write_records(args.out or os.path.join(args.run_dir, STUDY_EVAL), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
