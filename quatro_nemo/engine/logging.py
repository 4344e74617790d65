"""Run outputs: metrics.jsonl (the record a resumed run must reproduce), TensorBoard, optional W&B.

Only rank 0 writes. Keys under ``time/``, and keys ending in ``_s`` (seconds: the rollout
pipeline's ``async/wait_s``, ``async/push_s``), hold wall-clock figures; keys under
``engine_push/`` the push check of the steps whose rollout pushed weights (``vllm.check_push``; a
resumed run pushes at its first step); records of kind ``phases`` each phase's seconds and memory
peaks (``quatro_nemo.engine.phase_peaks``). Every other value is a function of the seed and the
data, so an interrupted-and-resumed run writes the same lines as an uninterrupted one
(``deterministic_view`` drops the others for that comparison).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Iterable, List, Optional

from quatro_nemo.data.schema import iter_jsonl

TIME_PREFIX = "time/"
SECONDS_SUFFIX = "_s"
PUSH_CHECK_PREFIX = "engine_push/"   # present on the steps that pushed: not comparable between runs
PHASES_KIND = "phases"  # a record of the run's phases (seconds, memory peaks): a measurement too


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


class MetricsLogger:
    """Append one JSON line per logging event to run_dir/metrics.jsonl (+ TensorBoard / W&B)."""

    def __init__(self, run_dir: str, enabled: bool, resumed_step: Optional[int] = None, tensorboard: bool = True,
                 wandb_project: Optional[str] = None, config: Optional[Dict[str, Any]] = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # Records after the checkpoint we resume from will be written again: drop them (all of
        # them when starting from scratch).
        truncate_metrics(self.path, through_step=-1 if resumed_step is None else resumed_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resumed_step is None else resumed_step + 1
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge)
        if wandb_project:
            import wandb  # optional dependency: pip install wandb

            self._wandb = wandb.init(project=wandb_project, config=config, dir=run_dir, resume="allow")

    def log(self, step: int, metrics: Dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind}
        record.update({k: _plain(v) for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> List[Dict[str, Any]]:
    return [record for _, record in iter_jsonl(path)]


def truncate_metrics(path: str, through_step: int) -> None:
    """Keep only records of steps <= through_step: those written before the checkpoint of that
    step was saved, which a resumed run does not redo."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path) if r["step"] <= through_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def deterministic_view(records: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The records without wall-clock keys (:func:`is_wall_clock`), push checks and phases' records
    (a resumed run also has a resume phase): what two runs of the same config must agree on."""
    return [{k: v for k, v in r.items() if not (is_wall_clock(k) or k.startswith(PUSH_CHECK_PREFIX))}
            for r in records if r.get("kind") != PHASES_KIND]


def is_wall_clock(key: str) -> bool:
    """Whether metric ``key`` is a wall-clock figure (module docstring)."""
    return key.startswith(TIME_PREFIX) or key.endswith(SECONDS_SUFFIX)
