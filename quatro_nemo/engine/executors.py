"""Who samples the rollouts :class:`~quatro_nemo.engine.pipeline.RolloutPipeline` submits.

:class:`InlineExecutor` samples a request when it is submitted, in the training processes, with
the trainer's current weights and the run's own rollout backend: exact k-step-stale data on any
backend and parallel layout, with no overlap (the algorithm study and the tests). Its version
stamp is the trainer's own position (``TrainState.next_step``: the weights at the start of that
step), not a counter of pushes.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from quatro_nemo.engine.pipeline import RolloutRequest, RolloutResult, ScheduleError
from quatro_nemo.engine.rollout import RolloutBatch, model_inputs
from quatro_nemo.megatron.batching import MicroBatching
from quatro_nemo.megatron.compat import current_device
from quatro_nemo.megatron.forward import compute_logprobs


def trainer_logprobs(policy, batching: MicroBatching) -> Callable[[RolloutBatch], torch.Tensor]:
    """``rollout -> log pi(o_t)`` [S, L-1] (CPU, float32, 0 outside the response) by the trainer's
    own forward pass (``compute_logprobs``, the function that computes pi_prox when the step
    trains: with the same weights, the same values bit for bit) at temperature 1: the behaviour
    log-probs of the megatron sampler, which samples with the trained model itself
    (docs/quatro-math.md Sec. 9.6). Collective over the model-parallel group."""

    def logprobs(rollout: RolloutBatch) -> torch.Tensor:
        with torch.no_grad():
            values, _ = compute_logprobs(policy, model_inputs(rollout, current_device()), batching)
        return values.cpu() * rollout.response_mask

    return logprobs


class InlineExecutor:
    """Samples at submit time with the trainer's current weights.

    Args:
        sample: ``step -> this rank's rollout of the step`` (the loop's prompts and seeds).
        weights_position: ``() -> (version, optimizer steps)`` of the trainer's weights now.
        behaviour_logprobs: for a backend whose rollouts carry no engine log-probs (the megatron
            sampler), how to compute mu's (:func:`trainer_logprobs`); None: not needed (k = 0).
    """

    def __init__(self, sample: Callable[[int], RolloutBatch], weights_position: Callable[[], Tuple[int, int]],
                 behaviour_logprobs: Optional[Callable[[RolloutBatch], torch.Tensor]] = None):
        self.sample = sample
        self.weights_position = weights_position
        self.behaviour_logprobs = behaviour_logprobs
        self.done: Dict[int, RolloutResult] = {}

    def push(self, version: int) -> None:
        """Nothing moves (the trainer's weights are the sampler's); the trainer must be at ``version``."""
        current, _ = self.weights_position()
        if current != version:
            raise ScheduleError(f"weights of version {version} pushed, but the trainer is at step {current}")

    def submit(self, request: RolloutRequest) -> None:
        version, optimizer_steps = self.weights_position()
        rollout = self.sample(request.step)
        if self.behaviour_logprobs is not None and rollout.engine_logprobs is None:
            rollout.engine_logprobs = self.behaviour_logprobs(rollout)
        self.done[request.step] = RolloutResult(request.step, version, optimizer_steps, rollout)

    def collect(self, step: int) -> RolloutResult:
        if step not in self.done:
            raise ScheduleError(f"the rollout of step {step} was never submitted to the inline executor")
        return self.done.pop(step)

    def close(self) -> None:
        self.done.clear()


__all__ = ["InlineExecutor", "trainer_logprobs"]
