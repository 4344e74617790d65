#!/usr/bin/env python
"""Print the per-GPU memory and throughput plan of a run config; refuse layouts that cannot fit.

    python recipes/plan_memory.py config=quatro_1p5b
    python recipes/plan_memory.py config=quatro_7b cluster.nodes=2 parallel.micro_batch_size=2
    python recipes/plan_memory.py config=quatro_7b --json        # machine-readable
    python recipes/plan_memory.py config=quatro_7b --measured-peak-gb=41.3   # next to a measurement

Takes the same arguments as recipes/train.py (Hydra overrides and config=NAME, composed with
Hydra's compose API; no Hydra flags). Exit code 0: the layout fits; 2: a config error or a
layout that cannot fit (the message names the setting to change). Pure arithmetic
(quatro_nemo/engine/memory_plan.py): no GPU needed; it plans for the packages of the machine it
runs on (Transformer Engine, apex), so run it where the training runs.

``--measured-peak-gb=X`` (e.g. ``torch.cuda.max_memory_allocated() / 1e9`` of a run of the same
config, as scripts/gpu_check.sh prints) adds a line comparing it with the plan's
``peak_allocated_gb``; with ``--json`` the object gains ``measured_peak_gb`` and
``measured_over_planned``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.engine.config import CONFIG_ERROR_EXIT_CODE, ConfigError, load_config, memory_plan  # noqa: E402
from quatro_nemo.engine.memory_plan import MemoryPlan, PlanError  # noqa: E402


def plan_for_arguments(argv) -> MemoryPlan:
    """Compose and validate the config like recipes/train.py (Hydra's compose API) and plan it
    (raises ConfigError / PlanError)."""
    return memory_plan(load_config(argv))


MEASURED_FLAG = "--measured-peak-gb="


def main(argv) -> int:
    as_json = "--json" in argv
    measured = [arg for arg in argv if arg.startswith(MEASURED_FLAG)]
    argv = [arg for arg in argv if arg != "--json" and arg not in measured]
    try:
        measured_gb = float(measured[-1][len(MEASURED_FLAG):]) if measured else None
    except ValueError:
        print(f"plan error: {measured[-1]}: expected {MEASURED_FLAG}<number>", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    try:
        plan = plan_for_arguments(argv)
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    if as_json:
        figures = plan.as_dict()
        if measured_gb is not None:
            figures.update(measured_peak_gb=measured_gb, measured_over_planned=measured_gb / plan.peak_allocated_gb)
        print(json.dumps(figures, indent=2))
    else:
        print(plan.format())
        if measured_gb is not None:
            print(plan.compare_peak(measured_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
