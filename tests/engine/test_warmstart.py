"""Warm-start: biased demonstrations, label alignment, cache keyed by configs, loads in any layout."""
from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from quatro_nemo.tasks.countdown.problems import CountdownTaskConfig, is_correct, parse_steps, split_of
from quatro_nemo.data.tokenizer import CharTokenizer, TokenizerConfig
from quatro_nemo.tasks.countdown.warmstart import (
    WarmStartConfig,
    cache_key,
    demonstration_batch,
    draw_demonstration,
)
from tests.distributed import run_ranks

TASK = CountdownTaskConfig()


def _op_counts(config, draws=600):
    rng = random.Random(0)
    counts = Counter()
    for _ in range(draws):
        problem, solution = draw_demonstration(rng, TASK, config)
        assert is_correct(problem["numbers"], problem["target"], solution), (problem, solution)
        assert split_of(problem["numbers"], problem["target"], TASK.heldout_fraction) == "train"
        counts.update(op for _, op, _, _ in parse_steps(solution))
    return counts


def test_demonstrations_are_correct_train_problems_with_biased_operators():
    biased = _op_counts(WarmStartConfig())
    uniform = _op_counts(WarmStartConfig(op_weights={"+": 1, "-": 1, "*": 1, "/": 1}))
    biased_share = (biased["-"] + biased["/"]) / sum(biased.values())
    uniform_share = (uniform["-"] + uniform["/"]) / sum(uniform.values())
    assert 0.02 < biased_share < 0.2 < uniform_share  # rare, but not absent


def test_all_numbers_demonstrations_combine_every_given_number():
    def steps_minus_numbers(all_numbers):
        rng = random.Random(0)
        config = WarmStartConfig(all_numbers=all_numbers)
        out = []
        for _ in range(200):
            problem, solution = draw_demonstration(rng, TASK, config)
            out.append(len(parse_steps(solution)) - (len(problem["numbers"]) - 1))
        return out

    assert set(steps_minus_numbers(1.0)) == {0}          # k numbers -> k - 1 steps, always
    assert min(steps_minus_numbers(0.0)) < 0              # a random subset: often fewer


def test_loss_mask_selects_exactly_the_solution_and_eos_labels():
    tokenizer = CharTokenizer()
    config = WarmStartConfig(batch_size=5)
    tokens, loss_mask = demonstration_batch(random.Random(1), TASK, config, tokenizer)
    rng = random.Random(1)
    for row in range(5):
        problem, solution = draw_demonstration(rng, TASK, config)
        labels = tokens[row, 1:][loss_mask[row, :-1].bool()].tolist()
        assert labels == tokenizer.encode(solution) + [tokenizer.eos_id]
        assert loss_mask[row, -1] == 0 or tokens.shape[1] > len(labels)


def test_cache_key_depends_on_every_config_but_not_the_directory():
    from quatro_nemo.megatron.models import ModelConfig

    model = ModelConfig(vocab_size=32)
    base = cache_key(TASK, TokenizerConfig(), model, WarmStartConfig())
    assert base == cache_key(TASK, TokenizerConfig(), model, WarmStartConfig(cache_dir="/elsewhere"))
    others = {
        cache_key(replace(TASK, seed=1), TokenizerConfig(), model, WarmStartConfig()),
        cache_key(TASK, TokenizerConfig(pad_vocab_to_multiple_of=32), model, WarmStartConfig()),
        cache_key(TASK, TokenizerConfig(), ModelConfig(vocab_size=32, hidden_size=64), WarmStartConfig()),
        cache_key(TASK, TokenizerConfig(), model, WarmStartConfig(steps=7)),
    }
    assert base not in others and len(others) == 4


@pytest.mark.parametrize("overrides, key", [
    ({"steps": 0}, "warmstart.steps"),
    ({"op_weights": {"+": 1.0}}, "warmstart.op_weights"),
    ({"larger_first": 1.5}, "warmstart.larger_first"),
    ({"all_numbers": -0.1}, "warmstart.all_numbers"),
])
def test_config_validation_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        WarmStartConfig(**overrides)


def _tiny_configs(cache_dir):
    from quatro_nemo.megatron.models import ModelConfig

    model = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2, max_position_embeddings=48)
    return TASK, TokenizerConfig(), model, WarmStartConfig(steps=3, batch_size=4, cache_dir=cache_dir)


def _load_and_forward(rank, tp, cache_dir, out_dir):
    from quatro_nemo.tasks.countdown.warmstart import load_or_train_base_model
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    task, tok, model_config, warm = _tiny_configs(cache_dir)
    if tp > 1:
        initialize_parallel(tp, 1, seed=0)  # a multi-rank group: rank 0 trains in a subprocess
    state, report = load_or_train_base_model(task, tok, model_config, warm)
    if tp == 1:
        initialize_parallel(1, 1, seed=0)
    model = build_model(model_config)
    load_full_state_dict(model, state)
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(tokens, torch.arange(5).unsqueeze(0), None, runtime_gather_output=True)
    torch.save(dict(logits=logits, report=report), f"{out_dir}/tp{tp}_rank{rank}.pt")


