"""Held-out evaluation of a policy: n samples per problem -> reward, Pass@k, UCC@k, entropy.

The metric definitions live in quatro_nemo.eval (quatro-math.md Sec. 6); this module only draws
the samples with the rollout backend, scores them, and reduces per-problem statistics over the
data-parallel ranks. Each evaluation uses the same sampling noise (keyed by the problem, not the
step), so differences between evaluations come from the policy, not the draw.

The one evaluation path of a policy: the training loop (:func:`training_eval_settings`), the
study (:mod:`quatro_nemo.engine.heldout`) and recipes/evaluate.py's ``checkpoint=``
(:mod:`quatro_nemo.engine.generate`) all sample held-out responses with
:func:`sample_responses`; the first two score them with :func:`evaluate_policy`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from quatro_nemo.eval.passk import pass_at_k, power_of_two_ks, ucc_at_k, unique_correct_ratio
from quatro_nemo.eval.similarity import cluster_near_duplicates
from quatro_nemo.engine.config import UccCriterion
from quatro_nemo.engine.rollout import model_inputs
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.batching import MicroBatching
from quatro_nemo.megatron.collectives import dp_all_gather_objects
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.forward import compute_logprobs
from quatro_nemo.megatron.sampling import SamplingParams

EVAL_SEED_TAG = 7919  # separates the evaluation noise stream from the training one


@dataclass(frozen=True)
class EvalSettings:
    """Everything one held-out evaluation reads besides the policy, the task and the problems
    (built from validated config sections: the run's ``eval:``, the study's ``evaluation``)."""

    n_samples: int                  # responses per problem
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int                       # the sampling noise: the same seed draws the same random numbers
    micro_batching: MicroBatching   # of the forward pass that measures the token entropy
    ucc_criterion: UccCriterion = UccCriterion("exact")   # distinct correct solutions: "task" (the task's canonical form)
    ucc_threshold: float = 1.0      # or a quatro_nemo.eval.similarity metric with this threshold

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                              seed=self.seed)


def eval_noise_seed(seed: int) -> int:
    """The evaluation's sampling seed for a run (or study) seed: apart from the training rollouts'."""
    return seed + EVAL_SEED_TAG


def training_eval_settings(cfg) -> EvalSettings:
    """The held-out evaluation of a run config (``eval:``, ``rollout.max_new_tokens``,
    ``parallel:``), its noise from ``run.seed``."""
    ev = cfg.eval
    return EvalSettings(n_samples=ev.n_samples, temperature=ev.temperature, top_p=ev.top_p,
                        max_new_tokens=cfg.rollout.max_new_tokens, seed=eval_noise_seed(cfg.run.seed),
                        micro_batching=MicroBatching.from_parallel_config(cfg.parallel),
                        ucc_criterion=ev.ucc_criterion, ucc_threshold=ev.ucc_threshold)


def sample_responses(task, backend, problems: Sequence[Dict[str, Any]], prompt_indices: Sequence[int],
                     settings: EvalSettings) -> Tuple[Any, List[str]]:
    """``settings.n_samples`` responses per problem (grouped) and their texts; the noise of each
    row depends only on ``settings.seed`` and the problem's index in ``prompt_indices``."""
    return task.sample(backend, problems, prompt_indices, settings.n_samples, settings.sampling_params())


def cluster_sizes(problem: Dict[str, Any], correct_responses: Sequence[str], criterion: str,
                  threshold: float, solution_key=None) -> List[int]:
    """Sizes of the clusters of distinct correct solutions of one problem.

    criterion "task" uses the task's canonical form of a solution (e.g. Countdown steps up to
    reordering); the others are quatro_nemo.eval.similarity metrics with a threshold."""
    if not correct_responses:
        return []
    if criterion == "task":
        if solution_key is None:
            raise ValueError("eval.ucc_criterion=task needs a task that defines a canonical solution form")
        counts: Dict[str, int] = {}
        for response in correct_responses:
            key = solution_key(problem, response)
            counts[key] = counts.get(key, 0) + 1
        return sorted(counts.values(), reverse=True)
    return cluster_near_duplicates(list(correct_responses), criterion, threshold)


def evaluate_policy(policy, backend, task, problems: Sequence[Dict[str, Any]],
                    settings: EvalSettings) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Sample ``settings.n_samples`` responses for each problem and compute the held-out metrics.

    Collective over all ranks. Returns ``(metrics, rows)``, the same on every rank: the metrics
    dict and one row per problem in the samples format (quatro_nemo.eval.samples: id, benchmark,
    answer, responses, rewards, num_correct, cluster_sizes)."""
    n = settings.n_samples
    dp, dp_rank = parallel.dp_size(), parallel.dp_rank()
    per_rank = -(-len(problems) // dp)
    mine = list(range(dp_rank * per_rank, min(len(problems), (dp_rank + 1) * per_rank)))
    local_problems = [problems[i] for i in mine]
    rows: List[Dict[str, Any]] = []
    entropy_sum = token_count = 0.0
    if local_problems:
        rollout, responses = sample_responses(task, backend, local_problems, mine, settings)
        rewards = task.verifier.score_batch([p for p in local_problems for _ in range(n)], responses)
        batch = model_inputs(rollout, current_device())
        _, entropy = compute_logprobs(policy, batch, settings.micro_batching)
        mask = rollout.response_mask.float().to(entropy.device)
        entropy_sum, token_count = float((entropy * mask).sum()), float(mask.sum())
        for j, problem in enumerate(local_problems):
            texts = responses[j * n:(j + 1) * n]
            scores = rewards[j * n:(j + 1) * n]
            correct = [t for t, r in zip(texts, scores) if r >= 1.0]
            rows.append({"id": problem["id"], "benchmark": problem.get("benchmark", "heldout"),
                         "answer": problem.get("answer"), "responses": list(texts), "rewards": list(scores),
                         "num_correct": len(correct),
                         "cluster_sizes": cluster_sizes(problem, correct, settings.ucc_criterion,
                                                        settings.ucc_threshold, task.solution_key)})
    gathered = dp_all_gather_objects((rows, entropy_sum, token_count))
    rows = [row for part, _, _ in gathered for row in part]
    entropy_total = sum(e for _, e, _ in gathered)
    tokens_total = sum(t for _, _, t in gathered)

    correct_counts = np.array([row["num_correct"] for row in rows])
    metrics: Dict[str, Any] = {
        "reward/mean": float(np.mean([np.mean(row["rewards"]) for row in rows])),
        "entropy": entropy_total / max(tokens_total, 1.0),
        "response_length/mean": tokens_total / max(len(rows) * n, 1),
        "num_problems": len(rows),
        "n_samples": n,
    }
    for k in power_of_two_ks(n):
        metrics[f"pass@{k}"] = float(pass_at_k(n, correct_counts, k).mean())
        metrics[f"ucc@{k}"] = float(np.mean([ucc_at_k(n, row["cluster_sizes"], k) for row in rows]))
    metrics["ucr"] = float(np.mean([unique_correct_ratio(n, len(row["cluster_sizes"])) for row in rows]))
    return metrics, rows
