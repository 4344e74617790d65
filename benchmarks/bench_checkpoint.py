"""What one checkpoint save and load cost each rank at data parallel 2 on the CPU: the previous
strategy (megatron's fully_reshardable optimizer format, every rank all-gathering its DP group's
state, no fully-parallel wrappers) against the routine one (dp_reshardable through megatron's
fully-parallel save/load wrappers) and the fully_reshardable copy a TP/PP change asks for
(memory-efficient gather on DP rank 0, through the same wrappers).

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py [--size bench|test]

Each strategy runs in a fresh process (tests/megatron/checkpoint_probe.py: two forked ranks over
gloo, megatron's DDP and distributed optimizer over a float32 qwen2-style model; ``bench``: ~41 M
parameters, ~490 MB of optimizer state). Per rank it prints the bytes written and read (as a share
of the checkpoint) and how far its host memory rose during the save and during the load (in MB and
as a multiple of its own optimizer shard: 12 bytes per parameter of the shard), then, per quantity,
the worst rank's figure of each new strategy divided by the previous strategy's.

On a GPU the save's host memory is different: every tensor a rank writes is staged to host memory
first (docs/cluster.md, "Checkpoints"); what this measures is the gather, the write and read
shares, and the load's host buffers, which are the same on both devices.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                       # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests" / "megatron"))

import checkpoint_probe  # noqa: E402

MB = 1e6
QUANTITIES = (("written_bytes", "written"), ("read_bytes", "read"), ("save_peak_extra_bytes", "save peak"),
              ("load_peak_extra_bytes", "load peak"))


def describe(strategy: str, ranks) -> None:
    whole = ranks[0]["checkpoint_bytes"]
    print(f"{strategy:>11}: checkpoint {whole / MB:.0f} MB")
    for rank in ranks:
        shard = rank["optimizer_shard_bytes"]
        print(f"{'':>13}rank {rank['rank']}: writes {rank['written_bytes'] / whole:4.0%}, "
              f"reads {rank['read_bytes'] / whole:4.0%}; host memory +{rank['save_peak_extra_bytes'] / MB:.0f} MB "
              f"on save ({rank['save_peak_extra_bytes'] / shard:.2f}x its {shard / MB:.0f} MB shard), "
              f"+{rank['load_peak_extra_bytes'] / MB:.0f} MB on load ({rank['load_peak_extra_bytes'] / shard:.2f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(checkpoint_probe.SIZES), default="bench")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        for strategy in checkpoint_probe.STRATEGIES:
            results[strategy] = checkpoint_probe.measure(strategy, args.size, os.path.join(tmp, strategy))
            describe(strategy, results[strategy])
    print(f"\nworst rank, new / previous ({checkpoint_probe.WORLD_SIZE} data-parallel ranks, size {args.size}):")
    print(f"{'':>11}  " + "  ".join(f"{label:>10}" for _, label in QUANTITIES))
    for strategy in checkpoint_probe.STRATEGIES[1:]:
        ratios = [max(r[key] for r in results[strategy]) / max(r[key] for r in results["today"])
                  for key, _ in QUANTITIES]
        print(f"{strategy:>11}  " + "  ".join(f"{ratio:>10.2f}" for ratio in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
