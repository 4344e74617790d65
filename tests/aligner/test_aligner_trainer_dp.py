"""The QUATRO trainer at DP=2 over gloo: one full ``fit`` step through NeMo-Aligner's real code.

Real: NeMo-Aligner's ``ReinforceTrainer.fit`` / ``generate_rollouts`` / ``run_training``, its
``build_dataloader`` (Megatron random sampler), collate function, ``DefaultBatchIterator``,
``ReinforceRolloutBatch`` gather over gloo, and this project's dataset, verifier reward client
and QUATRO estimator. Stand-ins (``aligner_standins.py``): the actor (no checkpoint on CPU)
generates deterministic responses and records what it is asked to train on; the verifier scores
by a fixed rule.

Reference (parent process, brute force): the rollouts both ranks generated, grouped by dataset
id in Python, advantages from scipy's root of QUATRO's dual (and from ``algos``), cut into the
optimizer-step shards by hand.
"""
import math

import numpy as np
import pytest
import torch

pytest.importorskip("nemo_aligner")
scipy_optimize = pytest.importorskip("scipy.optimize")

from tests.distributed import run_ranks  # noqa: E402
from aligner_standins import (  # noqa: E402
    DELTA,
    GLOBAL_BATCH_SIZE,
    INNER_LOOPS,
    NUM_RESPONSES,
    PROMPTS_PER_STEP,
    Actor,
    Checkpoint,
    Tokenizer,
    build_trainer,
    problems,
    score,
)


def _trainer_rank(rank):
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tensor_parallel=1)  # world 2 -> DP 2
    actor = Actor(rank)
    trainer = build_trainer(actor, Checkpoint())
    trainer.fit()
    return {"generated": actor.generated, "trained_on": actor.trained_on, "step": trainer.step,
            "consumed_samples": trainer.consumed_samples}


def _quatro_advantages_scipy(rewards):
    """lambda* = root of KL(softmax(R/lam) || uniform) = delta (quatro-math.md Sec. 2), scipy brentq;
    A_i = R_i/lam - log mean_j exp(R_j/lam) (Eq. 15). Constant groups: A = 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if np.all(rewards == rewards[0]):
        return np.zeros_like(rewards)
    n = rewards.size

    def kl_minus_delta(log_lam):
        z = rewards / math.exp(log_lam)
        w = np.exp(z - z.max())
        w /= w.sum()
        return float(np.sum(w * np.log(w * n + 1e-300))) - DELTA

    lam = math.exp(scipy_optimize.brentq(kl_minus_delta, -12, 12, xtol=1e-14))
    z = rewards / lam
    return z - (z.max() + math.log(np.mean(np.exp(z - z.max()))))


@pytest.mark.distributed
def test_fit_step_dp2_shards_and_quatro_advantages(tmp_path):
    from quatro_nemo.algos import get_algorithm

    results = run_ranks(2, _trainer_rank)
    problem_list = problems()
    tokenizer = Tokenizer()

    # Brute force: the global batch is rank 0's rollouts then rank 1's; group by dataset id.
    rollouts = results[0]["generated"] + results[1]["generated"]
    assert len(rollouts) == PROMPTS_PER_STEP * NUM_RESPONSES
    groups = {}
    for row, (prompt_id, *_rest) in enumerate(rollouts):
        groups.setdefault(prompt_id, []).append(row)
    assert all(len(rows) == NUM_RESPONSES for rows in groups.values())
    grouped = [row for rows in groups.values() for row in rows]
    rewards = {row: score(problem_list[rollouts[row][0]], tokenizer.ids_to_text(
        rollouts[row][1][rollouts[row][2]:rollouts[row][3]].tolist())) for row in grouped}
    advantage = {}
    reward_matrix = torch.tensor([[rewards[r] for r in rows] for rows in groups.values()], dtype=torch.float64)
    spec = get_algorithm("quatro")
    algos_advantages = spec.advantage_estimator(reward_matrix, spec.config_cls(delta=DELTA)).advantages
    for g, rows in enumerate(groups.values()):
        reference = _quatro_advantages_scipy([rewards[r] for r in rows])
        np.testing.assert_allclose(algos_advantages[g].numpy(), reference, atol=1e-9)
        advantage.update(zip(rows, reference))
    assert len({rewards[r] for r in grouped}) > 1  # the rewards are not all equal

    per_rank = GLOBAL_BATCH_SIZE // 2
    num_steps = len(grouped) // GLOBAL_BATCH_SIZE
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["consumed_samples"] == PROMPTS_PER_STEP
        batches = result["trained_on"]
        assert len(batches) == INNER_LOOPS * num_steps  # K passes over the same mini-batches
        for k in range(1, INNER_LOOPS):
            for t in range(num_steps):
                for key, value in batches[t].items():
                    assert torch.equal(batches[k * num_steps + t][key], value)
        for t in range(num_steps):
            batch = batches[t]
            expected_rows = grouped[t * GLOBAL_BATCH_SIZE + rank * per_rank:t * GLOBAL_BATCH_SIZE + (rank + 1) * per_rank]
            assert batch["response_tokens"].size(0) == per_rank
            for i, row in enumerate(expected_rows):
                _, tokens, prompt_len, response_len = rollouts[row]
                assert torch.equal(batch["response_tokens"][i, :response_len], tokens)
                mask = torch.zeros(batch["response_mask"].size(1))
                mask[prompt_len - 1:response_len - 1] = 1
                assert torch.equal(batch["response_mask"][i], mask)
                assert batch["advantages"][i].item() == pytest.approx(advantage[row], abs=1e-6)
            torch.testing.assert_close(batch["old_logprobs"], -0.1 * batch["response_tokens"][:, 1:].float())
            torch.testing.assert_close(batch["ref_logprobs"], -0.2 * batch["response_tokens"][:, 1:].float())
