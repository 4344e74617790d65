"""Who samples the rollouts :class:`~quatro_nemo.engine.pipeline.RolloutPipeline` submits.

:class:`InlineExecutor` samples a request when it is submitted, in the training processes, with
the trainer's current weights and the run's own rollout backend: exact k-step-stale data on any
backend and parallel layout, with no overlap (the algorithm study and the tests). Its version
stamp is the trainer's own position (``TrainState.next_step``: the weights at the start of that
step), not a counter of pushes.

:class:`ProcessExecutor` hands the requests to a rollout worker process
(:mod:`quatro_nemo.engine.rollout_worker`), which samples while the trainer trains: at
``max_staleness = k >= 1`` the trainer trains step t while the worker samples step t + k. The
weights travel through shared memory allocated once (a push copies the trainer's parameters into
it, then sends the version; the worker copies them into its engine and acknowledges, and the
trainer writes the next push only after that acknowledgement). The worker stamps each rollout
with the version it had loaded. A dead worker, or one silent for ``take_timeout_s``, fails the
run naming it; the worker dies with the trainer.
"""
from __future__ import annotations

import os
import queue
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.multiprocessing as mp

from quatro_nemo.engine.pipeline import RolloutRequest, RolloutResult, SamplingJob, ScheduleError
from quatro_nemo.engine.rollout import RolloutBatch
from quatro_nemo.engine.rollout_worker import worker_main


class InlineExecutor:
    """Samples at submit time with the trainer's current weights.

    Args:
        sample: ``step -> this rank's rollout of the step`` (the loop's prompts and seeds).
        weights_position: ``() -> (version, optimizer steps)`` of the trainer's weights now.
        behaviour_logprobs: for a backend whose rollouts carry no engine log-probs (the megatron
            sampler), how to compute mu's (:func:`~quatro_nemo.engine.rollout.trainer_logprobs`);
            None: not needed (k = 0).
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


class RolloutWorkerError(RuntimeError):
    """The rollout worker died, failed or stopped answering: the run cannot go on."""


class ProcessExecutor:
    """Samples in a worker process of its own (module docstring).

    Args:
        job_of_step: ``step -> SamplingJob`` of this rank (computed in the trainer: prompts, seeds).
        engine: a picklable spec whose ``build()`` makes the worker's engine (``load(weights)``,
            ``sample(job) -> RolloutBatch``), e.g. :class:`~quatro_nemo.engine.rollout_worker.MegatronEngineSpec`.
        policy: the trainer's model (TP=1, PP=1): its ``named_parameters()`` are pushed.
        weights_position: ``() -> (version, optimizer steps)`` of the trainer's weights now.
        timeout_s: ``rollout.pipeline.take_timeout_s``.
        threads: the worker's torch threads.
    """

    def __init__(self, job_of_step: Callable[[int], SamplingJob], engine: Any, policy,
                 weights_position: Callable[[], Tuple[int, int]], timeout_s: float, threads: int = 1):
        self.job_of_step, self.policy, self.weights_position, self.timeout_s = job_of_step, policy, weights_position, timeout_s
        self.weights = {name: torch.empty_like(p, device="cpu").share_memory_()
                        for name, p in policy.named_parameters()}
        context = mp.get_context("spawn")
        self.commands, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=worker_main, name="quatro-rollout-worker", daemon=True,
                                       args=(engine, self.weights, self.commands, self.results, os.getpid(), threads))
        self.process.start()
        self.done: Dict[int, RolloutResult] = {}
        self.unacknowledged: Optional[int] = None   # the version pushed and not yet loaded

    def describe(self) -> str:
        return f"rollout worker (pid {self.process.pid})"

    def push(self, version: int) -> None:
        current, optimizer_steps = self.weights_position()
        if current != version:
            raise ScheduleError(f"weights of version {version} pushed, but the trainer is at step {current}")
        while self.unacknowledged is not None:   # the worker still reads the previous push's buffer
            self._receive(f"the acknowledgement of the weights of version {self.unacknowledged}")
        with torch.no_grad():
            for name, parameter in self.policy.named_parameters():
                self.weights[name].copy_(parameter.detach().to("cpu"))
        self.unacknowledged = version
        self.commands.put(("weights", version, optimizer_steps))

    def submit(self, request: RolloutRequest) -> None:
        self.commands.put(("sample", request.step, self.job_of_step(request.step)))

    def collect(self, step: int) -> RolloutResult:
        while step not in self.done:
            self._receive(f"the rollout of step {step}")
        return self.done.pop(step)

    def _receive(self, awaited: str) -> None:
        """One message from the worker; a dead or silent worker raises :class:`RolloutWorkerError`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutWorkerError(f"the {self.describe()} died (exit code {self.process.exitcode}) "
                                             f"while the trainer waited for {awaited}") from None
                if time.monotonic() >= deadline:
                    self.process.kill()        # wedged: no polite stop
                    self.process.join(timeout=10)
                    raise RolloutWorkerError(f"the {self.describe()} sent nothing for {self.timeout_s:g} s "
                                             f"(rollout.pipeline.take_timeout_s) while the trainer waited for "
                                             f"{awaited}: stopped") from None
        if message[0] == "loaded":
            if message[1] == self.unacknowledged:
                self.unacknowledged = None
        elif message[0] == "rollout":
            _, step, version, optimizer_steps, batch = message
            self.done[step] = RolloutResult(step, version, optimizer_steps, batch)
        else:
            raise RolloutWorkerError(f"the {self.describe()} failed:\n{message[1]}")

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


__all__ = ["InlineExecutor", "ProcessExecutor", "RolloutWorkerError"]
