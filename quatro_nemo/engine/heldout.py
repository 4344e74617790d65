"""The held-out evaluation of a final policy, or of the base model, at each top-p: an EvalRequest.

A run that asks for it (engine/api.py's ``RunRequest.evaluation``) is evaluated once trained, with
its own response length, micro-batching and UCC criterion and the request's samples: ``n_samples``
responses to each of the first ``num_problems`` held-out problems at every ``top_p``, scored with
:func:`quatro_nemo.engine.evaluation.evaluate_policy` (reward, Pass@k and UCC@k for k = 1, 2, 4,
..., n, UCR, token entropy). The study asks for it for every run (its ``evaluation`` section) and
evaluates the base model once with the same request.

Every evaluation draws its sampling noise from the request's ``seed`` (not the run's seed;
:func:`quatro_nemo.engine.evaluation.eval_noise_seed` of it), keyed by problem and sample index,
so runs evaluated with one request are compared on the same problems *and* the same random
numbers: paired across methods as the training is paired by seed.

Records (one per top-p) have ``kind = "study_eval"``: the metrics above, the number of distinct
correct solutions per solved problem (``distinct_correct_per_solved``), the fraction of problems
solved at least once, and the per-problem correct and distinct-correct counts (``num_correct``,
``num_distinct``) from which the success-rate spread is read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from quatro_nemo.engine.evaluation import EvalSettings, eval_noise_seed, evaluate_policy, training_eval_settings
from quatro_nemo.engine.rollout import MegatronRolloutBackend
from quatro_nemo.engine.run_dir import LoadedPolicy, RunDir, base_policy
from quatro_nemo.eval.passk import distinct_correct_per_solved
from quatro_nemo.validation import ConfigError, check_in_unit_interval, check_number, check_positive

EVALUATION_KIND = "study_eval"      # the records' kind (the study's kept metrics read it by this name)


@dataclass(frozen=True)
class EvalRequest:
    """What a held-out evaluation of a policy draws (keys named ``evaluation.*`` in errors)."""

    num_problems: int               # the first held-out problems of the task
    n_samples: int                  # responses per problem: Pass@k and UCC@k for k = 1, 2, 4, ..., n
    top_p: Tuple[float, ...]        # one record per value
    temperature: float = 1.0
    seed: int = 0                   # the sampling noise (the same for every policy compared)

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_p", tuple(float(p) for p in self.top_p))
        check_number("evaluation.num_problems", self.num_problems, positive=True, integer=True)
        check_number("evaluation.n_samples", self.n_samples, positive=True, integer=True)
        check_positive("evaluation.temperature", self.temperature)
        check_number("evaluation.seed", self.seed, integer=True)
        if not self.top_p or len(set(self.top_p)) != len(self.top_p):
            raise ConfigError(f"evaluation.top_p must be distinct values, at least one, got {list(self.top_p)}")
        for p in self.top_p:
            check_in_unit_interval("evaluation.top_p", p)


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


def heldout_settings(cfg, request: EvalRequest, top_p: float) -> EvalSettings:
    """The EvalSettings of ``request`` at ``top_p`` for a run config: the run's response length,
    micro-batching and UCC criterion; the request's samples, sampling and noise seed."""
    return dataclasses.replace(training_eval_settings(cfg), n_samples=request.n_samples, top_p=float(top_p),
                               temperature=float(request.temperature), seed=eval_noise_seed(request.seed))


def evaluate_loaded(loaded: LoadedPolicy, request: EvalRequest) -> List[Dict[str, Any]]:
    """One record per top-p of ``request`` for a built policy (TP = 1, PP = 1)."""
    policy, task = loaded.policy, loaded.task
    policy.eval()
    backend = MegatronRolloutBackend(policy, stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
    problems = task.heldout_problems[:request.num_problems]
    records = []
    for top_p in request.top_p:
        with torch.no_grad():
            metrics, rows = evaluate_policy(policy, backend, task, problems, heldout_settings(loaded.config, request, top_p))
        records.append(dict(kind=EVALUATION_KIND, step=loaded.step, top_p=float(top_p), **metrics, **summarize_rows(rows)))
    return records


def evaluate_final_policy(directory: RunDir, request: EvalRequest) -> List[Dict[str, Any]]:
    """The newest checkpoint of a trained run (its config.yaml rebuilds task and model)."""
    with directory.load_policy(seed=request.seed) as loaded:
        return evaluate_loaded(loaded, request)


def evaluate_base(cfg, request: EvalRequest) -> List[Dict[str, Any]]:
    """The base model every run of ``cfg`` starts from; records at step 0."""
    with base_policy(cfg, seed=request.seed) as loaded:
        return evaluate_loaded(loaded, request)


def write_records(path: str, records: Sequence[Dict[str, Any]]) -> None:
    """JSON lines, written to a temporary name and renamed (a present file is a complete one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)
    os.replace(tmp, path)
