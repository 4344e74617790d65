"""One tiny real adaptive-delta study end to end (kind: adaptive): recipes/study.py trains and
evaluates every (condition, arm) run on the graded task, keeps the metrics (publishing them to a
results directory as they land), writes the report, report_only=true rebuilds it byte for byte
from the kept metrics, and a fresh study directory continues from the published results alone
(nothing trained)."""
import gzip
import json

import pytest

from tests.engine.conftest import TINY
from tests.study.study_runner import run_tiny_study, study

pytestmark = pytest.mark.slow


def test_tiny_adaptive_study_end_to_end(tmp_path, warm_cache):
    config = {
        "name": "tiny_adaptive", "kind": "adaptive", "description": "tiny end-to-end adaptive study",
        "train_overrides": TINY + [f"warmstart.cache_dir={warm_cache}", "trainer.steps=2", "trainer.checkpoint_every=0"],
        "adaptive": {"tasks": ["graded"], "fixed_deltas": [0.05, 0.2],
                     "strategies": {"controller": {"delta_controller": {"kind": "kl"}}},
                     "stress": {"K2": {"inner_loops": 2}}, "seeds": [1]},
        "evaluation": {"num_problems": 4, "n_samples": 8, "top_p": [0.7], "sweep_n_samples": 4},
        "workers": 2, "time_budget_minutes": 5,
    }
    published = tmp_path / "published"
    chosen, out, report = run_tiny_study(tmp_path, config, f"results={published}", "publish=true")
    runs = report["runs"]
    assert len(runs) == 6 and all(r["finished"] for r in runs.values()), runs   # 2 conditions x 3 arms
    for name, run in runs.items():
        assert "task.reward=graded" in run["overrides"], name
        kept = [json.loads(line) for line in gzip.open(out / "metrics" / f"{name}.jsonl.gz", "rt")]
        evals = [(r["top_p"], r["n_samples"]) for r in kept if r["kind"] == "study_eval"]
        assert evals == [(0.7, 4)] if "-K2-" in name else [(0.7, 8)], name
        train = [r for r in kept if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2]
        assert all(("quatro/delta_used" in r) == ("delta_controller_kl" in name) for r in train), name
    claims = {c["id"]: c["verdict"] for c in report["claims"]}
    assert claims == {"frontier_controller": "NOT TESTED", "stable_controller": "NOT TESTED"}  # one seed
    markdown = (out / "report.md").read_text()
    assert "## Task `graded`" in markdown and "### K2" in markdown
    assert (out / "frontier.png").stat().st_size > 1000

    code, output = study([*chosen, f"out={out}", "report_only=true"])
    assert code == 0, output
    assert (out / "report.md").read_text() == markdown

    kept = sorted(p.name for p in (out / "metrics").glob("*.jsonl.gz"))
    assert len(kept) == 7 and sorted(p.name for p in (published / "metrics").glob("*.jsonl.gz")) == kept
    assert all((published / "metrics" / name).read_bytes() == (out / "metrics" / name).read_bytes() for name in kept)
    assert (published / "invocations.jsonl").is_file()
    fresh = tmp_path / "fresh"
    code, output = study([*chosen, f"out={fresh}", f"results={published}"])
    assert code == 0 and "6 runs, 6 already done" in output, output
    assert not (fresh / "runs").exists() and "base model evaluated" not in output
    assert json.loads((fresh / "report.json").read_text())["claims"] == report["claims"]
