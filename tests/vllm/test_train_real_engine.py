"""``recipes/train.py rollout.backend=vllm`` with the real engine (vLLM's CPU build), started the
way users start it: a single plain process without launcher variables (what
``scripts/gpu_check.sh`` does), and torchrun at TP 2 (one engine over both ranks through
vLLM's ``external_launcher``) and at DP 2 (one engine per rank). Each run trains, evaluates the
held-out problems, checkpoints, and resumes from its checkpoint; after every weight push the
engine's log-probs of the sampled tokens equal megatron's recomputation (``engine_gap/*``,
logged by the product itself) within float32 noise."""
from __future__ import annotations

import json

import pytest

from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine.logging import read_metrics
from tests.vllm.conftest import GAP_TOKEN_MAX, GAP_TOKEN_MEAN, SMALL, run_train

pytestmark = pytest.mark.slow


def assert_engine_follows_trainer(records):
    train = [r for r in records if r["kind"] == "train"]
    assert train
    for record in train:
        assert record["engine_gap/token_abs_max"] < GAP_TOKEN_MAX, record
        assert record["engine_gap/token_abs_mean"] < GAP_TOKEN_MEAN, record
        assert record["engine_gap/seq_ratio_mean"] == pytest.approx(1.0, abs=1e-2), record


@pytest.mark.parametrize("nproc, tensor, resume", [(1, 1, True), (2, 2, True), (2, 1, False)],
                         ids=["single-process", "tp2", "dp2"])
def test_trains_evaluates_checkpoints_and_resumes_through_the_real_engine(tmp_path, nproc, tensor, resume):
    run_dir = tmp_path / "run"
    args = SMALL + [f"run.dir={run_dir}", f"parallel.tensor={tensor}"]
    first = run_train(args + ["trainer.steps=2"], nproc)
    # vLLM's CPU build has no sleep mode: said once, by rank 0
    assert first.stdout.count("has no sleep mode") == 1, first.stdout[-3000:]
    world = json.loads((run_dir / "world.json").read_text())
    assert [(r["tensor_parallel"], r["data_parallel"]) for r in world] == [(tensor, nproc // tensor)] * nproc
    assert ckpt.latest_step(str(run_dir)) == 2
    steps = 2
    if resume:
        second = run_train(args + ["trainer.steps=3"], nproc)
        assert "steps 2->3" in second.stdout, second.stdout[-3000:]
        assert ckpt.latest_step(str(run_dir)) == 3
        steps = 3
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    evaluations = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evaluations] == [0, 2] + ([3] if resume else [])
    assert all(r["num_problems"] == 4 and r["n_samples"] == 4 for r in evaluations)
    assert_engine_follows_trainer(records)
    samples = (run_dir / "eval" / f"samples_step{steps:06d}.jsonl").read_text().splitlines()
    assert len(samples) == 4 and all(len(json.loads(line)["responses"]) == 4 for line in samples)
