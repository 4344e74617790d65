"""Padding cost of the Megatron passes (issue 15): padded rows vs token-budget micro-batches vs packing.

    OMP_NUM_THREADS=1 python benchmarks/bench_packing.py [--repeats 3]

Lengths follow the paper's 7B setting (stated, not measured): prompts uniform in 50..512 tokens,
responses log-normal with mean 1,000 tokens and sigma 1.0 (a long tail), capped at 3,072
(``rollout.max_new_tokens``); N = 8 responses share a prompt.

(a) Tokens computed per real token, no model: one rank's rows padded to its longest row (today's
    rollout layout) and cut into row micro-batches; token-budget micro-batches (rows sorted by
    length, binned under the budget, each trimmed to its longest row; ``quatro_nemo.megatron.
    batching``); packing (THD: every real token once). Target: <= 1.10 with token budgets.
(b) CPU time of one old-log-prob pass + one training forward/backward for the tiny model on the
    same distribution scaled down 16x (prompts 3..32, responses mean 62, capped at 192), padded
    rows vs a token budget of the same peak size (rows x the batch's longest row), timed side by
    side (interleaved rounds: the least CPU time of this process, the median wall time). Packing
    needs Transformer Engine (GPU): the "packed" run of ``scripts/gpu_check.sh`` measures it.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from quatro_nemo.megatron.batching import (  # noqa: E402
    MicroBatching,
    padded_tokens,
    plan_by_rows,
    plan_by_tokens,
)

PROMPT_RANGE = (50, 512)
RESPONSE_MEAN, RESPONSE_SIGMA, RESPONSE_CAP = 1000.0, 1.0, 3072


def paper_like_lengths(num_prompts: int, n: int, generator: torch.Generator, scale: float = 1.0):
    """(prompt lengths, response lengths), both ``[num_prompts * n]`` int64, grouped by prompt:
    prompts uniform in ``PROMPT_RANGE``, responses log-normal (mean ``RESPONSE_MEAN``, sigma
    ``RESPONSE_SIGMA``) capped at ``RESPONSE_CAP``; every length times ``scale`` (at least 1)."""
    low, high = (max(1, round(x * scale)) for x in PROMPT_RANGE)
    prompts = torch.randint(low, high + 1, (num_prompts,), generator=generator).repeat_interleave(n)
    mu = math.log(RESPONSE_MEAN * scale) - RESPONSE_SIGMA ** 2 / 2  # E[exp(mu + sigma Z)] = mean
    normal = torch.randn(num_prompts * n, generator=generator, dtype=torch.float64)
    responses = torch.exp(mu + RESPONSE_SIGMA * normal).round().clamp(1, round(RESPONSE_CAP * scale)).long()
    return prompts, responses


def computed_per_real_token(lengths: torch.Tensor, rows_per_micro_batch: int, max_tokens: int):
    """(padded rows, token budget, packing): tokens computed / real tokens for one rank's rows."""
    real = int(lengths.sum())
    padded = padded_tokens(plan_by_rows(lengths.numel(), rows_per_micro_batch, int(lengths.max())))
    budget = padded_tokens(plan_by_tokens(lengths, max_tokens))
    return padded / real, budget / real, 1.0


def report_computed_tokens(seed: int = 0) -> None:
    # 256 prompts x 8 = 2,048 rows per step: 512 rows per rank in conf/quatro_7b.yaml (TP 2 x DP 4,
    # one mini-batch), 256 at DP 8, 128 at DP 16 or with 4 mini-batches at DP 4.
    print(f"(a) tokens computed per real token: prompts {PROMPT_RANGE[0]}..{PROMPT_RANGE[1]}, responses "
          f"log-normal mean {RESPONSE_MEAN:.0f} sigma {RESPONSE_SIGMA} capped at {RESPONSE_CAP}, N = 8")
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = paper_like_lengths(256, 8, generator)
    lengths = prompts + responses
    print(f"    sampled: mean response {responses.float().mean():.0f}, median {responses.median():.0f}, "
          f"capped {float((responses == RESPONSE_CAP).float().mean()):.1%}, mean row {lengths.float().mean():.0f} tokens")
    print("    rows/rank  budget (tokens)   padded rows   token budget   packing")
    for rows_per_rank in (512, 256, 128):
        for max_tokens in (8192, 16384, 32768):
            ratios = [computed_per_real_token(part, 4, max_tokens) for part in lengths.split(rows_per_rank)]
            padded, budget, packed = (statistics.mean(r[i] for r in ratios) for i in range(3))
            print(f"    {rows_per_rank:9d}  {max_tokens:15,d}   {padded:11.2f}   {budget:12.3f}   {packed:7.2f}")


