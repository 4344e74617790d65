"""One study run in one process: train (as recipes/train.py does), then evaluate the final policy.

    python -m quatro_nemo.study.job KEY=VALUE... --evaluate [--problems 64 --n 128 --top-p 0.7 1.0 ...]

The arguments before ``--evaluate`` are recipes/train.py's; those after it are
:mod:`quatro_nemo.study.evaluation`'s. One process instead of two saves the interpreter and
library start-up and the task generation once per run (the task is cached within the process).
A run already trained (``report.json``) is only evaluated; an interrupted one resumes from its
checkpoint. Exits 75 after a SIGTERM/SIGUSR1 checkpoint, like recipes/train.py. The records
carry the seconds of each phase (``job_seconds``), which :mod:`quatro_nemo.study.timing` reads.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every import of torch, megatron or the engine stays inside main(): dist_checkpointing's writer
# starts a ``spawn`` Manager at the first checkpoint, and a spawned process re-imports this
# (__main__) module, so a heavy top level would cost every run ~2 s (tests/test_entry_point_imports.py).


PRELOADED_MODULES = ("megatron.core.dist_checkpointing", "megatron.core.inference.contexts",
                     "megatron.core.optimizer", "megatron.core.pipeline_parallel", "quatro_nemo.engine.loop",
                     "quatro_nemo.study.evaluation")


def preload(train_argv: Sequence[str]) -> None:
    """What every job of a study would otherwise redo, done once in the fork server
    (:mod:`quatro_nemo.study.forkserver`): the imports of :func:`main` and of what it imports
    lazily (megatron's schedules, optimizer, inference context and dist_checkpointing), and the
    task and base model of the study's training arguments (cached per process)."""
    import importlib

    from quatro_nemo.study.runner import prewarm

    for module in PRELOADED_MODULES:
        importlib.import_module(module)
    prewarm(train_argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from quatro_nemo.engine.config import CONFIG_ERROR_EXIT_CODE, config_errors_exit, load_config

    if "--evaluate" not in argv:
        print("usage: python -m quatro_nemo.study.job KEY=VALUE... --evaluate [evaluation options]", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    split = argv.index("--evaluate")
    train_argv, eval_argv = argv[:split], argv[split + 1:]

    from quatro_nemo.engine.loop import train
    from quatro_nemo.megatron.preemption import preemption_exits
    from quatro_nemo.study.evaluation import STUDY_EVAL, evaluate_run, parse_args, write_records
    from quatro_nemo.study.runner import is_trained

    options = parse_args(["RUN_DIR", *eval_argv])
    with config_errors_exit():
        cfg = load_config(train_argv)
    started = time.perf_counter()
    if not is_trained(cfg.run.dir):
        with preemption_exits():
            train(cfg)
    trained = time.perf_counter()
    records = evaluate_run(cfg.run.dir, options.problems, options.n, options.top_p, options.temperature, options.seed)
    seconds = {"train": round(trained - started, 2), "evaluate": round(time.perf_counter() - trained, 2)}
    write_records(os.path.join(cfg.run.dir, STUDY_EVAL), [dict(r, job_seconds=seconds) for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
