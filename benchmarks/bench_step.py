"""Fixed-rollout step benchmark (issue 15): each algorithm's whole update on the SAME rollouts.

    OMP_NUM_THREADS=1 python benchmarks/bench_step.py [--repeats 3] [--rollouts PATH] [--algorithms quatro]

Timing algorithms in the real training loop mixes their own cost with the response lengths their
policies happen to sample. Here one set of rollouts is made once and saved (``--rollouts``;
default a temporary file): the tiny GPT's vocabulary, lengths from ``bench_packing``'s paper-like
distribution scaled 16x down (prompts 3..32, long-tailed responses capped at 192 tokens), binary
rewards with a per-prompt success rate. Every algorithm of the registry then replays it through
``quatro_nemo.engine.loop.learn_from_rollout``, the code ``train()`` runs for steps 4-6 of a step:
advantages (QUATRO's dual solve), reward shaping and DAPO's group filter, old and reference
log-probs (beta = 0.001 for every algorithm, the paper's App. B value), and K = 2 inner loops of
4 mini-batches (forward/backward in megatron's DDP, grad clip, megatron's Adam step), from the
same initial weights and a fresh optimizer each time (built outside the timed part).
Both micro-batchings run side by side: padded rows and a token budget of the same peak size.
Replays are interleaved (algorithm x batching, round after round); the figure is the least CPU
time of this process over the rounds (``bench_packing.interleaved_timings``); on a shared machine
read the ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_packing import (  # noqa: E402
    RESPONSE_CAP,
    interleaved_timings,
    paper_like_lengths,
    synthetic_batch,
    tiny_model_config,
)

SCALE = 1 / 16
NUM_PROMPTS, N, MINI_BATCH_PROMPTS, INNER_LOOPS, ROWS_PER_MICRO_BATCH = 8, 8, 2, 2, 16
VOCAB_SIZE = 64


def save_rollouts(path: str, seed: int = 0) -> None:
    """One rollout batch (a ``SampleOutput``'s tensors) and its [B, N] rewards, saved to ``path``."""
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = paper_like_lengths(NUM_PROMPTS, N, generator, SCALE)
    batch = synthetic_batch(prompts, responses, VOCAB_SIZE, generator)
    success_rate = torch.rand(NUM_PROMPTS, 1, generator=generator)
    rewards = (torch.rand(NUM_PROMPTS, N, generator=generator) < success_rate).double()
    sample = dict(tokens=batch["tokens"], response_mask=batch["response_mask"],
                  logprobs=torch.zeros_like(batch["response_mask"]), prompt_lengths=prompts,
                  response_lengths=responses, finished=responses < round(RESPONSE_CAP * SCALE))
    torch.save({"sample": sample, "rewards": rewards}, path)


def load_rollouts(path: str):
    from quatro_nemo.engine.rollout import RolloutBatch
    from quatro_nemo.megatron.sampling import SampleOutput

    saved = torch.load(path)
    return RolloutBatch(SampleOutput(**saved["sample"]), NUM_PROMPTS, N), saved["rewards"]


def experiment_config(algorithm: str, max_length: int, max_tokens: int):
    """The CPU default's config for ``algorithm`` at this benchmark's sizes (``max_tokens`` 0:
    padded rows)."""
    from quatro_nemo.engine.config import load_config

    return load_config([
        f"algorithm={algorithm}", "algorithm.beta=0.001", "algorithm.log_achieved_kl=false",
        f"model.vocab_size={VOCAB_SIZE}",
        f"model.max_position_embeddings={max_length}", f"trainer.prompts_per_step={NUM_PROMPTS}",
        f"trainer.mini_batch_prompts={MINI_BATCH_PROMPTS}", f"trainer.inner_loops={INNER_LOOPS}",
        f"rollout.n={N}", f"rollout.max_new_tokens={round(RESPONSE_CAP * SCALE)}",
        f"parallel.micro_batch_size={ROWS_PER_MICRO_BATCH}", f"parallel.max_tokens_per_micro_batch={max_tokens}",
    ])


def make_replay(cfg, model_cfg, initial_state, reference, rollout, rewards, optimizer_steps: dict):
    """(prepare, run): ``prepare`` builds the policy from ``initial_state`` in megatron's DDP with
    its optimizer and rollout backend, as ``train()`` does; ``run`` (the timed part) calls
    ``learn_from_rollout`` on the saved rollout and records the optimizer steps taken in
    ``optimizer_steps[algorithm name]``."""
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.engine.checkpoint import TrainState
    from quatro_nemo.engine.loop import (Run, build_training_state, learn_from_rollout, local_prompt_slots,
                                         shape_rewards, step_micro_batching)
    from quatro_nemo.engine.rollout import MegatronRolloutBackend
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model

    spec, trainer = get_algorithm(cfg.algorithm_name), cfg.trainer
    slots = local_prompt_slots(NUM_PROMPTS, MINI_BATCH_PROMPTS, 0, 1)
    scale = cfg.scale
    state = {}

    def prepare():
        policy = build_model(model_cfg)
        load_full_state_dict(policy, initial_state)
        backend = MegatronRolloutBackend(policy, stop_token_ids=[1], pad_id=0)
        policy_ddp, optimizer = build_training_state(policy, trainer, scale.distributed_optimizer)
        state["run"] = Run(cfg=cfg, spec=spec, algorithm_state=spec.make_state(cfg.algorithm), policy=policy,
                           policy_ddp=policy_ddp, optimizer=optimizer, reference=reference, backend=backend,
                           batching=step_micro_batching(cfg), slots=slots, state=TrainState())

    def run():
        _, groups = shape_rewards(spec, cfg.algorithm, rollout, rewards, NUM_PROMPTS, MINI_BATCH_PROMPTS,
                                  cfg.rollout.max_new_tokens)
        learned = learn_from_rollout(state["run"], cfg, rollout, groups)
        optimizer_steps[cfg.algorithm_name] = len(learned.metrics)
    return prepare, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--rollouts", default=None, help="saved rollouts to replay (made here if missing)")
    parser.add_argument("--algorithms", nargs="+", default=None,
                        help="a subset of the registry (gspo is always included: the ratios' base)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from quatro_nemo.algos import ALGORITHMS
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import destroy_parallel, initialize_parallel
    from quatro_nemo.megatron.quiet import quiet_library_warnings

    quiet_library_warnings()
    path = args.rollouts or os.path.join(tempfile.mkdtemp(prefix="bench_step_"), "rollouts.pt")
    if not os.path.exists(path):
        save_rollouts(path)
    rollout, rewards = load_rollouts(path)
    width = rollout.tokens.shape[1]
    max_tokens = ROWS_PER_MICRO_BATCH * width  # the padded path's micro-batch size, in tokens
    batchings = {"padded": 0, "token budget": max_tokens}

    initialize_parallel(seed=1234)
    model_cfg = tiny_model_config(width)
    reference = build_model(model_cfg)
    initial_state = {name: p.detach().clone() for name, p in reference.named_parameters()}
    reference.requires_grad_(False)

    algorithms = [name for name in ALGORITHMS if args.algorithms is None or name in args.algorithms + ["gspo"]]
    steps: dict = {}
    replays = {(name, batching): make_replay(experiment_config(name, width, budget), model_cfg, initial_state,
                                             reference, rollout, rewards, steps)
               for name in algorithms for batching, budget in batchings.items()}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(f"rollouts {path}: {NUM_PROMPTS} prompts x {N}, mean row {float(rollout.lengths.float().mean()):.0f} "
          f"tokens, longest {width}; K={INNER_LOOPS} x {NUM_PROMPTS // MINI_BATCH_PROMPTS} mini-batches; "
          f"padded = {ROWS_PER_MICRO_BATCH} rows/micro-batch, token budget = {max_tokens:,} tokens")
    prepares, runs = zip(*replays.values())
    timings = dict(zip(replays, interleaved_timings(list(runs), args.repeats, prepares=list(prepares))))
    print(f"learn_from_rollout, {args.repeats} interleaved rounds: least CPU seconds of this process (median wall in "
          "brackets); ratios of CPU time vs GSPO on the same batching")
    print("algorithm  opt.steps   padded CPU s (wall)   /GSPO   budget CPU s (wall)   /GSPO   budget/padded")
    for name in algorithms:
        (padded_wall, padded), (budget_wall, budget) = timings[(name, "padded")], timings[(name, "token budget")]
        print(f"{name:9s}  {steps[name]:9d}   {padded:7.2f} ({padded_wall:7.2f})   "
              f"{padded / timings[('gspo', 'padded')][1]:5.3f}   {budget:7.2f} ({budget_wall:7.2f})   "
              f"{budget / timings[('gspo', 'token budget')][1]:5.3f}   {budget / padded:13.2f}")
    destroy_parallel()


if __name__ == "__main__":
    main()
