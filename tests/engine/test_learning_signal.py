"""No step without a signal (issue 31): the loop's update (``learn_from_rollout``) on a fixed
rollout with megatron's model, DDP and Adam, with rewards chosen on purpose.

- pi_old's and pi_ref's log-probs equal what every training forward computes, bitwise, in both
  micro-batchings: the log-prob passes split each mini-batch as its training forward does.
- a rollout whose advantages are all zero leaves the weights bitwise unchanged (no optimizer
  step: neither weight decay nor Adam's momentum from earlier steps acts), and a zero-advantage
  mini-batch among mini-batches with a signal takes no step either.

Each runs on this machine's kernels and on a stand-in for kernels whose float rounding depends
on the micro-batch's shape (AVX-512's do, this machine's may not): the logits scaled by a factor
that is a function of the micro-batch's rows x width. On such kernels a row computed in two
micro-batches of different shapes gets two different log-probs; in the same shape, the same.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_ranks

NUM_PROMPTS, N, MINI_BATCH_PROMPTS, WIDTH, VOCAB = 4, 4, 2, 16, 64
LAYOUTS = {
    # 3 rows per micro-batch does not divide a mini-batch's 8 rows: whole-batch slices of 3 rows
    # straddle the mini-batches, the training forward's restart at each.
    "padded": ["parallel.micro_batch_size=3"],
    "token budget": ["parallel.micro_batch_size=3", "parallel.max_tokens_per_micro_batch=40"],
}
KERNELS = ("this machine's", "shape-sensitive")


def _rollout():
    """NUM_PROMPTS x N rows: prompts of 3-5 tokens, responses of 1-10 tokens, right padding."""
    from quatro_nemo.engine.rollout import RolloutBatch
    from quatro_nemo.megatron.sampling import SampleOutput

    gen = torch.Generator().manual_seed(11)
    rows = NUM_PROMPTS * N
    prompts = 3 + torch.arange(rows) % 3
    responses = 1 + (torch.arange(rows) * 7) % 10
    tokens = torch.randint(2, VOCAB, (rows, WIDTH), generator=gen)
    response_mask = torch.zeros(rows, WIDTH - 1)
    for row in range(rows):
        end = int(prompts[row] + responses[row])
        tokens[row, end:] = 0
        response_mask[row, int(prompts[row]) - 1:end - 1] = 1.0
    sample = SampleOutput(tokens=tokens, response_mask=response_mask, logprobs=torch.zeros(rows, WIDTH - 1),
                          prompt_lengths=prompts, response_lengths=responses,
                          finished=torch.ones(rows, dtype=torch.bool))
    return RolloutBatch(sample, NUM_PROMPTS, N)


def _rewards(signalled_prompts):
    """[B, N] rewards: one success in each group of ``signalled_prompts``, 0 everywhere else (so
    every other group's advantages are 0 under every estimator)."""
    rewards = torch.zeros(NUM_PROMPTS, N, dtype=torch.float64)
    for prompt in signalled_prompts:
        rewards[prompt, prompt % N] = 1.0
    return rewards


def _use_shape_sensitive_kernels():
    """Every model forward of the engine's schedule scales the logits by a factor that depends on
    the micro-batch's shape (a deterministic stand-in for shape-dependent rounding)."""
    from quatro_nemo.megatron import forward

    model_forward = forward._model_forward

    def shape_sensitive(model, micro_batch):
        logits = model_forward(model, micro_batch)
        rows, width = logits.shape[:2]
        return logits * (1.0 + 2.0 ** -12 * (rows * width % 61))

    forward._model_forward = shape_sensitive


class _Backend:
    def update_weights(self) -> None:
        pass


def _learner(overrides, kernels, algorithm="quatro", with_reference=True):
    """(learn(rewards, spec=None) -> RolloutLearning, policy): the engine's update on the fixed
    rollout, as ``build_run()`` builds it (``build_training_state``, a reference copy of the policy)."""
    from quatro_nemo.algos import get_algorithm
    from quatro_nemo.algos.reward_shaping import ShapedGroups
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.checkpoint import TrainState
    from quatro_nemo.engine.loop import (Run, build_training_state, learn_from_rollout, local_prompt_slots,
                                         step_micro_batching)
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=3)
    if kernels == "shape-sensitive":
        _use_shape_sensitive_kernels()
    cfg = load_config([f"algorithm={algorithm}", f"trainer.prompts_per_step={NUM_PROMPTS}",
                       f"trainer.mini_batch_prompts={MINI_BATCH_PROMPTS}", "trainer.inner_loops=2",
                       f"rollout.n={N}", "trainer.lr=1e-2", *overrides])
    model_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                            num_attention_heads=4, max_position_embeddings=WIDTH)
    policy = build_model(model_cfg)
    policy_ddp, optimizer = build_training_state(policy, cfg.trainer, distributed_optimizer=False)
    reference = None
    if with_reference:
        reference = build_model(model_cfg)
        reference.load_state_dict(policy.state_dict())
        reference.requires_grad_(False)
    rollout = _rollout()
    slots = local_prompt_slots(NUM_PROMPTS, MINI_BATCH_PROMPTS, 0, 1)

    def learn(rewards, spec=None):
        groups = ShapedGroups(rewards=rewards, weights=torch.ones(NUM_PROMPTS, dtype=torch.float64))
        spec = spec or get_algorithm(cfg.algorithm_name)
        run = Run(cfg=cfg, spec=spec, algorithm_state=spec.make_state(cfg.algorithm), policy=policy,
                  policy_ddp=policy_ddp, optimizer=optimizer, reference=reference, backend=_Backend(),
                  batching=step_micro_batching(cfg), slots=slots, state=TrainState())
        return learn_from_rollout(run, cfg, rollout, groups)

    return learn, policy


