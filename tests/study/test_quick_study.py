"""The quick study (study=quick), exactly as a user runs it (issue 9: CI runs it). Its verdicts are
whatever the runs measure; what must hold is that every run finishes and is evaluated as the
config says, every metric is kept, every claim is stated, the testbed is described, a second
invocation trains nothing, report_only=true rebuilds the same report from the kept metrics alone
(issue 16), and emit_sweep lists the same runs for SLURM."""
import gzip
import json
import shutil
import time

import pytest

from quatro_nemo.study.config import load_study_config
from quatro_nemo.study.stats import VERDICTS
from quatro_nemo.study.timing import estimate_minutes

from .study_runner import study

pytestmark = pytest.mark.slow


def test_quick_study_trains_every_run_and_states_every_claim(tmp_path):
    out = tmp_path / "quick"
    started = time.perf_counter()
    code, output = study(["study=quick", f"out={out}"], timeout=1800)
    assert code == 0, output
    print(f"quick study: {(time.perf_counter() - started) / 60:.1f} min")
    report = json.loads((out / "report.json").read_text())
    assert report["runs"] and all(run["finished"] for run in report["runs"].values()), report["runs"]
    claims = report["claims"]
    assert len(claims) >= 8 and all(claim["verdict"] in VERDICTS for claim in claims)
    # 2 seeds in every part; a matched-level claim is NOT TESTED for a seed whose two runs' rollout
    # rewards (or KLs) at the checkpoints do not overlap, which 8 steps may well give
    matched = [c for c in claims if c["id"].startswith("ucc_matched_")]
    assert all(claim["verdict"] != "NOT TESTED" for claim in claims if claim not in matched), claims
    # issue 29's pre-registered paths: families, a TOST margin, a fixed stress point, matched levels
    by_id = {claim["id"]: claim for claim in claims}
    assert [c["label"] for c in by_id["passk_at_kmax"]["comparisons"]] == ["grpo", "gspo"]
    assert len(by_id["passk_at_kmax_secondary"]["comparisons"]) == 4
    assert by_id["passk_at_kmax"]["margin"] == 0.05
    assert all(c["tost_p_adjusted"] is not None for c in by_id["passk_at_kmax"]["comparisons"])
    assert [c["label"] for c in by_id["stress_K2"]["comparisons"]] == ["quatro - gspo"]
    assert len(matched) == 4 and "Held-out checkpoints every 4 steps" in (out / "report.md").read_text()
    text = (out / "report.md").read_text()
    for claim in claims:
        assert claim["verdict"] in text
    assert "## The testbed (base model, measured)" in text and "distinct correct per solved problem" in text
    for figure in ("frontier.png", "pass_at_k.png", "training.png", "logratio_ablation.png", "lambda.png",
                   "advantage_vs_correct.png", "stability_inner_loops.png", "stability_lr.png"):
        assert (out / figure).stat().st_size > 1000, figure
    assert len(list((out / "metrics").glob("*.jsonl.gz"))) == len(report["runs"]) + 1   # + the base model
    # conf/study/quick.yaml: 8 steps, held-out checkpoints every 4; 16 problems x 32 samples at both
    # top-p for the compared runs (default K and lr), 16 samples at top-p 0.7 for the others (the
    # stability sweeps' K2 and lr4x points, the ablation's log_ratio=none arm).
    for name in report["runs"]:
        kept = [json.loads(line) for line in gzip.open(out / "metrics" / f"{name}.jsonl.gz", "rt")]
        assert kept[0]["kind"] == "identity" and kept[0]["request"]["config"]["run"]["seed"] == int(name.rsplit("-s", 1)[1])
        assert [r["step"] for r in kept if r["kind"] == "train"] == list(range(1, 9)), name
        assert [r["step"] for r in kept if r["kind"] == "eval"] == [0, 4, 8], name
        evals = [r for r in kept if r["kind"] == "study_eval"]
        compared = "-K1-lr1x-" in name and "log_ratio" not in name
        assert [(r["top_p"], r["n_samples"]) for r in evals] == ([(0.7, 32), (1.0, 32)] if compared
                                                                 else [(0.7, 16)]), name
        assert all(r["step"] == 8 and len(r["num_correct"]) == 16 for r in evals), name
    base = [r for r in map(json.loads, gzip.open(out / "metrics" / "base.jsonl.gz", "rt")) if r["kind"] == "study_eval"]
    assert [(r["top_p"], r["step"], r["n_samples"], len(r["num_correct"])) for r in base] == \
        [(0.7, 0, 32, 16), (1.0, 0, 32, 16)]

    # resumable: a second invocation trains nothing and states the same verdicts
    code, output = study(["study=quick", f"out={out}"], timeout=300)
    assert code == 0, output
    assert f"{len(report['runs'])} already done" in output, output[-2000:]
    again = json.loads((out / "report.json").read_text())
    assert [(c["id"], c["verdict"]) for c in again["claims"]] == [(c["id"], c["verdict"]) for c in claims]

    # the full study's wall time from these timings (docs/study.md, "Budget")
    estimate = estimate_minutes(load_study_config("full"), str(out))
    print(f"full study estimate: {json.dumps(estimate)}")
    assert estimate["runs"] > 200 and estimate["estimated_minutes"] > 0

    # report_only=true from the kept metrics alone reproduces the report byte for byte
    first = {name: (out / name).read_bytes() for name in ("report.md", "report.json")}
    shutil.rmtree(out / "runs")
    code, output = study(["study=quick", f"out={out}", "report_only=true"], timeout=300)
    assert code == 0, output
    assert {name: (out / name).read_bytes() for name in first} == first

    # the same runs as a SLURM run list: one override set per run, each choosing its algorithm and
    # leaving run.dir to slurm/sweep.sh
    sweep = tmp_path / "sweep.txt"
    code, output = study(["study=quick", f"emit_sweep={sweep}"], timeout=300)
    assert code == 0, output
    lines = [line for line in sweep.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) == len(report["runs"]), output
    assert all("algorithm=" in line and "run.dir" not in line for line in lines)
    named = [line[2:] for line in sweep.read_text().splitlines() if line.startswith("# ") and " " not in line[2:]]
    assert sorted(named) == sorted(report["runs"])
