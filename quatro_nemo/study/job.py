"""One study run, as the fork server's child runs it: the engine's front door on the run's request
(train, resuming from its checkpoint; then evaluate the final policy), exit 75 after a
SIGTERM/SIGUSR1 checkpoint, like recipes/train.py. The evaluation records carry the seconds of
each phase (``job_seconds``), which :mod:`quatro_nemo.study.timing` reads.

Light at top level (imports inside the functions): the fork server pickles these functions by
reference, and its children's checkpoint writers re-import the server's main module.
"""
from __future__ import annotations

PRELOADED_MODULES = ("megatron.core.dist_checkpointing", "megatron.core.inference.contexts",
                     "megatron.core.optimizer", "megatron.core.pipeline_parallel", "quatro_nemo.engine.api",
                     "quatro_nemo.engine.loop")


def preload(base_config) -> None:
    """What every run of a study would otherwise redo, done once in the fork server
    (:mod:`quatro_nemo.study.forkserver`): the imports of :func:`run_job` and of what they import
    lazily (megatron's schedules, optimizer, inference context and dist_checkpointing), and the
    base model of the study's base config (the warm-start cache is built here, never by
    concurrent runs)."""
    import importlib

    from quatro_nemo.engine.task import build_task

    for module in PRELOADED_MODULES:
        importlib.import_module(module)
    task = build_task(base_config)
    task.load_base_state(task.model_config(base_config.model))


def run_job(request) -> int:
    """Run a ``quatro_nemo.engine.api.RunRequest``; 0, or 75 when a signal stopped the training."""
    from quatro_nemo.engine.api import run
    from quatro_nemo.megatron.preemption import preemption_exits

    with preemption_exits():
        run(request)
    return 0
