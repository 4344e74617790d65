"""How long before its time limit a planned run must be told to checkpoint: the start-up line
(rank 0) comparing the planner's estimate (:attr:`~quatro_nemo.engine.memory_plan.MemoryPlan.preemption_lead_seconds`:
a step, a held-out evaluation and a save, :mod:`quatro_nemo.engine.phase_times`) with the SLURM
template's ``#SBATCH --signal=B:USR1@N``, which ``slurm/lib/common.sh`` exports to the ranks as
:data:`USR1_LEAD_ENV` (read from the batch script, a copy of the template)."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from quatro_nemo.engine.config import ExperimentConfig, is_planned, memory_plan_at_world
from quatro_nemo.engine.phase_times import preemption_line
from quatro_nemo.validation import ConfigError

USR1_LEAD_ENV = "QUATRO_USR1_LEAD_S"


def preemption_report(cfg: ExperimentConfig, world_size: int,
                      environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The start-up line of a planned run (None for runs the planner does not plan)."""
    if not is_planned(cfg):
        return None
    environ = os.environ if environ is None else environ
    given = environ.get(USR1_LEAD_ENV, "")
    try:
        plan = memory_plan_at_world(cfg, world_size)
    except ConfigError as exc:
        return f"preemption: no estimate at {world_size} GPUs ({exc})"
    return preemption_line(plan.phase_seconds, int(given) if given.isdigit() else None)


__all__ = ["USR1_LEAD_ENV", "preemption_report"]
