"""The study's --quick mode, exactly as a user runs it (issue 9: CI runs it). Its verdicts are
whatever the runs measure; what must hold is that every run finishes and every claim is stated."""
import json
import time

import pytest

from .test_study_e2e import study

pytestmark = pytest.mark.slow
VERDICTS = {"REPRODUCED", "PARTLY", "NOT REPRODUCED", "NOT TESTED"}


def test_quick_study_trains_every_run_and_states_every_claim(tmp_path):
    out = tmp_path / "quick"
    started = time.perf_counter()
    code, output = study(["--quick", "--out", str(out)], timeout=1800)
    assert code == 0, output
    print(f"quick study: {(time.perf_counter() - started) / 60:.1f} min")
    report = json.loads((out / "report.json").read_text())
    assert report["runs"] and all(run["finished"] for run in report["runs"].values()), report["runs"]
    claims = report["claims"]
    assert len(claims) >= 8 and all(claim["verdict"] in VERDICTS for claim in claims)
    assert all(claim["verdict"] != "NOT TESTED" for claim in claims), claims  # quick mode runs them all
    text = (out / "report.md").read_text()
    for claim in claims:
        assert claim["verdict"] in text
    assert list(out.glob("*.png"))
