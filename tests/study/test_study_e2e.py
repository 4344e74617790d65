"""One tiny real study end to end: recipes/study.py trains and evaluates every run of a
2-algorithm, 2-step study on the tiny CPU task, evaluates the base model once, keeps every run's
metrics, writes the report, skips finished runs when run again, rebuilds the same report from the
kept metrics alone (report_only=true), and emits the SLURM run list. The study config is a file of
the test's own, chosen as Hydra's ``--config-dir DIR study=NAME`` (DIR/study/NAME.yaml)."""
import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from quatro_nemo.engine.config import load_config
from tests.engine.conftest import TINY

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDY = os.path.join(REPO, "recipes", "study.py")


def study(args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, STUDY, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def run_tiny_study(tmp_path, config):
    """Write ``config`` as the study config ``tmp_path/conf/study/<name>.yaml`` and run the whole
    study into ``tmp_path/study``; returns (the arguments choosing that study, the study directory,
    its report.json)."""
    conf = tmp_path / "conf"
    (conf / "study").mkdir(parents=True)
    (conf / "study" / f"{config['name']}.yaml").write_text(yaml.safe_dump(config))
    chosen = [f"--config-dir={conf}", f"study={config['name']}"]
    out = tmp_path / "study"
    code, output = study([*chosen, f"out={out}"])
    assert code == 0, output
    return chosen, out, json.loads((out / "report.json").read_text())


def test_tiny_study_end_to_end(tmp_path, warm_cache):
    config = {
        "name": "tiny", "description": "tiny end-to-end test study",
        "train_overrides": TINY + [f"warmstart.cache_dir={warm_cache}", "trainer.steps=2",
                                   "trainer.checkpoint_every=0"],
        "algorithms": ["quatro", "grpo"], "seeds": [1],
        "sweeps": {"algorithms": ["quatro"], "inner_loops": [1], "lr_multipliers": [1], "seeds": [1]},
        "ablation": {"delta": 0.1, "inner_loops": 1, "log_ratios": ["seq_sum", "none"], "seeds": [1]},
        "deltas": {"values": [0.05, 0.1], "seeds": [1]},
        "evaluation": {"num_problems": 4, "n_samples": 8, "top_p": [0.7, 1.0], "sweep_n_samples": 4},
        "workers": 2, "time_budget_minutes": 5,
    }
    chosen, out, report = run_tiny_study(tmp_path, config)
    runs = report["runs"]
    # quatro K1 (also the K sweep, the ablation's seq_sum arm and, when the default delta is 0.1, the
    # delta=0.1 point), grpo, the ablation's log_ratio=none arm, delta 0.05 (and 0.1 if not the default)
    default_delta = load_config(config["train_overrides"]).algorithm.delta
    expected = 4 if default_delta == 0.1 else 5
    assert len(runs) == expected and all(r["finished"] for r in runs.values()), runs
    for name in runs:
        records = [json.loads(line) for line in open(out / "runs" / name / "metrics.jsonl")]
        assert not [r for r in records if r["kind"] == "eval"]        # the loop's evaluation is off
        kept = [json.loads(line) for line in gzip.open(out / "metrics" / f"{name}.jsonl.gz", "rt")]
        evals = [r for r in kept if r["kind"] == "study_eval"]
        # the main comparison's runs at both top-p with 8 samples, the ablation-only one at 0.7 with 4
        expected_evals = [(0.7, 4)] if "log_ratio_none" in name else [(0.7, 8), (1.0, 8)]
        assert [(r["top_p"], r["n_samples"]) for r in evals] == expected_evals, name
        assert all(r["step"] == 2 and len(r["num_correct"]) == 4 for r in evals)
        assert [r["step"] for r in kept if r["kind"] == "train"] == [1, 2]
    base = [json.loads(line) for line in gzip.open(out / "metrics" / "base.jsonl.gz", "rt")]
    assert [(r["top_p"], r["step"], r["n_samples"]) for r in base] == [(0.7, 0, 8), (1.0, 0, 8)]
    claims = {c["id"]: c for c in report["claims"]}
    assert {"passk_at_kmax", "ucc_at_kmax", "entropy_final", "logratio_ablation", "lambda_vs_delta",
            "advantage_vs_correct", "stability_inner_loops", "stability_lr"} <= set(claims)
    # one seed: nothing to pair, and a one-point sweep cannot test stability
    assert claims["stability_inner_loops"]["verdict"] == "NOT TESTED"
    assert claims["passk_at_kmax"]["verdict"] == "NOT TESTED"
    assert claims["advantage_vs_correct"]["verdict"] == "REPRODUCED"
    markdown = (out / "report.md").read_text()
    for claim_id in claims:
        assert f"| {claim_id} |" in markdown
    for figure in ("pass_at_k.png", "training.png", "logratio_ablation.png", "lambda.png", "advantage_vs_correct.png"):
        assert (out / figure).stat().st_size > 1000, figure

    # resumable: a second invocation trains nothing and rewrites the same claims
    code, output = study([*chosen, f"out={out}"], timeout=120)
    assert code == 0, output
    assert f"{expected} already done" in output
    assert {c["id"]: c["verdict"] for c in json.loads((out / "report.json").read_text())["claims"]} == \
        {k: c["verdict"] for k, c in claims.items()}

    # the report again from the kept metrics alone (no run directories): the same report
    first = {f: (out / f).read_bytes() for f in ("report.md", "report.json")}
    shutil.rmtree(out / "runs")
    code, output = study([*chosen, f"out={out}", "report_only=true"], timeout=120)
    assert code == 0, output
    assert {f: (out / f).read_bytes() for f in first} == first

    # the SLURM run list of the same study
    sweep = tmp_path / "sweep.txt"
    code, output = study([*chosen, f"emit_sweep={sweep}"], timeout=120)
    assert code == 0, output
    lines = [line for line in sweep.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) == expected and all("algorithm=" in line and "run.dir" not in line for line in lines)
