#!/usr/bin/env python
"""Print the per-GPU memory and throughput plan of a run config; refuse layouts that cannot fit.

    python recipes/plan_memory.py config=quatro_1p5b
    python recipes/plan_memory.py config=quatro_7b cluster.nodes=2 parallel.micro_batch_size=2
    python recipes/plan_memory.py config=quatro_7b --json        # machine-readable

Takes the same key=value arguments as recipes/train.py. Exit code 0: the layout fits; 2: a
config error or a layout that cannot fit (the message names the setting to change). Pure
arithmetic (quatro_nemo/engine/memory_plan.py): no GPU needed.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from quatro_nemo.engine.config import ConfigError, compose  # noqa: E402
from quatro_nemo.engine.memory_plan import PLAN_SECTIONS, MemoryPlan, PlanError, plan_from_sections  # noqa: E402


def plan_for_arguments(argv) -> MemoryPlan:
    """Compose the config like recipes/train.py and plan it (raises ConfigError / PlanError)."""
    cfg = compose(argv)
    sections = {name: OmegaConf.to_container(cfg[name], resolve=True) if name in cfg else {}
                for name in ("model", "parallel", "trainer", "rollout", "algorithm", *PLAN_SECTIONS)}
    return plan_from_sections(**sections)


def main(argv) -> int:
    as_json = "--json" in argv
    argv = [arg for arg in argv if arg != "--json"]
    try:
        plan = plan_for_arguments(argv)
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=2) if as_json else plan.format())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
