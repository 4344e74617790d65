"""Grouping, advantages and DP sharding of the NeMo-Aligner trainer (pure functions, any env).

References are independent: Python loops (brute force), scipy's root finder for QUATRO's dual,
and the hand-derived table of quatro-math.md Sec. 3.
"""
import math

import numpy as np
import pytest
import torch

from quatro_nemo.aligner.rollouts import (
    PROMPT_IDS,
    REWARDS,
    dp_shard_indices,
    grouped_order,
    response_mask,
    shard_global_rollouts,
    shuffled_groups_order,
)

scipy_optimize = pytest.importorskip("scipy.optimize")


def _interleaved_ids(num_prompts, num_responses, seed):
    """Rollout order as NeMo-Aligner generates it: per rank, per micro-batch, N passes."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(1000, generator=generator)[:num_prompts]  # arbitrary dataset ids
    rows = []
    for chunk in ids.split(2):  # micro-batches of 2 prompts
        for _ in range(num_responses):
            rows.extend(chunk.tolist())
    return torch.tensor(rows)


def test_grouped_order_matches_brute_force():
    ids = _interleaved_ids(num_prompts=5, num_responses=3, seed=0)
    order = grouped_order(ids, 3)
    # Brute force: groups in order of first appearance, rows kept in order within a group.
    groups = {}
    for row, pid in enumerate(ids.tolist()):
        groups.setdefault(pid, []).append(row)
    expected = [row for rows in groups.values() for row in rows]
    assert order.tolist() == expected
    assert (ids[order].view(5, 3) == ids[order].view(5, 3)[:, :1]).all()


def test_grouped_order_ignores_prompt_tokens_and_checks_counts():
    ids = torch.tensor([7, 7, 9, 9, 9])
    with pytest.raises(ValueError, match="id 9: 3"):
        grouped_order(ids, 2)


def _quatro_reference(rewards, delta):
    """lambda* from scipy's brentq on KL(softmax(R/lam) || uniform) = delta (quatro-math.md Sec. 2),
    then A_i = R_i/lam - log mean_j exp(R_j/lam) (Eq. 15), in float64 numpy. The constraint
    must bind (delta < log(N / n_max))."""
    rewards = np.asarray(rewards, dtype=np.float64)
    n = rewards.size
    if np.all(rewards == rewards[0]):
        return np.zeros(n)  # no information: A = 0 (quatro-math.md Sec. 2)

    def kl_minus_delta(log_lam):
        z = rewards / math.exp(log_lam)
        w = np.exp(z - z.max())
        w /= w.sum()
        return float(np.sum(w * np.log(w * n + 1e-300))) - delta

    lam = math.exp(scipy_optimize.brentq(kl_minus_delta, -10, 10, xtol=1e-14))
    z = rewards / lam
    return z - (z.max() + math.log(np.mean(np.exp(z - z.max()))))


def test_quatro_table_and_scipy(quatro_spec):
    spec, config_cls = quatro_spec
    config = config_cls(delta=0.05)
    # quatro-math.md Sec. 3 table: N = 8, c = 4 correct, delta = 0.05 -> A = 0.2727 / -0.3762.
    rewards = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0], dtype=torch.float64)
    global_batch = {PROMPT_IDS: torch.full((8,), 3), REWARDS: rewards}
    shard, _ = shard_global_rollouts(global_batch, 8, spec.advantage_estimator, config, 8, 0, 1)
    assert shard["advantages"][0].item() == pytest.approx(0.2727, abs=1e-4)
    assert shard["advantages"][1].item() == pytest.approx(-0.3762, abs=1e-4)


def test_shards_of_all_ranks_match_brute_force(quatro_spec):
    spec, config_cls = quatro_spec
    config = config_cls(delta=0.1)
    num_prompts, num_responses, gbs, dp = 8, 4, 16, 2
    ids = _interleaved_ids(num_prompts, num_responses, seed=1)
    generator = torch.Generator().manual_seed(2)
    rewards = torch.randint(0, 2, (ids.numel(),), generator=generator).double()
    rewards[ids == ids[0]] = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)  # non-binary group
    tokens = torch.arange(ids.numel())[:, None] * 10 + torch.arange(3)[None, :]  # row tag
    global_batch = {PROMPT_IDS: ids, REWARDS: rewards, "response_tokens": tokens}

    # Brute force: group rows by dataset id (first appearance order), solve each group with scipy,
    # cut into optimizer steps of gbs rows, rank r takes its gbs/dp slice of each step.
    groups = {}
    for row, pid in enumerate(ids.tolist()):
        groups.setdefault(pid, []).append(row)
    grouped_rows = [row for rows in groups.values() for row in rows]
    advantage = {}
    for rows in groups.values():
        values = _quatro_reference(rewards[rows].numpy(), 0.1)
        advantage.update(zip(rows, values))
    shards = []
    for rank in range(dp):
        expected_rows = [grouped_rows[t * gbs + rank * gbs // dp + j]
                         for t in range(ids.numel() // gbs) for j in range(gbs // dp)]
        shard, _ = shard_global_rollouts(global_batch, num_responses, spec.advantage_estimator, config, gbs,
                                         rank, dp)
        assert (shard["response_tokens"][:, 0] // 10).tolist() == expected_rows
        assert shard[PROMPT_IDS].tolist() == ids[expected_rows].tolist()
        np.testing.assert_allclose(shard["advantages"].double().numpy(),
                                   [advantage[row] for row in expected_rows], rtol=0, atol=1e-6)
        shards.extend(expected_rows)
    assert sorted(shards) == list(range(ids.numel()))  # the ranks partition the batch


def test_shuffle_keeps_groups_whole_and_partitions():
    perm = shuffled_groups_order(5, 3, seed=11)
    assert sorted(perm.tolist()) == list(range(15))
    groups = perm.view(5, 3)
    assert ((groups - groups[:, :1]) == torch.arange(3)).all() and (groups[:, 0] % 3 == 0).all()
    assert perm.tolist() != list(range(15))  # seed 11 does move groups
    assert shuffled_groups_order(5, 3, seed=None).tolist() == list(range(15))


def test_dp_shard_indices_errors():
    with pytest.raises(ValueError, match="global_batch_size"):
        dp_shard_indices(16, 6, 0, 4)
    with pytest.raises(ValueError, match="multiple of model.global_batch_size"):
        dp_shard_indices(18, 8, 0, 2)


def test_response_mask_matches_nemo_aligner_loop():
    prompt_lengths = torch.tensor([3, 1, 4])
    response_lengths = torch.tensor([6, 5, 4])
    mask = response_mask(prompt_lengths, response_lengths, 7)
    expected = torch.zeros(3, 7)
    for i in range(3):  # ppo_utils.create_mask
        expected[i, prompt_lengths[i] - 1: response_lengths[i] - 1] = 1.0
    assert torch.equal(mask, expected)


def test_shuffled_shards_move_whole_groups_and_keep_advantages(quatro_spec):
    spec, config_cls = quatro_spec
    config = config_cls(delta=0.1)
    ids = _interleaved_ids(num_prompts=8, num_responses=2, seed=5)
    rewards = torch.tensor([float(i % 3 == 0) + 0.1 * (i % 5) for i in range(ids.numel())], dtype=torch.float64)
    tag = torch.arange(ids.numel())  # the original row of each response
    global_batch = {PROMPT_IDS: ids, REWARDS: rewards, "tag": tag}
    plain = {}
    for rank in range(2):
        shard, _ = shard_global_rollouts(global_batch, 2, spec.advantage_estimator, config, 8, rank, 2)
        plain.update(zip(shard["tag"].tolist(), shard["advantages"].tolist()))
    seen = []
    for rank in range(2):
        shard, _ = shard_global_rollouts(global_batch, 2, spec.advantage_estimator, config, 8, rank, 2,
                                         shuffle_seed=4)
        assert (shard[PROMPT_IDS].view(-1, 2)[:, 0] == shard[PROMPT_IDS].view(-1, 2)[:, 1]).all()
        for row, advantage in zip(shard["tag"].tolist(), shard["advantages"].tolist()):
            assert advantage == plain[row]  # the same response keeps its advantage
        seen.extend(shard["tag"].tolist())
    assert sorted(seen) == list(range(ids.numel()))
    assert seen != list(plain)  # the shuffle did reorder the shards
