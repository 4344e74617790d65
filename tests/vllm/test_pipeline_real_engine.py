"""The real engine (vLLM's CPU build) on the rollout pipeline's schedule (issue 39;
docs/quatro-math.md Sec. 9) with the inline executor: at rollout.pipeline.max_staleness=1, step
0's rollout is sampled by the current weights (the engine/trainer gap is float noise, as in the
synchronous loop), every later step's by the weights of the step before, so the gap between the
engine's log-probs and the trainer's recomputation is the policy's own one-step move (far above
float noise) and the importance weights are no longer uniform. The policy moves because the
reward is test_engine_follows_trainer's length-parity rule."""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.vllm.conftest import GAP_TOKEN_MAX, GAP_TOKEN_MEAN, SMALL
from tests.vllm.test_engine_follows_trainer import _train_rank

pytestmark = pytest.mark.slow


def test_a_sampler_one_step_behind_shows_the_policys_move_in_the_engine_gap(tmp_path):
    args = SMALL + ["eval.num_problems=0", "trainer.steps=3", "trainer.lr=1e-2", f"run.dir={tmp_path / 'run'}",
                    "rollout.pipeline.max_staleness=1"]
    records = run_ranks(1, _train_rank, args, False)[0]
    assert [r["async/version"] for r in records] == [0, 0, 1]
    assert [r["async/staleness"] for r in records] == [0, 1, 1]
    on_policy, *stale = records
    assert on_policy["engine_gap/token_abs_max"] < GAP_TOKEN_MAX, on_policy
    assert on_policy["engine_gap/token_abs_mean"] < GAP_TOKEN_MEAN, on_policy
    for record in stale:
        assert record["grad_norm"] > 0 and record["async/staleness_optimizer_steps"] > 0, record
        assert record["engine_gap/token_abs_mean"] > 10 * GAP_TOKEN_MEAN, record
        assert record["async/ess_frac"] < 1.0, record
