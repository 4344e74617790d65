"""The task a run trains on, looked up by its config name (``task=<name>``, conf/task/<name>.yaml).

The tasks themselves live in :mod:`quatro_nemo.tasks` (each builds a
:class:`quatro_nemo.tasks.base.Task`); adding one is a schema, a builder and a vocabulary-size
reader in :data:`TASKS`. The engine never branches on a task's name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict

from quatro_nemo.tasks.base import Task
from quatro_nemo.tasks.countdown.task import CountdownTaskSection, build_countdown_task, countdown_vocab_size
from quatro_nemo.tasks.jsonl import JsonlTaskConfig, build_jsonl_task, jsonl_vocab_size
from quatro_nemo.megatron.parallel import is_rank_zero
from quatro_nemo.validation import ConfigError


@dataclass(frozen=True)
class TaskKind:
    schema: type                          # the typed ``task:`` section (Hydra ConfigStore schema/task/<name>)
    build: Callable[[Any], Task]          # validated run config -> Task
    vocab_size: Callable[[Any], int]      # ``task:`` section -> the model's vocabulary size, without building


TASKS: Dict[str, TaskKind] = {
    "countdown": TaskKind(CountdownTaskSection, build_countdown_task, countdown_vocab_size),
    "jsonl": TaskKind(JsonlTaskConfig, build_jsonl_task, jsonl_vocab_size),
}

# task=<name>: the schema of each option (Hydra ConfigStore schema/task/<name>)
TASK_SCHEMAS = {name: kind.schema for name, kind in TASKS.items()}


def register_task_schemas() -> None:
    """Store each task's schema in Hydra's ConfigStore; conf/task/<name>.yaml lists it first."""
    from hydra.core.config_store import ConfigStore

    for name, schema in TASK_SCHEMAS.items():
        ConfigStore.instance().store(group="schema/task", name=name, node=schema)


def task_vocab_size(section) -> int:
    """The vocabulary size a task's model needs (what a null ``model.vocab_size`` becomes), read
    without building the task. Raises ValueError naming the key or file it could not read."""
    return TASKS[section.name].vocab_size(section)


def drop_long_prompts(task: Task, max_prompt_tokens: int) -> Task:
    """``task`` without the training prompts longer than ``max_prompt_tokens`` tokens
    (``scale.max_prompt_tokens``, the prompt length the memory plan assumes; verl's
    ``filter_overlong_prompts``); rank 0 prints how many it dropped, and the run report shows it.
    Held-out problems are kept (evaluation compares every problem)."""
    kept = [problem for problem in task.train_problems if len(task.encode_prompt(problem)) <= max_prompt_tokens]
    dropped = len(task.train_problems) - len(kept)
    if not dropped:
        return task
    if not kept:
        raise ConfigError(f"scale.max_prompt_tokens={max_prompt_tokens} drops all {dropped} training prompts")
    if is_rank_zero():
        print(f"[quatro] scale.max_prompt_tokens={max_prompt_tokens}: dropped {dropped} of "
              f"{len(task.train_problems)} training prompts (longer)", flush=True)
    return dataclasses.replace(task, train_problems=kept,
                               properties=dict(task.properties, dropped_long_prompts=dropped))


def build_task(cfg) -> Task:
    """The task of a validated run config (``cfg.task``: one of :data:`TASK_SCHEMAS`), its training
    prompts at most ``scale.max_prompt_tokens`` long (:func:`drop_long_prompts`)."""
    return drop_long_prompts(TASKS[cfg.task.name].build(cfg), cfg.scale.max_prompt_tokens)
