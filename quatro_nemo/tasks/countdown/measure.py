"""What a policy does on held-out Countdown problems (``docs/cpu-task.md``): the spread of
per-problem success rates, distinct correct answers and the preference between them, response
lengths and the sampling speed; the run report and the warm-start's tests read it."""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Dict, Sequence

from quatro_nemo.data.tokenizer import CharTokenizer
from quatro_nemo.eval.passk import distinct_correct_per_solved
from quatro_nemo.tasks.countdown.problems import canonical_expression, summarize
from quatro_nemo.tasks.countdown.verifier import CountdownVerifier

# Flip-rate buckets of the paper (correct count out of 256), used as fractions of N samples.
SUCCESS_BUCKET_EDGES = (0, 8, 32, 128, 256)


def measure_policy(backend, problems: Sequence[Dict[str, Any]], tokenizer: CharTokenizer, num_samples: int,
                   params, first_prompt_index: int = 0) -> Dict[str, Any]:
    """Sample ``num_samples`` responses per problem and measure what ``docs/cpu-task.md`` asks for.

    Returns per-problem success rates (``success_rates``, and a summary), the share of problems
    per success bucket (the flip-rate edges ``[0, 8, 32, 128, 256]`` out of 256, scaled to
    ``num_samples``; bucket ``[a, b)``, the last one closed), distinct correct answers per problem
    (as strings and as expressions modulo commuting; and the mean number of distinct correct
    expressions over the problems solved at least once; and, over the problems with at least three,
    the share of the most frequent one against an equal preference's), response lengths in tokens (EOS included),
    and the sampling speed. Runs on one process or on every rank of a layout with the same
    problems (``backend``: a rollout backend, :class:`quatro_nemo.engine.rollout.RolloutBackend`).
    """
    prompts = [tokenizer.encode_prompt(p["prompt"]) for p in problems]
    wall, cpu = time.perf_counter(), time.process_time()
    batch = backend.generate(prompts, num_samples, params, first_prompt_index=first_prompt_index)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    responses = [tokenizer.decode(ids) for ids in batch.response_ids()]
    rows = [p for p in problems for _ in range(num_samples)]
    scores = CountdownVerifier().score_batch(rows, responses)
    num_correct, rates, distinct, distinct_expressions, top_shares = [], [], [], [], []
    for g in range(len(problems)):
        group = range(g * num_samples, (g + 1) * num_samples)
        correct = [responses[i] for i in group if scores[i] > 0]
        num_correct.append(len(correct))
        rates.append(len(correct) / num_samples)
        distinct.append(len(set(correct)))
        modes = Counter(canonical_expression(r) for r in correct)
        distinct_expressions.append(len(modes))
        if len(modes) >= 3:   # how unequal the preference between the modes is (1 / len(modes) if equal)
            top_shares.append((max(modes.values()) / len(correct), 1.0 / len(modes)))
    per_solved = distinct_correct_per_solved(num_correct, distinct_expressions)
    edges = [e / SUCCESS_BUCKET_EDGES[-1] for e in SUCCESS_BUCKET_EDGES]
    buckets = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = [r for r in rates if lo <= r < hi or (hi == 1.0 and r == 1.0)]
        buckets[f"[{lo:g},{hi:g}{']' if hi == 1.0 else ')'}"] = len(inside) / len(rates)
    generated = int(batch.sample.response_lengths.sum())
    return {
        "num_problems": len(problems),
        "num_samples": num_samples,
        "success_rates": rates,
        "success_rate": summarize(rates),
        "success_buckets": buckets,
        "solved_never": sum(r == 0 for r in rates) / len(rates),
        "solved_always": sum(r == 1 for r in rates) / len(rates),
        "distinct_correct_per_problem": summarize(distinct),
        "distinct_correct_expressions_per_problem": summarize(distinct_expressions),
        # the diversity a method can keep or lose (issue 16): mean over problems solved at least once
        "distinct_correct_per_solved_problem": 0.0 if per_solved is None else per_solved,
        # over problems with >= 3 distinct correct expressions: the most frequent one's share of the
        # correct answers, and what it would be with equal preference
        "top_mode_share": sum(t for t, _ in top_shares) / len(top_shares) if top_shares else None,
        "top_mode_share_if_equal": sum(e for _, e in top_shares) / len(top_shares) if top_shares else None,
        "response_length_tokens": summarize(batch.sample.response_lengths.tolist()),
        "finished_fraction": float(batch.sample.finished.float().mean()),
        "sampling_seconds": wall,
        "sampling_cpu_seconds": cpu,
        "sampling_tokens_per_second": generated / wall,
        "sampling_tokens_per_cpu_second": generated / max(cpu, 1e-9),
    }