def _weights(policy):
    return {name: param.detach().clone() for name, param in policy.named_parameters()}


def _same_weights(before, after):
    return [name for name in before if not torch.equal(before[name], after[name])] == []


def _logprobs_rank(rank, overrides, kernels):
    """Every training forward's log-probs next to the old and reference log-probs it was given
    (all-zero rewards, no weight decay: the policy stays pi_old = pi_ref throughout)."""
    from quatro_nemo.algos import get_algorithm

    learn, _ = _learner(overrides + ["trainer.weight_decay=0.0", "algorithm.beta=0.01"], kernels)
    spec = get_algorithm("quatro")
    seen = []

    def spy(logprobs, old_logprobs, *args, ref_logprobs=None, **kwargs):
        seen.append((logprobs.detach().clone(), old_logprobs.clone(), ref_logprobs.clone()))
        return spec.policy_loss(logprobs, old_logprobs, *args, ref_logprobs=ref_logprobs, **kwargs)

    learn(_rewards([]), dataclasses.replace(spec, policy_loss=spy))
    return seen


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_old_and_reference_logprobs_equal_every_training_forward_bitwise(layout, kernels):
    """Each micro-batch of the training forward (rows and width) was computed whole by the
    log-prob passes: its log-probs, padding included, equal pi_old's and pi_ref's bitwise."""
    seen = run_ranks(1, _logprobs_rank, LAYOUTS[layout], kernels)[0]
    assert len(seen) >= 2 * 2 * 2  # K = 2 loops x 2 mini-batches x at least 2 micro-batches
    for logprobs, old_logprobs, ref_logprobs in seen:
        assert torch.equal(logprobs, old_logprobs)
        assert torch.equal(logprobs, ref_logprobs)


def _no_signal_rank(rank, overrides, kernels, case):
    """Weights before and after a rollout with all-zero rewards, and its optimizer steps.

    ``after a step``: a rollout with a signal first (Adam's moments non-zero, the policy off pi_ref,
    so no reference KL: beta 0); ``at the reference``: the first rollout, beta > 0 (the k3 term
    at pi_theta = pi_ref has a zero gradient)."""
    overrides = overrides + ["trainer.weight_decay=0.1",
                             "algorithm.beta=0.0" if case == "after a step" else "algorithm.beta=0.01"]
    learn, policy = _learner(overrides, kernels, with_reference=case == "at the reference")
    first_steps = None
    if case == "after a step":
        initial = _weights(policy)
        first_steps = len(learn(_rewards(range(NUM_PROMPTS))).metrics)
        assert not _same_weights(initial, _weights(policy))
    before = _weights(policy)
    learned = learn(_rewards([]))
    return first_steps, len(learned.metrics), _same_weights(before, _weights(policy))


@pytest.mark.parametrize("case", ["after a step", "at the reference"])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_rollout_without_signal_leaves_the_weights_bitwise_unchanged(layout, kernels, case):
    first_steps, steps, unchanged = run_ranks(1, _no_signal_rank, LAYOUTS[layout], kernels, case)[0]
    assert first_steps in (None, 2 * 2)  # with a signal: K = 2 loops x 2 mini-batches of steps
    assert steps == 0
    assert unchanged


def _mixed_rank(rank, overrides, kernels):
    learn, policy = _learner(overrides + ["trainer.weight_decay=0.1", "algorithm.beta=0.0"], kernels,
                             algorithm="grpo", with_reference=False)
    before = _weights(policy)
    learned = learn(_rewards([0, 1]))   # the first mini-batch's prompts only
    return len(learned.metrics), _same_weights(before, _weights(policy))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_zero_advantage_mini_batch_takes_no_step_between_mini_batches_with_a_signal(layout, kernels):
    """GRPO's loss is the advantage times the ratio: the second mini-batch (all advantages 0)
    has an exactly zero gradient even after the first one moved the policy, so each of the K = 2
    loops steps once."""
    steps, unchanged = run_ranks(1, _mixed_rank, LAYOUTS[layout], kernels)[0]
    assert steps == 2
    assert not unchanged
