"""recipes/evaluate.py checkpoint=...: samples generated from a training run's checkpoint."""
import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, run_train

pytestmark = pytest.mark.slow


def test_evaluate_samples_a_run_checkpoint_like_the_runs_own_evaluation(tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    process = run_train(tiny_args(str(run_dir), "trainer.steps=1", "eval.temperature=1.0", "eval.top_p=1.0"))
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    # the run's own final evaluation: its problems and the sampler's noise for them
    own = [json.loads(line) for line in open(run_dir / "eval" / "samples_step000001.jsonl")]
    problems = tmp_path / "problems.jsonl"
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.evaluation import EVAL_SEED_TAG
    from quatro_nemo.engine.task import build_task

    cfg = load_config(tiny_args(str(run_dir)))
    task = build_task(cfg)
    problems.write_text("".join(json.dumps(p) + "\n" for p in task.heldout_problems[:len(own)]))
    out = tmp_path / "eval"
    seed = cfg.run.seed + EVAL_SEED_TAG
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "recipes", "evaluate.py"), f"checkpoint={run_dir}",
         f"data=[{problems}]", "verifier=countdown", "ucc_metric=exact",
         f"num_samples={cfg.eval.n_samples}", "temperature=1.0", "top_p=1.0",
         f"max_new_tokens={cfg.rollout.max_new_tokens}", f"seed={seed}", f"out={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report  # tables were written
    samples = [json.loads(line) for line in open(next(out.glob("*samples*.jsonl")))]
    assert [s["responses"] for s in samples] == [r["responses"] for r in own]
