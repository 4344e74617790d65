"""The committed studies (docs/study_results/full, issue 16 item 7; docs/study_results/adaptive,
issue 19): ``report_only=true`` on their kept metrics reproduces the committed report, so the
analysis can be redone and checked without retraining.

Reproduced means: the same structure and text, and the same numbers up to float rounding.
LAPACK's least squares (``np.polyfit``) and BLAS differ in their last bits between builds and
CPUs, so numbers are compared parsed, never byte for byte (issue 31):

- report.json: the same keys (in order), list lengths, types and integers; floats equal up to a
  relative 1e-9 (absolute 1e-12 near 0); strings as the lines of report.md;
- report.md: every line equal once its numbers are blanked out; each number equal up to a
  relative 1e-9, or, when printed with a fraction or an exponent, up to one unit of its last
  printed digit (a value on a rounding boundary may print either way); integers exactly.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, List

import pytest

from .study_runner import study

STUDY_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "study_results"
REL_TOL, ABS_TOL = 1e-9, 1e-12
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:nan|inf)\b", re.IGNORECASE)


def _last_digit_unit(text: str) -> float:
    """One unit of the last printed digit of a number with a fraction or an exponent ("0.050":
    0.001, "1.5e-03": 1e-4); 0 for an integer (compared exactly)."""
    mantissa, _, exponent = text.lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (int(exponent or 0) - decimals)


def _numbers_close(got: float, expected: float, abs_tol: float = ABS_TOL) -> bool:
    if math.isnan(got) or math.isnan(expected):
        return math.isnan(got) and math.isnan(expected)
    return math.isclose(got, expected, rel_tol=REL_TOL, abs_tol=abs_tol)


def text_differences(got: str, expected: str, where: str) -> List[str]:
    """Where ``got`` differs from ``expected`` beyond the tolerances of the module docstring."""
    got_lines, expected_lines = got.splitlines(), expected.splitlines()
    if len(got_lines) != len(expected_lines):
        return [f"{where}: {len(got_lines)} lines, expected {len(expected_lines)}"]
    differences = []
    for number, (line, expected_line) in enumerate(zip(got_lines, expected_lines), start=1):
        if NUMBER.sub("#", line) != NUMBER.sub("#", expected_line):
            differences.append(f"{where} line {number}: {line!r} != {expected_line!r}")
            continue
        for value, expected_value in zip(NUMBER.findall(line), NUMBER.findall(expected_line)):
            unit = max(_last_digit_unit(value), _last_digit_unit(expected_value))
            if not _numbers_close(float(value), float(expected_value), abs_tol=max(ABS_TOL, unit * (1 + 1e-9))):
                differences.append(f"{where} line {number}: {value} != {expected_value} in {expected_line!r}")
    return differences


def json_differences(got: Any, expected: Any, where: str = "$") -> List[str]:
    """Structural differences between two parsed JSON documents (module docstring's tolerances)."""
    if isinstance(expected, bool) or expected is None or isinstance(got, bool) or got is None:
        return [] if got is expected else [f"{where}: {got!r} != {expected!r}"]
    if type(got) is not type(expected):
        return [f"{where}: {type(got).__name__} != {type(expected).__name__}"]
    if isinstance(expected, int):
        return [] if got == expected else [f"{where}: {got} != {expected}"]
    if isinstance(expected, float):
        return [] if _numbers_close(got, expected) else [f"{where}: {got!r} != {expected!r}"]
    if isinstance(expected, str):
        return text_differences(got, expected, where)
    if isinstance(expected, list):
        if len(got) != len(expected):
            return [f"{where}: {len(got)} items, expected {len(expected)}"]
        return [d for i, (g, e) in enumerate(zip(got, expected)) for d in json_differences(g, e, f"{where}[{i}]")]
    if list(got) != list(expected):
        return [f"{where}: keys {sorted(set(got) ^ set(expected))} differ (or their order)"]
    return [d for key in expected for d in json_differences(got[key], expected[key], f"{where}.{key}")]


def test_comparison_passes_rounding_and_fails_real_differences():
    """The comparators on hand-made pairs: the issue's polyfit digits and a rounding flip pass;
    another number, another word, a missing key or an integer off by one fail."""
    committed = {"last_quarter_change": 0.050446428571428545, "runs": 152, "verdict": "REPRODUCED (p = 0.012)"}
    rebuilt = {"last_quarter_change": 0.05044642857142857, "runs": 152, "verdict": "REPRODUCED (p = 0.012)"}
    assert json_differences(rebuilt, committed) == []
    assert json_differences(dict(rebuilt, last_quarter_change=0.0504465), committed)
    assert json_differences(dict(rebuilt, runs=151), committed)
    assert json_differences(dict(rebuilt, verdict="REPRODUCED (p = 0.014)"), committed)
    assert json_differences({k: v for k, v in rebuilt.items() if k != "runs"}, committed)
    assert json_differences(dict(rebuilt, runs=152.0), committed)   # a type change is a difference
    assert text_differences("| quatro | 0.051 | 1.5e-03 |", "| quatro | 0.050 | 1.4e-03 |", "md") == []
    assert text_differences("| quatro | 0.052 | 1.5e-03 |", "| quatro | 0.050 | 1.5e-03 |", "md")
    assert text_differences("| grpo | 0.050 |", "| quatro | 0.050 |", "md")
    assert text_differences("152 of 152 runs", "151 of 152 runs", "md")
    assert text_differences("a\nb", "a", "md")


@pytest.mark.slow
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
    differences = json_differences(json.loads((out / "report.json").read_text()),
                                   json.loads((committed / "report.json").read_text()), f"{name}/report.json")
    differences += text_differences((out / "report.md").read_text(), (committed / "report.md").read_text(),
                                    f"{name}/report.md")
    assert not differences, differences[:10]
