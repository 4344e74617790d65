#!/usr/bin/env python
"""``recipes/train.py`` as the GPU check runs it: the same command line, one change at the task's
boundary, so that every step takes optimizer steps.

    python scripts/gpu_check_train.py config=gpu_check rollout.backend=vllm ...

A randomly initialised model earns no countdown reward, every advantage is then 0, and a step
without a learning signal takes no optimizer step (``engine.loop.update_policy``): the optimizer
(FusedAdam on a GPU with TE or apex), its Adam state (the planner's train phase), gradient
clipping and the push of weights that moved would never run. Here the task's verifier is replaced
by :class:`LengthParityReward`, a reward any policy earns about half the time; everything else is
``recipes/train.py``'s (``main`` of that file, loaded as a module).
"""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LengthParityReward:
    """1 for a response with an even number of characters, else 0 (``score_batch`` of a verifier)."""

    def score_batch(self, problems, responses):
        return [float(len(response) % 2 == 0) for response in responses]


def reward_any_policy_earns() -> None:
    """Every task this process builds (``engine.loop.build_task``, the task's boundary) scores with
    :class:`LengthParityReward` (also tests/vllm/test_engine_follows_trainer.py's)."""
    from quatro_nemo.engine import loop

    build_task = loop.build_task

    def task_with_parity_reward(cfg):
        task = build_task(cfg)
        task.verifier = LengthParityReward()
        return task

    loop.build_task = task_with_parity_reward


def main(argv) -> int:
    sys.path.insert(0, ROOT)
    reward_any_policy_earns()
    spec = importlib.util.spec_from_file_location("quatro_train_recipe", os.path.join(ROOT, "recipes", "train.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe.main(argv)


if __name__ == "__main__":   # dist_checkpointing's spawned writer re-runs this file's top level only
    sys.exit(main(sys.argv[1:]))
