"""Write an evaluation report (``quatro_nemo.eval.report.evaluate_runs``) as Markdown, CSV, JSON."""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from quatro_nemo.eval.flip import bucket_range as _bucket_range

AVERAGE = "average"   # the report's section (next to the benchmarks) that averages over benchmarks


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    """A Markdown table (then a blank line) of ``rows``; floats with 4 decimals, None and NaN as "-"."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _sections(report: Dict[str, Any]) -> List[str]:
    """Benchmarks in sorted order, then the average over benchmarks."""
    names = sorted({b for run in report["runs"].values() for b in run["benchmarks"]})
    return [AVERAGE] + names


def _summary(run: Dict[str, Any], section: str) -> Dict[str, Any]:
    return run[AVERAGE] if section == AVERAGE else run["benchmarks"].get(section)


def to_markdown(report: Dict[str, Any]) -> str:
    cfg = report["config"]
    runs = report["runs"]
    lines = ["# Evaluation report", "",
             f"Runs: {', '.join(runs)}. UCC criterion: `{cfg['ucc_metric']}` >= {cfg['ucc_threshold']} "
             f"(single-linkage clusters of correct responses). Pass@k and UCC@k are unbiased estimates "
             f"from n samples per problem; '{AVERAGE}' is the mean over benchmarks.", ""]
    for title, key, ks_key in (("Pass@k", "pass@k", "ks"), ("UCC@k", "ucc@k", "ucc_ks")):
        for section in _sections(report):
            ks = next(iter(runs.values()))[ks_key]
            rows = [[name] + [(_summary(run, section) or {}).get(key, {}).get(k) for k in ks]
                    for name, run in runs.items() if _summary(run, section)]
            lines += [f"## {title}: {section}", ""] + markdown_table(["run"] + [f"k={k}" for k in ks], rows)
    metrics = list(cfg["pairwise_metrics"])
    for section in _sections(report):
        rows = []
        for name, run in runs.items():
            s = _summary(run, section)
            if s:
                rows.append([name, s["num_problems"], s["n"], s["accuracy"], s["ucr"]]
                            + [s["similarity"].get(m) for m in metrics] + [s.get("entropy"), s.get("nll")])
        lines += [f"## Diversity and entropy: {section}", "",
                  "Similarity columns: mean pairwise similarity among correct responses (lower = more diverse). "
                  "entropy: mean full-vocabulary token entropy; nll: -mean log p(sampled token).", ""]
        lines += markdown_table(["run", "problems", "n", "mean acc", "UCR"] + [f"sim {m}" for m in metrics]
                                 + ["entropy", "nll"], rows)
    statuses = sorted({st for run in runs.values() for st in run[AVERAGE]["grading"]})
    if statuses:
        rows = [[name] + [run[AVERAGE]["grading"].get(st, 0) for st in statuses] for name, run in runs.items()]
        lines += ["## Grading outcomes (responses)", "",
                  "timeout / error: the check did not finish or failed; counted incorrect.", ""]
        lines += markdown_table(["run"] + statuses, rows)
    if report.get("flip"):
        lines += [f"## Flip rate vs base run `{cfg['base_run']}`", "",
                  "Buckets by the base run's correct count out of 256. flip rate: base-unsolved problems "
                  "with >= 1 correct sample after training; improved: problems whose pass@1 rose.", ""]
        first = next(iter(report["flip"].values()))["buckets"]
        header = ["run", "problems", "flip rate"] + [f"improved {b['name']} {_bucket_range(b)}" for b in first]
        rows = [[name, f["num_problems"], f["flip_rate"]]
                + [f"{_fmt(b['improvement_rate'])} (n={b['num_problems']})" for b in f["buckets"]]
                for name, f in report["flip"].items()]
        lines += markdown_table(header, rows)
    return "\n".join(lines)


def iter_rows(report: Dict[str, Any]) -> Iterator[Tuple[str, str, str, Any, Any]]:
    """Long-format rows (run, benchmark, metric, k, value) of every summary number."""
    for name, run in report["runs"].items():
        for section in _sections(report):
            s = _summary(run, section)
            if not s:
                continue
            for key in ("num_problems", "n", "accuracy", "ucr", "entropy", "nll"):
                yield name, section, key, "", s.get(key)
            for key in ("pass@k", "ucc@k"):
                for k, value in s[key].items():
                    yield name, section, key, k, value
            for metric, value in s["similarity"].items():
                yield name, section, f"similarity/{metric}", "", value
            for status, count in s["grading"].items():
                yield name, section, f"grading/{status}", "", count
    for name, flip in report.get("flip", {}).items():
        yield name, AVERAGE, "flip_rate", "", flip["flip_rate"]
        for b in flip["buckets"]:
            for key in ("num_problems", "flip_rate", "improvement_rate", "mean_pass1_delta"):
                yield name, AVERAGE, f"flip/{b['name']}/{key}", "", b[key]


def to_jsonable(value: Any) -> Any:
    """NaN -> None and int keys -> str, so the file is strict JSON."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "item"):                # numpy scalars
        return to_jsonable(value.item())
    return value


def write_tables(report: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    """report.md, metrics.csv (long format), report.json; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"markdown": os.path.join(out_dir, "report.md"), "csv": os.path.join(out_dir, "metrics.csv"),
             "json": os.path.join(out_dir, "report.json")}
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(to_markdown(report))
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "benchmark", "metric", "k", "value"])
        for row in iter_rows(report):
            writer.writerow([row[0], row[1], row[2], row[3], "" if to_jsonable(row[4]) is None else row[4]])
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(to_jsonable(report), f, indent=1, allow_nan=False)
    return paths
