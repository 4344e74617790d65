"""Supervised warm-start that produces the CPU task's "base model" (``docs/cpu-task.md`` item 4).

The base model plays the role of a pretrained LM: it solves some held-out problems often, some
rarely, and prefers some solution styles. Demonstrations come from a **biased** generator of
Countdown solutions: operators are drawn with ``op_weights`` (default: ``+`` and ``*`` common,
``-`` and ``/`` rare) and commutative steps are written larger operand first with probability
``larger_first``. Problems whose solutions need ``-`` or ``/`` stay hard for the base model, and
RL has several modes it can either sharpen onto or keep. A demonstration combines every given
number with probability ``all_numbers`` (else a random subset): a problem has one or two short
shortcuts but many full-length solutions, so demonstrations that use every number spread the
imitated distribution over several correct solutions per problem (issue 16: the CPU default's
base model samples >= 3 distinct correct expressions per solved held-out prompt).

Runs in one process (TP=1, PP=1); the full state dict is cached under
``<cache_dir>/<hash>.pt`` keyed by a hash of (task, tokenizer, model, warm-start) configs, so a
run in any parallel layout loads the same base model (``checkpoint.load_full_state_dict``). A
distributed run calls :func:`load_or_train_base_model` on every rank: rank 0 trains in a clean
subprocess if the cache is missing, the others wait for the file.

Run as a script to (re)build the cache: ``python -m quatro_nemo.tasks.countdown.warmstart SPEC.json``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from quatro_nemo.tasks.countdown.problems import (
    CountdownTaskConfig,
    apply_operator,
    format_prompt,
    format_steps,
    split_of,
)
from quatro_nemo.data.tokenizer import CharTokenizer, TokenizerConfig
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.quiet import quiet_library_warnings
from quatro_nemo.validation import ConfigError, check_at_least, check_in_unit_interval, check_number, check_positive

CACHE_FORMAT_VERSION = 1


@dataclass
class WarmStartConfig:
    """Validated in ``__post_init__`` (:mod:`quatro_nemo.validation`: ConfigError naming the key)."""

    enabled: bool = True        # false: no warm-start; the base model is megatron's random init
    steps: int = 600
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    op_weights: Dict[str, float] = field(default_factory=lambda: {"+": 1.0, "*": 1.0, "-": 0.15, "/": 0.15})
    larger_first: float = 0.85
    # probability that a demonstration combines every given number (else a random subset of 2 or
    # more): longer solutions, of which a problem has many, against the one short shortcut
    all_numbers: float = 0.0
    seed: int = 0
    cache_dir: str = "~/.cache/quatro_nemo/warmstart"

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size"):
            check_at_least(f"warmstart.{key}", getattr(self, key), 1)
        check_positive("warmstart.learning_rate", self.learning_rate)
        check_number("warmstart.warmup_steps", self.warmup_steps, non_negative=True)
        self.op_weights = {str(k): float(v) for k, v in dict(self.op_weights).items()}
        if set(self.op_weights) != {"+", "-", "*", "/"}:
            raise ConfigError(f"warmstart.op_weights={self.op_weights} must give a weight to each of + - * /")
        if any(v < 0 for v in self.op_weights.values()) or sum(self.op_weights.values()) <= 0:
            raise ConfigError(f"warmstart.op_weights={self.op_weights} must be >= 0 with a positive sum")
        for key in ("larger_first", "all_numbers"):
            check_in_unit_interval(f"warmstart.{key}", getattr(self, key), closed_low=True)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Biased demonstrations


def draw_demonstration(rng: random.Random, task: CountdownTaskConfig, config: WarmStartConfig) -> Tuple[Dict[str, Any], str]:
    """A (train-split problem, biased solution) pair.

    Draws the numbers as the task does, combines all of them (probability ``all_numbers``) or a
    random subset of them into one expression tree
    (every result used by the next combination, so no dead steps) with operators drawn by
    ``op_weights`` among those valid for the operands, and takes the final value as the target.
    """
    ops = list(config.op_weights)
    while True:
        k = rng.choice(task.num_numbers)
        numbers = [rng.randint(task.min_number, task.max_number) for _ in range(k)]
        pool = list(numbers) if rng.random() < config.all_numbers else rng.sample(numbers, rng.randint(2, k))
        steps = []
        while len(pool) > 1:
            x = pool.pop(rng.randrange(len(pool)))
            y = pool.pop(rng.randrange(len(pool)))
            big, small = max(x, y), min(x, y)
            valid = [op for op in ops if apply_operator(big, op, small) is not None]
            op = rng.choices(valid, weights=[config.op_weights[o] for o in valid])[0]
            a, b = (big, small) if (op in "-/" or rng.random() < config.larger_first) else (small, big)
            steps.append((a, op, b, apply_operator(a, op, b)))
            pool.append(steps[-1][3])
        target = pool[0]
        if not task.min_target <= target <= task.max_target or target in numbers:
            continue
        if split_of(numbers, target, task.heldout_fraction) != "train":
            continue
        return {"numbers": numbers, "target": target, "prompt": format_prompt(numbers, target)}, format_steps(steps)


def demonstration_batch(rng: random.Random, task: CountdownTaskConfig, config: WarmStartConfig,
                        tokenizer: CharTokenizer) -> Tuple[torch.Tensor, torch.Tensor]:
    """``tokens [B, L]`` (bos + prompt + solution + eos, right-padded) and ``loss_mask [B, L]``
    (1 where the *label* ``tokens[:, t+1]`` is a solution token, i.e. aligned with megatron's
    per-position loss of predicting the next token)."""
    rows, masks = [], []
    for _ in range(config.batch_size):
        problem, solution = draw_demonstration(rng, task, config)
        prompt_ids = tokenizer.encode_prompt(problem["prompt"])
        response_ids = tokenizer.encode_response(solution)
        rows.append(prompt_ids + response_ids)
        masks.append([0] * (len(prompt_ids) - 1) + [1] * len(response_ids))
    length = max(len(r) for r in rows)
    tokens = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        tokens[i, : len(row)] = torch.tensor(row)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    return tokens, loss_mask


# --------------------------------------------------------------------------------------------
# Training (one process, TP=1, PP=1)


def _learning_rate(step: int, config: WarmStartConfig) -> float:
    """Linear warm-up then cosine decay to 10% (the usual SFT schedule)."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_base_model(task: CountdownTaskConfig, tokenizer_config: TokenizerConfig, model_config,
                     config: WarmStartConfig, log_every: int = 100) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Train the base model from scratch; returns ``(full state dict, report)``.

    Needs megatron initialised with TP=1 and PP=1 (:func:`initialize_parallel` in one process).
    """
    from quatro_nemo.megatron.models import build_model

    if parallel.tp_size() != 1 or parallel.pp_size() != 1:
        raise RuntimeError("train_base_model runs at TP=1, PP=1 (use load_or_train_base_model)")
    tokenizer = CharTokenizer(tokenizer_config)
    if model_config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_config.vocab_size} must equal the tokenizer's padded vocabulary "
            f"size {tokenizer.vocab_size}"
        )
    torch.manual_seed(config.seed)
    model = build_model(model_config, megatron_ddp=False)  # trained by torch AdamW below
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.98),
                                  weight_decay=config.weight_decay)
    rng = random.Random(f"warmstart-{config.seed}")
    started = time.perf_counter()
    losses: List[float] = []
    for step in range(config.steps):
        tokens, loss_mask = demonstration_batch(rng, task, config, tokenizer)
        labels = torch.roll(tokens, shifts=-1, dims=1)
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, config)
        per_token = model(tokens, position_ids, None, labels=labels)  # [B, L] cross-entropy
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        if log_every and (step + 1) % log_every == 0:
            print(f"warm-start step {step + 1}/{config.steps} loss {sum(losses[-log_every:]) / log_every:.4f}",
                  flush=True)
    report = {
        "seconds": time.perf_counter() - started,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "steps": config.steps,
    }
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    return state, report


# --------------------------------------------------------------------------------------------
# Cache


def cache_key(task: CountdownTaskConfig, tokenizer_config: TokenizerConfig, model_config, config: WarmStartConfig) -> str:
    """sha256 of everything that determines the base model (not the cache directory)."""
    warm = config.to_dict()
    warm.pop("cache_dir")
    spec = {"version": CACHE_FORMAT_VERSION, "task": task.to_dict(), "tokenizer": tokenizer_config.to_dict(),
            "model": model_config.to_dict(), "warmstart": warm}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(task, tokenizer_config, model_config, config: WarmStartConfig) -> Path:
    directory = Path(os.path.expanduser(config.cache_dir))
    return directory / f"base-{cache_key(task, tokenizer_config, model_config, config)}.pt"


def _spec(task, tokenizer_config, model_config, config) -> Dict[str, Any]:
    return {"task": task.to_dict(), "tokenizer": tokenizer_config.to_dict(),
            "model": model_config.to_dict(), "warmstart": config.to_dict()}


def _configs_from_spec(spec: Dict[str, Any]):
    from quatro_nemo.megatron.models import ModelConfig

    return (CountdownTaskConfig(**spec["task"]), TokenizerConfig(**spec["tokenizer"]),
            ModelConfig(**spec["model"]), WarmStartConfig(**spec["warmstart"]))


def _save_atomic(payload: Dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def build_cache(task, tokenizer_config, model_config, config: WarmStartConfig) -> Path:
    """Train and write the cache file (in this process; it must not be in a multi-rank group)."""
    from quatro_nemo.megatron.parallel import destroy_parallel, initialize_parallel

    path = cache_path(task, tokenizer_config, model_config, config)
    initialize_parallel(1, 1, seed=config.seed)
    try:
        state, report = train_base_model(task, tokenizer_config, model_config, config)
    finally:
        destroy_parallel()
    _save_atomic({"state_dict": state, "report": report, "spec": _spec(task, tokenizer_config, model_config, config)}, path)
    return path


def _build_cache_in_subprocess(task, tokenizer_config, model_config, config: WarmStartConfig) -> None:
    path = cache_path(task, tokenizer_config, model_config, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec_file = path.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(_spec(task, tokenizer_config, model_config, config), default=list))
    from quatro_nemo.megatron.parallel import standalone_environment

    subprocess.run([sys.executable, "-m", "quatro_nemo.tasks.countdown.warmstart", str(spec_file)], check=True,
                   env=standalone_environment())


def load_or_train_base_model(task, tokenizer_config, model_config, config: WarmStartConfig,
                             timeout_s: float = 1800.0) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The cached base model's full state dict and warm-start report; trains it when missing.

    Works before or after ``initialize_parallel``: with no process group, or a one-process
    TP=1/PP=1 one, it trains in this process (re-initialising megatron at TP=1); in a multi-rank
    group, rank 0 trains in a subprocess and every rank waits for the file.
    """
    path = cache_path(task, tokenizer_config, model_config, config)
    if not path.exists():
        distributed = parallel.is_distributed()
        if distributed and parallel.world_size() > 1:
            if parallel.global_rank() == 0:
                _build_cache_in_subprocess(task, tokenizer_config, model_config, config)
            deadline = time.time() + timeout_s
            while not path.exists():
                if time.time() > deadline:
                    raise TimeoutError(f"the warm-start cache {path} did not appear within {timeout_s} s")
                time.sleep(0.5)
        elif distributed:
            _build_cache_in_subprocess(task, tokenizer_config, model_config, config)
        else:
            build_cache(task, tokenizer_config, model_config, config)
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return payload["state_dict"], payload["report"]


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m quatro_nemo.tasks.countdown.warmstart SPEC.json")
    torch.set_num_threads(1)
    quiet_library_warnings()
    spec = json.loads(Path(argv[0]).read_text())
    print(f"warm-start cache written to {build_cache(*_configs_from_spec(spec))}", flush=True)


if __name__ == "__main__":
    main()
