"""QUATRO's adaptive radius in the real loop (issue 19): the delta controller acts between steps,
its state goes through the real checkpoint, and a run stopped after step 2 and resumed gives the
records of the uninterrupted run bit for bit; on the graded task (continuous rewards)."""
import pytest

from .conftest import run_train
from .test_train_e2e import assert_same_records, finish, train_records

pytestmark = pytest.mark.slow

# A longer warm-start and 8 responses per prompt than TINY's, so that most steps have groups with
# unequal rewards (with TINY's 40-step base model every graded reward is 0 and nothing is measured).
ADAPTIVE = ["warmstart.steps=800", "rollout.n=8", "parallel.micro_batch_size=32",
            "algorithm.delta_controller.kind=kl", "algorithm.delta_controller.target=0.02",
            "algorithm.delta_per_query.kind=reward_variance", "task.reward=graded", "trainer.inner_loops=2",
            "trainer.mini_batch_prompts=4", "trainer.lr=3e-3", "eval.num_problems=0"]


def test_controller_resumes_bit_identically_through_the_checkpoint(tmp_path, tiny_args):
    straight = str(tmp_path / "straight")
    code, output = finish(run_train(tiny_args(straight, *ADAPTIVE, "trainer.steps=4")))
    assert code == 0, output
    resumed = str(tmp_path / "resumed")
    for steps in (2, 4):   # the second command resumes from the step-2 checkpoint
        code, output = finish(run_train(tiny_args(resumed, *ADAPTIVE, f"trainer.steps={steps}")))
        assert code == 0, output
    assert_same_records(resumed, straight)

    records = [r for r in train_records(straight) if r["kind"] == "train"]
    used = [r["quatro/delta_used"] for r in records]
    following = [r["quatro/delta_controller"] for r in records]
    assert used[0] == 0.1                       # algorithm.delta, the controller's start
    assert used[1:] == following[:-1]           # each step uses the radius the previous one set
    assert used[2] != 0.1                       # the resumed step 3 used the checkpointed radius
    assert len(set(used)) >= 3                  # the controller acted on several steps
    for r in records:
        if "quatro/achieved_kl" in r:           # absent on a step whose groups were all constant
            assert r["quatro/achieved_kl"] > 0.0
        assert r["quatro/delta/max"] <= r["quatro/delta_used"] + 1e-12   # variance rule: delta_q <= delta
        assert r["quatro/tr_inactive_frac"] == 0.0
        assert 0.0 <= r["reward/mean"] <= 1.0
