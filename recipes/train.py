#!/usr/bin/env python
"""Train with QUATRO (or any registered baseline) on megatron-core.

    python recipes/train.py                                   # the embedded CPU default
    python recipes/train.py algorithm=gspo trainer.inner_loops=4 algorithm.clip_low=3e-4
    python recipes/train.py config=quatro_1p5b run.dir=/scratch/runs/q1p5b
    torchrun --nproc-per-node 2 recipes/train.py parallel.tensor=2

Arguments are `key=value` overrides of the YAML under conf/ (see quatro_nemo/engine/config.py).
Re-running the same command resumes from the newest checkpoint in run.dir. SIGUSR1/SIGTERM save a
checkpoint and exit with code 75 (requeue me); the SLURM templates rely on it.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.engine.config import ConfigError, load_config  # noqa: E402
from quatro_nemo.engine.loop import train  # noqa: E402
from quatro_nemo.megatron.preemption import PREEMPTED_EXIT_CODE, Preempted  # noqa: E402


def main(argv) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        train(config)
    except Preempted as exc:
        print(f"preempted: {exc}; checkpoint saved, exiting with {PREEMPTED_EXIT_CODE}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
