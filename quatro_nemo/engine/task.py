"""The task a run trains on, looked up by its config name (``task=<name>``, conf/task/<name>.yaml).

The tasks themselves live in :mod:`quatro_nemo.tasks` (each builds a
:class:`quatro_nemo.tasks.base.Task`); adding one is a schema, a builder and a vocabulary-size
reader in :data:`TASKS`. The engine never branches on a task's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

from quatro_nemo.tasks.base import Task
from quatro_nemo.tasks.countdown.task import CountdownTaskSection, build_countdown_task, countdown_vocab_size
from quatro_nemo.tasks.jsonl import JsonlTaskConfig, build_jsonl_task, jsonl_vocab_size


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


def build_task(cfg) -> Task:
    """The task of a validated run config (``cfg.task``: one of :data:`TASK_SCHEMAS`)."""
    return TASKS[cfg.task.name].build(cfg)
