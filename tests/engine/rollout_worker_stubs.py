"""Engines for the rollout worker process that compute nothing (tests/engine/test_process_executor.py):
importable by module path, as the spawned worker needs."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from quatro_nemo.engine.rollout import RolloutBatch
from quatro_nemo.megatron.sampling import SampleOutput


@dataclass
class SleepingEngineSpec:
    """``sample`` sleeps ``seconds`` (no CPU: the overlap shows whatever the machine's load) and
    returns one row whose token is the pushed weight's value; ``die_at_step`` exits the worker
    while sampling that step, ``fail_at_step`` raises there, ``hang_at_step`` never answers."""

    seconds: float
    die_at_step: Optional[int] = None
    fail_at_step: Optional[int] = None
    hang_at_step: Optional[int] = None

    def build(self):
        return SleepingEngine(self)


class SleepingEngine:
    def __init__(self, spec: SleepingEngineSpec):
        self.spec, self.value = spec, None

    def load(self, weights):
        self.value = int(weights["weight"].flatten()[0])

    def sample(self, job) -> RolloutBatch:
        step = job.params.seed
        if step == self.spec.die_at_step:
            os._exit(3)
        if step == self.spec.fail_at_step:
            raise ValueError(f"engine failure at step {step}")
        time.sleep(3600 if step == self.spec.hang_at_step else self.spec.seconds)
        tokens = torch.tensor([[self.value, self.value]])
        sample = SampleOutput(tokens=tokens, response_mask=torch.ones(1, 1), logprobs=torch.zeros(1, 1),
                              prompt_lengths=torch.ones(1, dtype=torch.long), response_lengths=torch.ones(1, dtype=torch.long),
                              finished=torch.ones(1, dtype=torch.bool))
        return RolloutBatch(sample, 1, 1, engine_logprobs=torch.zeros(1, 1))
