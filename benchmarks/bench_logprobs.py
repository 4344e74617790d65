"""What the log-prob loss's backward costs when the entropy is a metric only (detached, as
quatro_nemo.megatron.loss does) against the same backward with the entropy's gradient
materialised as zeros (what every backward computed before the entropy's gradient was left
unmaterialised: quatro_nemo.megatron.logprobs).

    OMP_NUM_THREADS=1 python benchmarks/bench_logprobs.py [--vocab 32768] [--tokens 2048] [--rounds 3]

Float32 logits [tokens, vocab] (one TP rank's slice), per-token log-probs and entropies
(``vocab_parallel_logprobs_and_entropy``), then the backward of ``sum(w * log p)``: with the
entropy detached ("after") or added at weight 0 ("before": its zero gradient goes through the
entropy term, as autograd's materialised zeros did). Prints, for each, the peak bytes per logit
element of the forward and of the backward (the logits included) and the backward's least seconds
over ``--rounds``, then after/before ratios.

Memory on the CPU is each variant's peak resident set in a fresh process (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``; ``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors go back to
the kernel, as tests/engine/memory_probe.py measures the planner's terms); with CUDA the logits are
on the GPU and it is ``torch.cuda.max_memory_allocated`` above what was allocated before (the
planner's LOSS_BYTES_PER_LOGIT, quatro_nemo.engine.memory_plan, counts these bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from quatro_nemo.megatron.logprobs import vocab_parallel_logprobs_and_entropy  # noqa: E402
from tests.engine.memory_probe import memory_kb, reset_peak  # noqa: E402

VARIANTS = ("before", "after")  # the entropy's zero gradient materialised / never materialised


def make_case(tokens: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(tokens, vocab, generator=gen)
    target, weights = torch.randint(0, vocab, (tokens,), generator=gen), torch.randn(tokens, generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return logits.to(device).requires_grad_(), target.to(device), weights.to(device)


def loss_of(variant: str, logits, target, weights):
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, target, group=None, vocab_start=0)
    loss = (weights * logprobs).sum()
    return loss + (0.0 * entropy).sum() if variant == "before" else loss


def measure_memory(variant: str, tokens: int, vocab: int) -> dict:
    """In this (fresh) process: peak bytes per logit of the forward and of the backward."""
    for warm_up in VARIANTS:  # the kernels' code pages and the allocator's arenas, before the baseline
        loss_of(warm_up, *make_case(16, vocab)).backward()
    baseline = memory_kb("VmRSS")
    logits, target, weights = make_case(tokens, vocab)
    reset_peak()
    loss = loss_of(variant, logits, target, weights)
    forward = memory_kb("VmHWM") - baseline
    reset_peak()
    loss.backward()
    backward = memory_kb("VmHWM") - baseline
    return {"forward": forward * 1024 / logits.numel(), "backward": backward * 1024 / logits.numel()}


def measure_cuda_memory(variant: str, tokens: int, vocab: int) -> dict:
    """On the GPU: peak bytes per logit of the forward and of the backward, the logits included."""
    logits, target, weights = make_case(tokens, vocab)
    baseline = torch.cuda.memory_allocated() - logits.numel() * logits.element_size()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_of(variant, logits, target, weights)
    forward = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    backward = torch.cuda.max_memory_allocated() - baseline
    return {"forward": forward / logits.numel(), "backward": backward / logits.numel()}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_seconds(tokens: int, vocab: int, rounds: int) -> dict:
    """The backward's least seconds of each variant, interleaved round by round."""
    logits, target, weights = make_case(tokens, vocab)
    best = {variant: float("inf") for variant in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            logits.grad = None
            loss = loss_of(variant, logits, target, weights)
            synchronize()
            start = time.perf_counter()
            loss.backward()
            synchronize()
            best[variant] = min(best[variant], time.perf_counter() - start)
    return best


def memory_in_fresh_process(variant: str, tokens: int, vocab: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-W", "ignore", __file__, "--memory-of", variant, "--tokens", str(tokens),
                          "--vocab", str(vocab)], env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's measurement
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_of:
        print(json.dumps(measure_memory(args.memory_of, args.tokens, args.vocab)))
        return
    measure = measure_cuda_memory if torch.cuda.is_available() else memory_in_fresh_process
    memory = {variant: measure(variant, args.tokens, args.vocab) for variant in VARIANTS}
    seconds = measure_seconds(args.tokens, args.vocab, args.rounds)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.tokens} tokens x {args.vocab} vocabulary = {args.tokens * args.vocab / 1e6:.1f} M float32 logits "
          f"on {device}")
    for variant in VARIANTS:
        print(f"{variant:>7}: forward peak {memory[variant]['forward']:5.1f} B/logit, backward peak "
              f"{memory[variant]['backward']:5.1f} B/logit, backward {seconds[variant] * 1e3:8.1f} ms")
    before, after = memory["before"], memory["after"]
    print(f"after / before: backward peak x{after['backward'] / before['backward']:.2f}, loss peak (forward or "
          f"backward) x{max(after.values()) / max(before.values()):.2f}, backward time "
          f"x{seconds['after'] / seconds['before']:.2f}")


if __name__ == "__main__":
    main()
