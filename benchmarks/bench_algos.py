"""Benchmark of the algorithm core on CPU (issue 2): prints timings measured side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_algos.py [--repeats 15]

1. QUATRO dual solve (``solve_dual``) for B x N = 4096 x 256 and 512 x 8 (target < 50 ms for
   the large case), and its ratio to the GRPO advantage on the same rewards.
2. QUATRO loss vs GSPO loss, forward + backward, on the same batch (target ratio <= 1.05).

Timings are medians over interleaved repeats (A, B, A, B, ...), so load from other processes
hits both sides alike; on a shared machine read the ratios, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from quatro_nemo.algos import (  # noqa: E402
    GRPOConfig,
    GSPOConfig,
    LossNormalizer,
    QuatroConfig,
    get_advantage_estimator,
    get_policy_loss,
    solve_dual,
)


def interleaved_medians(functions, repeats):
    """Run each function once to warm up, then ``repeats`` rounds in turn; median seconds each."""
    for fn in functions:
        fn()
    samples = [[] for _ in functions]
    for _ in range(repeats):
        for fn, times in zip(functions, samples):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def bench_advantages(repeats):
    grpo = get_advantage_estimator("grpo")
    grpo_config = GRPOConfig()
    big = torch.rand(4096, 256, dtype=torch.float64)
    exp_pass, = interleaved_medians([lambda: torch.exp(big)], repeats)
    print(f"calibration: one float64 exp over 4096 x 256 = {exp_pass * 1e3:.2f} ms (machine speed right now)")
    print("advantages (ms, median)        dual solve   iters   GRPO adv   ratio dual/GRPO   dual in exp passes")
    for num_prompts, n in ((4096, 256), (512, 8)):
        for kind in ("binary", "continuous"):
            gen = torch.Generator().manual_seed(0)
            if kind == "binary":
                rewards = (torch.rand(num_prompts, n, generator=gen) < 0.5).float()
            else:
                rewards = torch.randn(num_prompts, n, generator=gen)
            iterations = solve_dual(rewards, 0.05).iterations
            dual_s, grpo_s = interleaved_medians(
                [lambda: solve_dual(rewards, 0.05), lambda: grpo(rewards, grpo_config)], repeats)
            print(f"  B={num_prompts:5d} N={n:4d} {kind:10s} {dual_s * 1e3:10.1f} {iterations:7d} "
                  f"{grpo_s * 1e3:10.2f} {dual_s / grpo_s:12.1f} {dual_s / exp_pass:16.1f}")


def bench_losses(repeats, num_seqs=256, length=1024):
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(num_seqs, length, generator=gen) * 2.0
    current = old + 0.05 * torch.randn(num_seqs, length, generator=gen)
    ref = old + 0.05 * torch.randn(num_seqs, length, generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < torch.randint(length // 4, length + 1, (num_seqs, 1), generator=gen)).float()
    advantages = torch.randn(num_seqs, generator=gen)
    normalizer = LossNormalizer.from_mask(mask)

    def step(name, config):
        def run():
            logprobs = current.clone().requires_grad_(True)
            loss, _ = get_policy_loss(name)(logprobs, old, advantages, mask, config, normalizer, ref_logprobs=ref)
            loss.backward()
        return run

    quatro_s, gspo_s = interleaved_medians([step("quatro", QuatroConfig()), step("gspo", GSPOConfig())], repeats)
    print(f"loss fwd+bwd S={num_seqs} T={length} (ms, median)   QUATRO {quatro_s * 1e3:.2f}   "
          f"GSPO {gspo_s * 1e3:.2f}   ratio QUATRO/GSPO {quatro_s / gspo_s:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    bench_advantages(args.repeats)
    bench_losses(3 * args.repeats)  # a loss step is short: more rounds for a stable ratio


if __name__ == "__main__":
    main()
