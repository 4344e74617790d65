"""The committed full study (docs/study_results/full, issue 16 item 7): ``report_only=true`` on its
kept metrics reproduces the committed report byte for byte, so the analysis can be redone and
checked without retraining."""
import shutil
from pathlib import Path

import pytest

from .test_study_e2e import study

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "study_results" / "full"


def test_report_only_on_the_committed_metrics_reproduces_the_committed_report(tmp_path):
    metrics = sorted((COMMITTED / "metrics").glob("*.jsonl.gz"))
    assert len(metrics) > 200, f"{COMMITTED}/metrics holds {len(metrics)} runs' metrics"
    out = tmp_path / "full"
    out.mkdir()
    shutil.copytree(COMMITTED / "metrics", out / "metrics")
    shutil.copy(COMMITTED / "invocations.jsonl", out / "invocations.jsonl")   # the wall-time record
    shutil.copy(COMMITTED / "report.json", out / "report.json")               # its `info` is kept
    code, output = study(["study=full", f"out={out}", "report_only=true"], timeout=600)
    assert code == 0, output
    for name in ("report.md", "report.json"):
        assert (out / name).read_bytes() == (COMMITTED / name).read_bytes(), f"{name} differs"


pytestmark = pytest.mark.slow
