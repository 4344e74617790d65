"""A run directory, read through one object: its files, its records, its identity and its policy.

    config.yaml          the resolved config (written by the loop at start-up)
    metrics.jsonl        the training and held-out records (engine/logging.py)
    report.json          written once training finished (engine/report.py): the run is trained
    checkpoints/         engine/checkpoint.py's layout
    study_eval.jsonl     the held-out records of the final policy (engine/api.py's ``run`` with an
                         EvalRequest; the name is the study's, which asked for them first), written last
    run_request.json     the identity of the request the directory was claimed for
                         (engine/api.py's ``preflight``)

:meth:`RunDir.load_policy` and :func:`base_policy` are the one way to build a trained or a base
policy outside the training loop (recipes/evaluate.py's ``checkpoint=`` through
engine/generate.py, the held-out evaluation of engine/heldout.py): a one-process megatron
(TP = 1, PP = 1) for the duration of a ``with`` block.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from omegaconf import DictConfig, OmegaConf

from quatro_nemo.data.schema import iter_jsonl
from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine.config import ExperimentConfig, validate
from quatro_nemo.engine.logging import read_metrics
from quatro_nemo.engine.task import build_task
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.checkpoint import load_full_state_dict
from quatro_nemo.megatron.models import build_model
from quatro_nemo.tasks.base import Task

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
EVALUATION_FILE = "study_eval.jsonl"
IDENTITY_FILE = "run_request.json"


@dataclass
class LoadedPolicy:
    """A policy built for use outside training: its run config, task and the checkpoint step
    (0: the base model)."""

    config: ExperimentConfig
    task: Task
    policy: Any
    step: int


@contextlib.contextmanager
def _one_process_megatron(seed: int) -> Iterator[None]:
    parallel.initialize_parallel(1, 1, seed=seed)
    try:
        yield
    finally:
        parallel.destroy_parallel()


@dataclass(frozen=True)
class RunDir:
    path: str

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def saved_config(self) -> DictConfig:
        """The run's resolved config as saved (config.yaml), not validated."""
        return OmegaConf.load(self.file(CONFIG_FILE))

    def config(self) -> ExperimentConfig:
        """The run's own resolved config (validated again, as any config is)."""
        return validate(self.saved_config())

    def metrics(self) -> List[Dict[str, Any]]:
        """The records the loop logged (none before the first step)."""
        path = self.file(METRICS_FILE)
        return read_metrics(path) if os.path.isfile(path) else []

    def evaluation(self) -> List[Dict[str, Any]]:
        """The final policy's held-out records (none before the evaluation finished)."""
        path = self.file(EVALUATION_FILE)
        return [record for _, record in iter_jsonl(path)] if os.path.isfile(path) else []

    def latest_step(self) -> Optional[int]:
        return ckpt.latest_step(self.path)

    def trained_steps(self) -> Optional[int]:
        """How many steps the finished training ran (its report), None before any finished."""
        path = self.file(REPORT_FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as handle:
            return int(json.load(handle)["steps"])

    def is_trained(self, steps: int = 0) -> bool:
        """Whether a training of at least ``steps`` steps finished here (0: of any length). A run
        re-requested with more steps is not trained yet: it resumes and extends."""
        trained = self.trained_steps()
        return trained is not None and trained >= steps

    def is_evaluated(self) -> bool:
        return os.path.isfile(self.file(EVALUATION_FILE))

    def has_training_output(self) -> bool:
        """Anything a training wrote that a resumed run would build on."""
        return any(os.path.exists(self.file(name)) for name in (METRICS_FILE, REPORT_FILE, "checkpoints"))

    def recorded_identity(self) -> Optional[Dict[str, Any]]:
        """The identity the directory was claimed with (``{"digest", "request"}``), None if none."""
        path = self.file(IDENTITY_FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def record_identity(self, identity: Dict[str, Any]) -> None:
        os.makedirs(self.path, exist_ok=True)
        tmp = self.file(IDENTITY_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(identity, f, indent=1, sort_keys=True)
        os.replace(tmp, self.file(IDENTITY_FILE))

    @contextlib.contextmanager
    def load_policy(self, step: Optional[int] = None, seed: Optional[int] = None) -> Iterator[LoadedPolicy]:
        """The policy of checkpoint ``step`` (default: the newest complete one), rebuilt from the
        run's config.yaml in a one-process megatron seeded with ``seed`` (default ``run.seed``);
        any training layout loads (the checkpoint is sharded by global offsets)."""
        cfg = self.config()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.path}: no complete checkpoint under {self.file('checkpoints')}")
        with _one_process_megatron(cfg.run.seed if seed is None else seed):
            task = build_task(cfg)
            policy = build_model(task.model_config(cfg.model))
            ckpt.load_model_weights(self.path, step, policy)
            yield LoadedPolicy(cfg, task, policy, step)


@contextlib.contextmanager
def base_policy(cfg: ExperimentConfig, seed: int) -> Iterator[LoadedPolicy]:
    """The base model every run of ``cfg`` starts from (the task's warm-start or pretrained
    weights; megatron's initialisation when the task has none), at step 0."""
    task = build_task(cfg)
    model_cfg = task.model_config(cfg.model)
    state = task.load_base_state(model_cfg)        # before megatron: may train the warm-start
    with _one_process_megatron(seed):
        policy = build_model(model_cfg)
        if state is not None:
            load_full_state_dict(policy, state)
        yield LoadedPolicy(cfg, task, policy, 0)
