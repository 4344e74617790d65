"""Evaluation throughput: grading + Pass@k + UCC@k (ROUGE-L criterion) on synthetic samples.

    OMP_NUM_THREADS=1 python benchmarks/bench_eval.py                  # 500 problems x 256 responses
    OMP_NUM_THREADS=1 python benchmarks/bench_eval.py --problems 50    # quick

Synthetic data shaped like a model's samples: each problem has a spread-out success rate, a few
solution "styles" (~300-token templates; a response is one with ~5% of its tokens changed, so
responses of one style are near-duplicates) and a few wrong final answers; correct answers come in
several equivalent forms (a/b, \\frac{a}{b}, \\dfrac{a}{b}). Prints the wall and CPU time of each
stage (target: the three stages together < 2 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.eval.passk import pass_at_k, power_of_two_ks, ucc_at_k  # noqa: E402
from quatro_nemo.eval.similarity import DEFAULT_THRESHOLDS, cluster_near_duplicates  # noqa: E402
from quatro_nemo.rewards.math_verifier import MathVerifier  # noqa: E402


def make_samples(num_problems: int, num_samples: int, num_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(3000)] + list("=+-*/()^{}") + ["\\frac", "x", "y", "so", "the"])
    problems, responses = [], []
    for p in range(num_problems):
        a, b = int(rng.integers(1, 50)), int(rng.integers(51, 99))
        gold = f"\\frac{{{a}}}{{{b}}}"
        correct_forms = [f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\dfrac{{{a}}}{{{b}}}"]
        wrong = [f"{a + d}/{b}" for d in range(1, 4)] + [str(int(rng.integers(2, 500)))]
        num_styles = int(rng.integers(1, 24))
        styles = rng.choice(len(vocab), size=(num_styles, num_tokens))
        success = rng.beta(0.5, 0.5)                         # spread of difficulty, many near 0 and 1
        which_style = rng.integers(0, num_styles, size=num_samples)
        is_correct = rng.random(num_samples) < success
        edits = rng.random((num_samples, num_tokens)) < 0.05
        noise = rng.choice(len(vocab), size=(num_samples, num_tokens))
        tokens = np.where(edits, noise, styles[which_style])
        problem = {"id": f"p{p}", "benchmark": "synthetic", "answer": gold}
        for i in range(num_samples):
            answer = correct_forms[i % 3] if is_correct[i] else wrong[int(rng.integers(0, len(wrong)))]
            responses.append(" ".join(vocab[tokens[i]]) + f" so the answer is \\boxed{{{answer}}}")
            problems.append(problem)
    return problems, responses


def cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its finished children (grading workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--grading-workers", type=int, default=2)
    parser.add_argument("--similarity-workers", type=int, default=2, help="rapidfuzz threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    problems, responses = make_samples(args.problems, args.samples, args.tokens, args.seed)
    t_data = time.perf_counter() - t0
    n = args.samples
    print(f"synthetic data: {args.problems} problems x {n} responses x ~{args.tokens} tokens "
          f"({sum(map(len, responses)) / len(responses):.0f} chars each) in {t_data:.1f} s (not counted)")

    t0, c0 = time.perf_counter(), cpu_seconds()
    with MathVerifier(num_workers=args.grading_workers) as verifier:
        rewards = np.array(verifier.score_batch(problems, responses)).reshape(args.problems, n)
        stats = dict(verifier.stats)
    t_grade, cpu_grade = time.perf_counter() - t0, cpu_seconds() - c0
    print(f"grading:   {t_grade:6.1f} s wall, {cpu_grade:6.1f} s CPU  ({stats.get('checks', 0)} distinct (gold, answer) checks, "
          f"{stats.get('cache_hits', 0)} cache hits, {stats.get('timeout', 0)} timeouts)")

    t0, c0 = time.perf_counter(), cpu_seconds()
    ks = power_of_two_ks(n)
    correct_counts = rewards.sum(axis=1).astype(np.int64)
    pass_table = {k: float(pass_at_k(n, correct_counts, k).mean()) for k in ks}
    t_pass, cpu_pass = time.perf_counter() - t0, cpu_seconds() - c0
    print(f"Pass@k:    {t_pass:6.3f} s wall, {cpu_pass:6.3f} s CPU  " + " ".join(f"@{k}={v:.3f}" for k, v in pass_table.items()))

    t0, c0 = time.perf_counter(), cpu_seconds()
    threshold = DEFAULT_THRESHOLDS["rouge_l"]
    ucc = {k: 0.0 for k in ks}
    for p in range(args.problems):
        correct = [responses[p * n + i] for i in range(n) if rewards[p, i] >= 1.0]
        sizes = cluster_near_duplicates(correct, "rouge_l", threshold, workers=args.similarity_workers)
        for k in ks:
            ucc[k] += ucc_at_k(n, sizes, k) / args.problems
    t_ucc, cpu_ucc = time.perf_counter() - t0, cpu_seconds() - c0
    print(f"UCC@k:     {t_ucc:6.1f} s wall, {cpu_ucc:6.1f} s CPU  (ROUGE-L >= {threshold}) " + " ".join(f"@{k}={v:.2f}" for k, v in ucc.items()))
    total = t_grade + t_pass + t_ucc
    print(f"total:     {total:6.1f} s wall, {cpu_grade + cpu_pass + cpu_ucc:6.1f} s CPU (target < 120 s wall "
          f"on 2 cores; on a shared machine the CPU figure is the stable one). "
          f"Mean correct/problem {correct_counts.mean():.1f}; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
