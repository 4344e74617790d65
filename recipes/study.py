#!/usr/bin/env python
"""QUATRO vs GRPO, GPG, GSPO, GMPO, DAPO and CISPO side by side on the CPU default task (issue 9).

    python recipes/study.py --quick                 # CI scale (<= 10 min on 2 cores): runs/study_quick/
    python recipes/study.py                         # the full study (<= 150 min): runs/study_full/
    python recipes/study.py --config full seeds=[1,2,3,4,5,6] workers=2   # study-config overrides
    python recipes/study.py --quick --report-only   # rebuild the report from the kept metrics
    python recipes/study.py --estimate runs/study_quick   # the full study's wall time, from quick's timings
    python recipes/study.py --emit-sweep slurm/sweeps/study_full.txt train_config=quatro_1p5b train_overrides=[]
    python recipes/study.py --collect runs/sweeps/study_full-<timestamp> train_config=quatro_1p5b train_overrides=[]

Each run is recipes/train.py in <out>/runs/<name>, then the study's evaluation of its final
policy; a trained and evaluated run is skipped, so an interrupted study continues where it
stopped. Every run's metrics are kept in <out>/metrics/ (gzip JSON lines), from which the report
(<out>/report.md, report.json, PNGs) states claim by claim whether the paper's claim reproduced,
with paired statistics. Study configs live in conf/study/ (see docs/study.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.engine.config import ConfigError  # noqa: E402
from quatro_nemo.study.config import StudyConfigError, load_study_config  # noqa: E402


def previous_info(out: str) -> dict:
    """The last full invocation's info (wall time, failed runs) and the wall time of every
    invocation that trained runs, kept when only the report is rebuilt."""
    from quatro_nemo.study.driver import invocation_totals

    path = os.path.join(out, "report.json")
    if not os.path.isfile(path):
        return invocation_totals(out)
    with open(path) as f:
        return dict(json.load(f).get("info") or {}, **invocation_totals(out))


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="conf/study/<name>.yaml or a YAML path (default: full)")
    parser.add_argument("--quick", action="store_true", help="the CI-scale study (conf/study/quick.yaml)")
    parser.add_argument("--out", default=None, help="study directory (default: runs/study_<name>)")
    parser.add_argument("--report-only", action="store_true", help="no training: report from <out>/metrics/")
    parser.add_argument("--estimate", metavar="TIMED_STUDY_DIR",
                        help="estimate this study's wall time from the per-run timings of a finished study")
    parser.add_argument("--emit-sweep", metavar="FILE", help="write the run list for slurm/sweep.sh and exit")
    parser.add_argument("--collect", metavar="SWEEP_DIR", help="report on a slurm/sweep.sh sweep directory")
    parser.add_argument("overrides", nargs="*", help="study-config overrides, key=value")
    args = parser.parse_args(argv)
    if args.quick and args.config not in (None, "quick"):
        parser.error("--quick and --config are exclusive")
    name = "quick" if args.quick else (args.config or "full")
    try:
        cfg = load_study_config(name, args.overrides)
    except StudyConfigError as exc:
        print(f"study config error: {exc}", file=sys.stderr)
        return 2
    out = args.out or os.path.join("runs", f"study_{cfg.name}")

    from quatro_nemo.study.driver import build_plan, collect_sweep, emit_sweep, run_study, write_report
    from quatro_nemo.study.runner import StudyInterrupted
    try:
        if args.estimate:
            from quatro_nemo.study.timing import estimate_minutes
            estimate = estimate_minutes(cfg, args.estimate)
            print(json.dumps(estimate, indent=1))
            return 0
        if args.emit_sweep:
            count = emit_sweep(cfg, args.emit_sweep)
            print(f"{count} override sets written to {args.emit_sweep}; submit with: bash slurm/sweep.sh {args.emit_sweep}")
            return 0
        if args.collect:
            result = collect_sweep(cfg, args.collect, args.out or os.path.join(args.collect, "study_report"))
        elif args.report_only:
            result = write_report(cfg, build_plan(cfg), out, out, previous_info(out))
        else:
            result = run_study(cfg, out)
    except StudyInterrupted as stop:
        print(f"study stopped: {stop}; the same command continues it", file=sys.stderr)
        return 75
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    for claim in result["claims"]:
        print(f"{claim.verdict:>15}  {claim.id}: {claim.summary}")
    print(f"report: {result['paths']['markdown']}")
    return 1 if result.get("info", {}).get("failed_runs") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
