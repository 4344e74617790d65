"""The QUATRO trainer at DP=2 over gloo: one full ``fit`` step through NeMo-Aligner's real code.

Real: NeMo-Aligner's ``ReinforceTrainer.fit`` / ``generate_rollouts`` / ``run_training``, its
``build_dataloader`` (Megatron random sampler), collate function, ``DefaultBatchIterator``,
``ReinforceRolloutBatch`` gather over gloo, and this project's dataset, verifier reward client
and QUATRO estimator. Stand-ins: the actor (no checkpoint on CPU) generates deterministic
responses and records what it is asked to train on; the verifier scores by a fixed rule.

Reference (parent process, brute force): the rollouts both ranks generated, grouped by dataset
id in Python, advantages from scipy's root of QUATRO's dual (and from ``algos``), cut into the
optimizer-step shards by hand.
"""
import math
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("nemo_aligner")
scipy_optimize = pytest.importorskip("scipy.optimize")

from omegaconf import OmegaConf  # noqa: E402

from aligner_ranks import run_ranks  # noqa: E402

NUM_PROBLEMS, PROMPTS_PER_STEP, NUM_RESPONSES, ROLLOUT_MBS = 16, 4, 4, 2
GLOBAL_BATCH_SIZE, INNER_LOOPS, DELTA = 8, 2, 0.1
MAX_RESPONSE = 3


