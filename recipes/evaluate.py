"""Evaluate sampled responses: Pass@k, UCC@k, diversity, entropy and flip rate (paper Sec. 4, App. C).

From samples files (one or several runs side by side)::

    python recipes/evaluate.py --run grpo=out/grpo.jsonl --run quatro=out/quatro.jsonl \\
        --run base=out/base.jsonl --base base --out eval_report/

From a checkpoint (samples generated first, then evaluated; the generator is the engine's)::

    python recipes/evaluate.py --checkpoint runs/a/checkpoints/step_100 --data data/math500.jsonl \\
        --num-samples 256 --name quatro --out eval_report/

Samples format: quatro_nemo/eval/samples.py. Outputs in --out: report.md, metrics.csv,
report.json, pass_at_k.png, ucc_at_k.png, similarity.png, flip_rate.png (with --base).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.eval.report import DEFAULT_PAIRWISE_METRICS, EvalConfig, evaluate_runs, write_report  # noqa: E402
from quatro_nemo.data.schema import read_problems  # noqa: E402
from quatro_nemo.eval.samples import load_samples, write_samples  # noqa: E402
from quatro_nemo.eval.similarity import SIMILARITY_METRICS  # noqa: E402

# The sampler that turns a checkpoint + problems into sample records; provided by the engine.
# Contract: generate_samples(checkpoint: str, problems: list[dict], num_samples: int,
#   temperature: float, top_p: float, max_new_tokens: int, seed: int) -> list[dict] (samples
#   format: the problem's id/benchmark/answer plus "responses", optionally "logprobs"/"entropies").
DEFAULT_GENERATOR = "quatro_nemo.engine.generate:generate_samples"


def load_generator(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SystemExit(f"--checkpoint needs the sample generator {spec!r}, which cannot be imported "
                         f"({err}); pass --generator module:function or evaluate a samples file with --run") from err
    if not hasattr(module, attr):
        raise SystemExit(f"generator module {module_name!r} has no function {attr!r}")
    return getattr(module, attr)


def parse_run(spec: str) -> tuple:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--run expects NAME=path.jsonl, got {spec!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("inputs")
    src.add_argument("--run", action="append", type=parse_run, default=[], metavar="NAME=PATH",
                     help="a samples JSONL file of one run; repeat to compare runs side by side")
    src.add_argument("--base", default=None, help="run name of the base model (flip-rate buckets)")
    src.add_argument("--checkpoint", default=None, help="generate samples from this checkpoint first")
    src.add_argument("--data", action="append", default=[], help="problem JSONL file(s) for --checkpoint")
    src.add_argument("--name", default="checkpoint", help="run name of the --checkpoint samples")
    src.add_argument("--generator", default=DEFAULT_GENERATOR, help="module:function generating samples")
    src.add_argument("--num-samples", type=int, default=256)
    src.add_argument("--temperature", type=float, default=1.0)
    src.add_argument("--top-p", type=float, default=1.0)
    src.add_argument("--max-new-tokens", type=int, default=1024)
    met = p.add_argument_group("metrics")
    met.add_argument("--verifier", default="math", help="grader name for quatro_nemo.rewards.get_verifier")
    met.add_argument("--grading-workers", type=int, default=2)
    met.add_argument("--grading-timeout", type=float, default=5.0, help="seconds per answer check")
    met.add_argument("--regrade", action="store_true", help="ignore precomputed rewards in the samples")
    met.add_argument("--ks", type=int, nargs="+", default=None, help="Pass@k grid (default 1,2,4,..,n)")
    met.add_argument("--ucc-ks", type=int, nargs="+", default=None, help="UCC@k grid (default: --ks)")
    met.add_argument("--ucc-metric", default="rouge_l", choices=sorted(SIMILARITY_METRICS) + ["precomputed"],
                     help="near-duplicate criterion; 'precomputed' uses each record's cluster_sizes")
    met.add_argument("--ucc-threshold", type=float, default=None)
    met.add_argument("--pairwise-metrics", nargs="*", default=list(DEFAULT_PAIRWISE_METRICS),
                     choices=sorted(SIMILARITY_METRICS))
    met.add_argument("--max-pairwise-responses", type=int, default=32)
    met.add_argument("--workers", type=int, default=1, help="threads for similarity matrices")
    met.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("outputs")
    out.add_argument("--out", required=True, help="output directory")
    out.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    args = build_parser().parse_args(argv)
    runs: Dict[str, List[Dict[str, Any]]] = {}
    for name, path in args.run:
        if name in runs:
            raise SystemExit(f"--run name {name!r} given twice")
        runs[name] = load_samples(path)
    if args.checkpoint is not None:
        if not args.data:
            raise SystemExit("--checkpoint needs --data problems.jsonl")
        generate_samples = load_generator(args.generator)
        problems = [p for path in args.data for p in read_problems(path)]
        samples = generate_samples(checkpoint=args.checkpoint, problems=problems, num_samples=args.num_samples,
                                   temperature=args.temperature, top_p=args.top_p,
                                   max_new_tokens=args.max_new_tokens, seed=args.seed)
        os.makedirs(args.out, exist_ok=True)
        write_samples(os.path.join(args.out, f"samples_{args.name}.jsonl"), samples)
        runs[args.name] = samples
    if not runs:
        raise SystemExit("nothing to evaluate: give --run NAME=samples.jsonl and/or --checkpoint")
    config = EvalConfig(ks=args.ks, ucc_ks=args.ucc_ks, ucc_metric=args.ucc_metric, ucc_threshold=args.ucc_threshold,
                        pairwise_metrics=tuple(args.pairwise_metrics), max_pairwise_responses=args.max_pairwise_responses,
                        base_run=args.base, regrade=args.regrade, workers=args.workers, seed=args.seed)
    verifier_kwargs = ({"num_workers": args.grading_workers, "timeout_s": args.grading_timeout}
                       if args.verifier == "math" else {})
    start = time.perf_counter()
    report = evaluate_runs(runs, config, verifier=args.verifier, verifier_kwargs=verifier_kwargs)
    paths = write_report(report, args.out, plots=not args.no_plots)
    print(f"evaluated {len(runs)} run(s) in {time.perf_counter() - start:.1f} s")
    for kind, path in paths.items():
        print(f"  {kind}: {path}")
    return paths


if __name__ == "__main__":
    main()
