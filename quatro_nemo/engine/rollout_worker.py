"""The rollout worker: a process of its own that samples while the trainer trains (issue 39;
``rollout.pipeline.executor=process``, :class:`quatro_nemo.engine.executors.ProcessExecutor`).

The trainer spawns one worker per data-parallel rank. The worker builds its engine from a
picklable spec (:class:`MegatronEngineSpec`: megatron's own sampler on a TP=1 copy of the policy,
in a single-rank process group of its own), then serves its command queue in order:

    ("weights", version, optimizer_steps)   copy the shared-memory weights into the engine; ack ("loaded", version)
    ("sample", step, job)                   sample the step's SamplingJob with the weights loaded last;
                                            answer ("rollout", step, version, optimizer_steps, RolloutBatch)
    ("stop",)

so a request submitted after the push of version v is sampled by version v (the pipeline's
schedule). Any error is sent back as ("error", traceback) before the worker exits. The worker
dies with the trainer (``PR_SET_PDEATHSIG``), and the trainer fails within
``rollout.pipeline.take_timeout_s`` when the worker dies or stops answering.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from quatro_nemo.engine.rollout import MegatronRolloutBackend, RolloutBatch, trainer_logprobs
from quatro_nemo.megatron import parallel
from quatro_nemo.megatron.batching import MicroBatching

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``); if the
    parent is already gone, exit now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass
class MegatronEngineSpec:
    """megatron's sampler (:class:`~quatro_nemo.engine.rollout.MegatronRolloutBackend`) on a TP=1,
    PP=1 model of ``model_config``; mu's log-probs by the trainer's own log-prob pass with
    ``batching`` (:func:`quatro_nemo.engine.rollout.trainer_logprobs`)."""

    model_config: Any
    stop_token_ids: Tuple[int, ...]
    pad_id: int
    batching: MicroBatching
    seed: int

    def build(self) -> "MegatronEngine":
        from quatro_nemo.megatron.models import build_model

        for key in parallel.RENDEZVOUS_VARIABLES:   # a private single-rank group, not the trainer's
            os.environ.pop(key, None)
        parallel.initialize_parallel(1, 1, seed=self.seed)
        return MegatronEngine(build_model(self.model_config), self)


class MegatronEngine:
    def __init__(self, model, spec: MegatronEngineSpec):
        self.model = model
        self.backend = MegatronRolloutBackend(model, spec.stop_token_ids, spec.pad_id)
        self.behaviour_logprobs = trainer_logprobs(model, spec.batching)

    def load(self, weights: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(weights[name])

    def sample(self, job) -> RolloutBatch:
        rollout = job.sample(self.backend)
        rollout.engine_logprobs = self.behaviour_logprobs(rollout)
        return rollout


def worker_main(spec, weights: Dict[str, torch.Tensor], commands, results, parent_pid: int, threads: int) -> None:
    """The worker process (module docstring)."""
    die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    try:
        engine = spec.build()
        version, optimizer_steps = None, None
        while True:
            message = commands.get()
            if message[0] == "weights":
                _, version, optimizer_steps = message
                engine.load(weights)
                results.put(("loaded", version))
            elif message[0] == "sample":
                _, step, job = message
                results.put(("rollout", step, version, optimizer_steps, engine.sample(job)))
            else:
                return
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise


__all__ = ["MegatronEngine", "MegatronEngineSpec", "die_with_parent", "worker_main"]
