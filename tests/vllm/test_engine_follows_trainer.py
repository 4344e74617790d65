"""The real engine (vLLM's CPU build) follows the trainer: the engine/trainer log-prob gap after
every push while the policy moves, the prefix cache after a push, and the caller's random streams.

``train()`` runs in a forked rank (``tests/distributed.run_ranks``) so that a reward rule can be
put in at the task's boundary: a random policy earns no Countdown reward, and a step with no
learning signal leaves the weights, and so the engine, unchanged. Each check has its negative
control in the same test (a stale push, no prefix-cache reset): the gap metric must see it.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.vllm.conftest import GAP_TOKEN_MAX, GAP_TOKEN_MEAN, REPO, SMALL

pytestmark = pytest.mark.slow


def _train_rank(rank, args, stale_push):
    from quatro_nemo.engine import loop
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.logging import read_metrics
    from quatro_nemo.engine.vllm_backend import VllmRolloutBackend

    # a reward any policy earns about half the time (an even number of characters), so every group
    # has a learning signal: the GPU check's (scripts/gpu_check_train.py)
    spec = importlib.util.spec_from_file_location("gpu_check_train", REPO / "scripts" / "gpu_check_train.py")
    gpu_check_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check_train)
    gpu_check_train.reward_any_policy_earns()
    if stale_push:  # the negative control: the engine keeps the weights of its first push
        VllmRolloutBackend.update_weights = lambda self: None
    cfg = load_config(args)
    loop.train(cfg)
    return [r for r in read_metrics(os.path.join(cfg.run.dir, "metrics.jsonl")) if r["kind"] == "train"]


def test_engine_log_probs_follow_every_push_and_a_stale_push_shows(tmp_path):
    args = SMALL + ["eval.num_problems=0", "trainer.steps=3", "trainer.lr=1e-2"]
    # with truncated importance sampling on: the weights are ~1 here, and the path runs through the product
    moving = run_ranks(1, _train_rank, args + [f"run.dir={tmp_path / 'pushed'}", "rollout.importance_correction=token"],
                       False)[0]
    assert [r["step"] for r in moving] == [1, 2, 3]
    for record in moving:
        assert record["grad_norm"] > 0 and 0 < record["reward/mean"] < 1, record  # the policy moves
        assert record["engine_gap/token_abs_max"] < GAP_TOKEN_MAX, record
        assert record["engine_gap/token_abs_mean"] < GAP_TOKEN_MEAN, record
    stale = run_ranks(1, _train_rank, args + [f"run.dir={tmp_path / 'stale'}"], True)[0]
    assert stale[0]["engine_gap/token_abs_max"] < GAP_TOKEN_MAX  # the first push still happens
    for record in stale[1:]:  # then the engine samples from weights the trainer has left
        assert record["engine_gap/token_abs_mean"] > 10 * GAP_TOKEN_MEAN, record


MODEL = dict(architecture="qwen2", vocab_size=128, hidden_size=128, num_layers=2, num_attention_heads=2,
             num_query_groups=2, ffn_hidden_size=256, max_position_embeddings=320, init_method_std=0.2)


def _build(seed=3):
    from quatro_nemo.engine.config import VllmConfig
    from quatro_nemo.engine.vllm_backend import VllmRolloutBackend
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=seed)
    config = ModelConfig(**MODEL)
    model = build_model(config)
    engine = VllmConfig(enforce_eager=True, kv_cache_memory_gb=0.25)  # the CPU build would take half the RAM
    return model, config, lambda: VllmRolloutBackend(model, config, engine, stop_token_ids=[1], pad_id=0)


def _gap_after_a_push(rank, reset_prefix_cache):
    from quatro_nemo.engine.loop import engine_gap_metrics
    from quatro_nemo.engine.rollout import model_inputs
    from quatro_nemo.megatron.forward import compute_logprobs
    from quatro_nemo.megatron.sampling import SamplingParams

    model, _, make_backend = _build()
    backend = make_backend()
    if not reset_prefix_cache:  # the negative control
        backend.llm.reset_prefix_cache = lambda *args, **kwargs: True
    # longer than two of the CPU build's 128-token cache blocks: the prefix cache holds full blocks only
    prompts = torch.randint(2, 128, (4, 300), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=7)
    gaps = []
    for push in range(2):
        if push:  # the trainer moves; the next generate pushes the new weights
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.2 * torch.randn_like(param))
            backend.update_weights()
        rollout = backend.generate(prompts, 2, params)
        trainer, _ = compute_logprobs(model, model_inputs(rollout, torch.device("cpu")), 64)
        gaps.append(engine_gap_metrics(rollout.engine_logprobs, trainer, rollout.response_mask))
    return gaps


def test_a_push_resets_the_prefix_cache():
    """Without sleep mode (the CPU build, or vllm.sleep_between_phases=false) the engine keeps its
    prefix cache: the prompts' KV computed with the old weights would serve the new policy."""
    first, second = run_ranks(1, _gap_after_a_push, True)[0]
    assert first["engine_gap/token_abs_max"] < GAP_TOKEN_MAX and second["engine_gap/token_abs_max"] < GAP_TOKEN_MAX
    first, second = run_ranks(1, _gap_after_a_push, False)[0]
    assert first["engine_gap/token_abs_max"] < GAP_TOKEN_MAX
    assert second["engine_gap/token_abs_mean"] > 10 * GAP_TOKEN_MEAN, second


def _random_streams_around_the_engine(rank):
    import random

    import numpy as np

    from quatro_nemo.engine.checkpoint import rng_state

    _, _, make_backend = _build()
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before, set_num_threads, threads = rng_state(), torch.set_num_threads, torch.get_num_threads()
    make_backend()
    after = rng_state()
    return {"python": before["python"] == after["python"],
            "numpy": all(np.array_equal(a, b) for a, b in zip(before["numpy"], after["numpy"])),
            "torch": torch.equal(before["torch"], after["torch"]),
            "megatron_tracker": all(torch.equal(before["megatron_tracker"][k], after["megatron_tracker"][k])
                                    for k in before["megatron_tracker"]),
            "set_num_threads": torch.set_num_threads is set_num_threads,
            "threads": torch.get_num_threads() == threads}


def test_building_the_engine_leaves_the_trainers_random_streams_and_threads():
    """vLLM reseeds Python's, NumPy's and torch's global generators at start-up (to its own seed)
    and on the CPU replaces torch.set_num_threads with a no-op."""
    kept = run_ranks(1, _random_streams_around_the_engine)[0]
    assert kept == dict.fromkeys(kept, True) and len(kept) == 6