def interleaved_timings(functions, repeats, prepares=None):
    """One warm-up call, then ``repeats`` rounds calling each function in turn (garbage collected
    before each call; ``prepares[i]()``, untimed, before ``functions[i]``): per function, (median
    wall seconds, least CPU seconds of this process).
    On a loaded machine read the CPU time: the benchmarks run one process on one thread, so it
    counts this work only, and other processes can only add to it (cache and memory traffic),
    hence the least of the rounds."""
    prepares = prepares or [lambda: None] * len(functions)
    prepares[0]()
    functions[0]()
    samples = [[] for _ in functions]
    for _ in range(repeats):
        for prepare, fn, times in zip(prepares, functions, samples):
            prepare()
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return [(statistics.median(t[0] for t in times), min(t[1] for t in times)) for times in samples]


def tiny_model_config(max_length: int):
    """The CPU default's tiny GPT (conf/model/tiny.yaml) with room for ``max_length`` tokens."""
    from quatro_nemo.megatron.models import ModelConfig

    return ModelConfig(architecture="gpt", vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4,
                       ffn_hidden_size=256, max_position_embeddings=max_length)


def synthetic_batch(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, vocab_size: int,
                    generator: torch.Generator):
    """Random tokens right-padded to the longest row, laid out as ``docs/interfaces.md``."""
    lengths = prompt_lengths + response_lengths
    rows, width = lengths.numel(), int(lengths.max())
    columns = torch.arange(width).unsqueeze(0)
    tokens = torch.randint(1, vocab_size, (rows, width), generator=generator)
    tokens[columns >= lengths.unsqueeze(1)] = 0
    predicted = columns[:, 1:]  # entry t predicts token t + 1
    response_mask = ((predicted >= prompt_lengths.unsqueeze(1)) & (predicted < lengths.unsqueeze(1))).float()
    return {"tokens": tokens, "position_ids": columns.expand(rows, width).contiguous(),
            "response_mask": response_mask, "lengths": lengths}


def report_cpu_step_time(repeats: int, num_prompts: int = 16, n: int = 8, rows_per_micro_batch: int = 32) -> None:
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.forward import compute_logprobs, train_step_forward_backward
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import destroy_parallel, initialize_parallel

    scale = 1 / 16
    generator = torch.Generator().manual_seed(1)
    prompts, responses = paper_like_lengths(num_prompts, n, generator, scale)
    initialize_parallel(seed=1234)
    cfg = tiny_model_config(int((prompts + responses).max()))
    model = build_model(cfg)
    model_ddp = training.wrap_for_training(model, distributed_optimizer=False)
    batch = synthetic_batch(prompts, responses, cfg.vocab_size, generator)
    batch["advantages"] = torch.randn(prompts.numel(), generator=generator)
    algo_config = get_algorithm("quatro").config_cls(beta=0.0)  # no reference pass in this timing
    width = batch["tokens"].shape[1]
    padded = MicroBatching(rows=rows_per_micro_batch)
    budget = MicroBatching(max_tokens=rows_per_micro_batch * width)   # the same peak micro-batch size

    def step(batching):
        def run():
            with torch.no_grad():
                batch["old_logprobs"], _ = compute_logprobs(model, batch, batching)
            model_ddp.zero_grad_buffer()
            train_step_forward_backward(model_ddp, batch, get_algorithm("quatro").policy_loss, algo_config, batching)
        return run

    (padded_wall, padded_s), (budget_wall, budget_s) = interleaved_timings([step(padded), step(budget)], repeats)
    real = int(batch["lengths"].sum())
    computed = [padded_tokens(plan_by_rows(prompts.numel(), rows_per_micro_batch, width)),
                padded_tokens(plan_by_tokens(batch["lengths"], budget.max_tokens))]
    print(f"(b) CPU, tiny GPT, {prompts.numel()} rows (lengths 16x shorter: mean row "
          f"{batch['lengths'].float().mean():.0f}, longest {width}), old log-probs + train fwd/bwd, "
          f"{repeats} interleaved rounds:")
    print("                                   CPU s (least)   wall s (median)   tokens computed per real token")
    print(f"    padded rows ({rows_per_micro_batch}/micro-batch)   {padded_s:13.2f}   {padded_wall:15.2f}   "
          f"{computed[0] / real:.2f}")
    print(f"    token budget ({budget.max_tokens:,} tokens) {budget_s:13.2f}   {budget_wall:15.2f}   "
          f"{computed[1] / real:.2f}")
    print(f"    ratio token budget / padded: {budget_s / padded_s:.2f} (CPU time), "
          f"{budget_wall / padded_wall:.2f} (wall)")
    destroy_parallel()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    report_computed_tokens()
    from quatro_nemo.megatron.quiet import quiet_library_warnings

    quiet_library_warnings()
    report_cpu_step_time(args.repeats)


if __name__ == "__main__":
    main()
