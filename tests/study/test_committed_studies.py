"""The committed studies (docs/study_results/full, issue 16 item 7; docs/study_results/adaptive,
issue 19): ``report_only=true`` on their kept metrics reproduces the committed report byte for
byte, so the analysis can be redone and checked without retraining."""
import shutil
from pathlib import Path

import pytest

from .test_study_e2e import study

STUDY_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "study_results"


@pytest.mark.parametrize("name, min_runs", [("full", 150), ("adaptive", 100)])
def test_report_only_on_the_committed_metrics_reproduces_the_committed_report(tmp_path, name, min_runs):
    committed = STUDY_RESULTS / name
    metrics = sorted((committed / "metrics").glob("*.jsonl.gz"))
    assert len(metrics) > min_runs, f"{committed}/metrics holds {len(metrics)} runs' metrics"
    out = tmp_path / name
    out.mkdir()
    shutil.copytree(committed / "metrics", out / "metrics")
    shutil.copy(committed / "invocations.jsonl", out / "invocations.jsonl")   # the wall-time record
    shutil.copy(committed / "report.json", out / "report.json")               # its `info` is kept
    code, output = study([f"study={name}", f"out={out}", "report_only=true"], timeout=600)
    assert code == 0, output
    for report in ("report.md", "report.json"):
        assert (out / report).read_bytes() == (committed / report).read_bytes(), f"{name}/{report} differs"


pytestmark = pytest.mark.slow