class Tokenizer:
    eos_id = 0

    def text_to_ids(self, text):
        return [1 + ord(char) % 9 for char in text]

    def ids_to_text(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def score(problem, response):
    """The stand-in verifier's rule (reward in {0, 0.5, 1})."""
    return ((len(response) + sum(map(ord, response)) + int(problem["answer"])) % 3) / 2


class Verifier:
    def score_batch(self, problems, responses):
        return [score(p, r) for p, r in zip(problems, responses)]


class Actor:
    """Stand-in for QuatroReinforceActor: the attributes and calls the trainer uses."""

    def __init__(self, rank):
        from quatro_nemo.algos import get_algorithm

        self.rank = rank
        self.tokenizer = Tokenizer()
        self.algorithm = get_algorithm("quatro")
        self.algorithm_config = self.algorithm.config_cls(delta=DELTA, beta=0.01)
        self.needs_reference_logprobs = True
        self.generated = []  # (prompt_id, tokens, prompt_len, response_len) per response, in order
        self.trained_on = []  # the training batches get_loss_and_metrics saw, in order
        self.calls = 0

    def infer(self, batch):
        tokens = batch["text"].clone()
        prompt_lengths = batch["length"].clone()
        response_lengths = torch.empty_like(prompt_lengths)
        for row in range(tokens.size(0)):
            self.calls += 1
            length = 1 + (self.rank + self.calls) % MAX_RESPONSE
            start = int(prompt_lengths[row])
            tokens[row, start:start + length] = 1 + (torch.arange(length) * (self.calls + 3 * self.rank)) % 9
            response_lengths[row] = start + length
            if not self.trained_on:  # the training rollouts (validation comes after training)
                self.generated.append((int(batch["prompt_ids"][row]), tokens[row, :start + length].clone(),
                                       start, start + length))
        return {"response_tokens": tokens, "response_lengths": response_lengths,
                "prompt_lengths": prompt_lengths, "is_end": torch.ones(tokens.size(0), dtype=torch.bool)}

    def get_inference_log_probs(self, tokens):
        return -0.1 * tokens[:, 1:].float()

    def get_init_policy_logprobs(self, tokens):
        return -0.2 * tokens[:, 1:].float()

    def get_loss_and_metrics(self, batch, forward_only):
        self.trained_on.append({k: v.clone() for k, v in batch.items()})
        return 0.0, {"policy/loss": 0.0}

    def prepare_for_inference(self):
        pass

    finish_inference = prepare_for_training = prepare_for_training_step = prepare_for_inference
    finish_training_step = finish_training = prepare_for_inference


class Optimizer:
    param_groups = [{"lr": 1e-6}]

    def zero_grad(self):
        pass

    def step(self):
        pass


class Scheduler:
    def step(self):
        pass


class Logger:
    def log_metrics(self, *args, **kwargs):
        pass

    def log_table(self, *args, **kwargs):
        pass

    def finalize(self):
        pass


class Checkpoint:
    def custom_save(self, monitor_candidates, is_train_end):
        pass


def _problems():
    return [{"id": f"p{i}", "benchmark": "test", "prompt": "q" * (1 + i % 3) + str(i), "answer": str(i % 3)}
            for i in range(NUM_PROBLEMS)]


def _trainer_rank(rank):
    from nemo_aligner.data.nlp.builders import build_dataloader, collate_with_pad_to_max_batch
    from nemo_aligner.utils.batch_iterators import DefaultBatchIterator
    from nemo_aligner.utils.distributed import Timer

    from quatro_nemo.aligner.data import ProblemPromptDataset, collate_with_prompt_ids
    from quatro_nemo.aligner.rewards import VerifierRewardClient
    from quatro_nemo.aligner.trainer import QuatroReinforceTrainer
    from quatro_nemo.megatron.parallel import initialize_parallel

    initialize_parallel(tensor_parallel=1)  # world 2 -> DP 2
    problems, tokenizer = _problems(), Tokenizer()
    dataset = ProblemPromptDataset(problems, tokenizer, "{prompt}", max_prompt_length=8)
    cfg = OmegaConf.create({"model": {"seed": 7, "data": {"num_workers": 0}}})
    collate_fn = collate_with_prompt_ids(
        collate_with_pad_to_max_batch(MAX_RESPONSE, tokenizer.eos_id, cfg, generate_masks_and_position_ids=False))
    builder = partial(build_dataloader, cfg=cfg, dataset=dataset, mbs=ROLLOUT_MBS, gbs=PROMPTS_PER_STEP,
                      collate_fn=collate_fn, load_gbs=False)
    trainer_cfg = OmegaConf.create({
        "max_epochs": 1, "max_steps": 1, "val_check_interval": 10, "save_interval": 10,
        "gradient_clip_val": 0.0, "initial_policy_kl_penalty": 0.0, "use_absolute_kl": True,
        "num_rollouts_per_prompt": NUM_RESPONSES, "rollout_batch_seq_length": None,
        "model_gbs": GLOBAL_BATCH_SIZE, "model_mbs": 1,
        "quatro": {"inner_loops": INNER_LOOPS, "shuffle_groups": False, "seed": 3},
    })
    actor = Actor(rank)
    trainer = QuatroReinforceTrainer(
        cfg=trainer_cfg, model=actor, optimizer=Optimizer(), scheduler=Scheduler(),
        train_dataloader_builder=builder, val_dataloader_builder=builder, collate_fn=collate_fn,
        rm=VerifierRewardClient(Verifier(), problems, tokenizer), batch_iterator_cls=DefaultBatchIterator,
        logger=Logger(), ckpt_callback=Checkpoint(), run_timer=Timer(None),
    )
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

    results = run_ranks(2, tmp_path, _trainer_rank)
    problems = _problems()
    tokenizer = Tokenizer()

    # Brute force: the global batch is rank 0's rollouts then rank 1's; group by dataset id.
    rollouts = results[0]["generated"] + results[1]["generated"]
    assert len(rollouts) == PROMPTS_PER_STEP * NUM_RESPONSES
    groups = {}
    for row, (prompt_id, *_rest) in enumerate(rollouts):
        groups.setdefault(prompt_id, []).append(row)
    assert all(len(rows) == NUM_RESPONSES for rows in groups.values())
    grouped = [row for rows in groups.values() for row in rows]
    rewards = {row: score(problems[rollouts[row][0]], tokenizer.ids_to_text(
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