@pytest.mark.distributed
def test_base_model_is_cached_once_and_loads_in_a_tp2_layout(tmp_path):
    cache_dir = str(tmp_path / "cache")
    run_ranks(2, _load_and_forward, 2, cache_dir, str(tmp_path))  # cache missing: built by rank 0
    files = list((tmp_path / "cache").glob("base-*.pt"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    run_ranks(1, _load_and_forward, 1, cache_dir, str(tmp_path))  # cache hit: not retrained
    assert files[0].stat().st_mtime_ns == mtime
    reference = torch.load(tmp_path / "tp1_rank0.pt", weights_only=False)
    assert reference["report"]["steps"] == 3
    for rank in range(2):
        got = torch.load(tmp_path / f"tp2_rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(got["logits"], reference["logits"], atol=1e-5, rtol=1e-5)


class _FixedBackend:
    """Returns given response strings (no model): measure_policy's bookkeeping by hand."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.responses = tokenizer, responses

    def generate(self, prompts, num_samples, params, first_prompt_index=0):
        from quatro_nemo.engine.rollout import RolloutBatch
        from quatro_nemo.megatron.sampling import SampleOutput

        rows = [(list(p), self.tokenizer.encode_response(r))
                for p, r in zip([p for p in prompts for _ in range(num_samples)], self.responses)]
        length = max(len(p) + len(r) for p, r in rows)
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        for i, (p, r) in enumerate(rows):
            tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
        n = len(rows)
        sample = SampleOutput(tokens=tokens, response_mask=torch.zeros(n, length - 1),
                              logprobs=torch.zeros(n, length - 1),
                              prompt_lengths=torch.tensor([len(p) for p, _ in rows]),
                              response_lengths=torch.tensor([len(r) for _, r in rows]),
                              finished=torch.ones(n, dtype=torch.bool))
        return RolloutBatch(sample=sample, num_prompts=len(prompts), num_samples=num_samples)


def test_measure_policy_by_hand():
    from quatro_nemo.tasks.countdown.measure import measure_policy

    tokenizer = CharTokenizer()
    problems = [{"prompt": "1 2 4>12:", "numbers": [1, 2, 4], "target": 12},
                {"prompt": "2 3>6:", "numbers": [2, 3], "target": 6}]
    responses = ["1+2=3,3*4=12", "2+1=3,3*4=12", "1+2=3,4*3=12", "1+2=3,3*4=12",  # 4/4, 3 strings, 1 expr
                 "2*3=6", "2+3=5", "1", "6=2*3"]                                   # 1/4
    m = measure_policy(_FixedBackend(tokenizer, responses), problems, tokenizer, 4, params=None)
    assert m["success_rates"] == [1.0, 0.25]
    assert m["success_buckets"] == {"[0,0.03125)": 0.0, "[0.03125,0.125)": 0.0, "[0.125,0.5)": 0.5, "[0.5,1]": 0.5}
    assert m["distinct_correct_per_problem"]["max"] == 3.0 and m["distinct_correct_per_problem"]["min"] == 1.0
    assert m["distinct_correct_expressions_per_problem"]["max"] == 1.0
    assert m["solved_always"] == 0.5 and m["solved_never"] == 0.0
    assert m["response_length_tokens"]["max"] == len("1+2=3,3*4=12") + 1


@pytest.mark.slow
def _measure_default_base_model(rank, path):
    """measure_policy of the CPU default's (cached, else trained) base model on the first 32
    held-out problems, at TP=1, PP=1 in this process."""
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.rollout import MegatronRolloutBackend
    from quatro_nemo.engine.task import build_task
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import destroy_parallel, initialize_parallel
    from quatro_nemo.megatron.sampling import SamplingParams
    from quatro_nemo.tasks.countdown.measure import measure_policy
    from quatro_nemo.tasks.countdown.problems import generate_split
    from quatro_nemo.tasks.countdown.warmstart import load_or_train_base_model

    cfg = load_config([])
    task = build_task(cfg)
    model_config = task.model_config(cfg.model)
    state, _ = load_or_train_base_model(cfg.task.problems(), cfg.task.tokenizer, model_config, cfg.warmstart)
    tokenizer = CharTokenizer(cfg.task.tokenizer)
    problems = generate_split(cfg.task.problems(), "heldout", 32)
    initialize_parallel(1, 1, seed=0)
    try:
        model = build_model(model_config)
        load_full_state_dict(model, state)
        model.eval()
        backend = MegatronRolloutBackend(model, stop_token_ids=[tokenizer.eos_id], pad_id=tokenizer.pad_id)
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens, seed=0)
        with torch.no_grad():
            measured = measure_policy(backend, problems, tokenizer, 32, params)
    finally:
        destroy_parallel()
    torch.save(measured, path)


def test_the_cpu_default_base_model_has_several_correct_modes_per_solved_prompt(tmp_path):
    """Issue 16: at the training sampling (temperature 1, top-p 1) the CPU default's base model
    samples >= 3 distinct correct expressions (modulo commuting: the UCC@k criterion) per solved
    held-out prompt on average (n = 32), with unequal preference between them, while per-prompt
    success rates spread from ~0 to ~1. A fixed seeded sample of 32 prompts; the warm-start is
    the default's (cached in warmstart.cache_dir like `make train`'s; trained if missing)."""
    # In a forked rank, not in the pytest worker: a process group set up and torn down in the
    # worker made later forked-rank tests in the same worker hang in megatron's group creation.
    path = os.path.join(str(tmp_path), "measured.pt")
    run_ranks(1, _measure_default_base_model, path)
    measured = torch.load(path, weights_only=False)
    print({k: measured[k] for k in ("distinct_correct_per_solved_problem", "success_rate", "top_mode_share",
                                    "top_mode_share_if_equal")})
    assert measured["distinct_correct_per_solved_problem"] >= 3.0
    rates = measured["success_rates"]
    assert min(rates) <= 0.05 and max(rates) >= 0.75                       # hard and easy prompts
    assert measured["top_mode_share"] > 1.3 * measured["top_mode_share_if_equal"]   # unequal modes
