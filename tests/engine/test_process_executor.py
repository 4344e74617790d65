"""The process executor (quatro_nemo/engine/executors.py, rollout_worker.py) with a worker engine
that sleeps instead of computing (tests/engine/rollout_worker_stubs.py): overlap that shows
whatever the machine's load, the weights of each push reaching the worker, and a dead, failing or
wedged worker failing the run fast, naming it. The real engine in the worker:
tests/engine/test_pipeline_e2e.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from quatro_nemo.engine.executors import ProcessExecutor, RolloutWorkerError
from quatro_nemo.engine.pipeline import RolloutPipeline, SamplingJob, rollout_version
from quatro_nemo.megatron.sampling import SamplingParams

from .rollout_worker_stubs import SleepingEngineSpec

pytestmark = pytest.mark.slow

GENERATE_S = TRAIN_S = 0.6


class Trainer:
    """A trainer whose weights are the number of its step (so the worker's rollouts show which
    version sampled them) and whose training step sleeps ``TRAIN_S``."""

    def __init__(self):
        self.step = 0
        self.policy = torch.nn.Linear(2, 2, bias=False)
        self.set_weights(0)

    def set_weights(self, step):
        self.step = step
        with torch.no_grad():
            self.policy.weight.fill_(step)

    def position(self):
        return self.step, 10 * self.step


def job(step):
    return SamplingJob([[1]], 1, SamplingParams(seed=step), [0])


def executor_for(trainer, spec, timeout_s=60.0):
    """A started worker (its start, imports included, is not timed below) with ``timeout_s`` from now on."""
    executor = ProcessExecutor(job, spec, trainer.policy, trainer.position, timeout_s=300.0)
    executor.push(0)
    executor._receive("the worker's start")
    executor.timeout_s = timeout_s
    return executor


def train(pipeline, trainer, steps):
    """``steps`` training steps from the trainer's position: (wall seconds, taken rollouts)."""
    start, taken = time.perf_counter(), []
    for step in range(trainer.step, trainer.step + steps):
        trainer.set_weights(step)
        pipeline.advance(step)
        taken.append(pipeline.take(step, 10 * step))
        time.sleep(TRAIN_S)
    trainer.set_weights(trainer.step + 1)
    return time.perf_counter() - start, taken


def test_a_worker_one_step_behind_overlaps_sampling_with_training():
    """k = 0: each step waits for its sampling (step time = generate + train); k = 1: the worker
    samples step t + 1 while the trainer trains step t (step time = max(generate, train)). One
    worker for both phases; its rollouts carry the weights of the version the schedule names."""
    trainer, steps = Trainer(), 5
    executor = executor_for(trainer, SleepingEngineSpec(GENERATE_S))
    try:
        synchronous, taken_sync = train(RolloutPipeline(0, executor), trainer, steps)
        trainer.set_weights(0)                     # the same run again, one step behind
        overlapped, taken = train(RolloutPipeline(1, executor), trainer, steps)
    finally:
        executor.close()
    print(f"k=0: {synchronous:.2f} s, k=1: {overlapped:.2f} s for {steps} steps "
          f"(generate {GENERATE_S} s, train {TRAIN_S} s): ratio {overlapped / synchronous:.2f}")
    assert synchronous >= steps * (GENERATE_S + TRAIN_S)                  # sleeps add up, at least
    assert overlapped < 0.8 * synchronous                                  # ideal: (1 + 5) / 10 = 0.6
    assert all(t.metrics["async/wait_s"] >= 0.9 * GENERATE_S for t in taken_sync)
    assert all(t.metrics["async/wait_s"] < 0.5 * GENERATE_S for t in taken[2:])   # the sampling was done
    for t in taken_sync + taken:      # the token is the weight the worker loaded: the version's
        version = t.result.version
        assert int(t.batch.tokens[0, 0]) == version and t.result.optimizer_steps == 10 * version
    assert [t.result.version for t in taken_sync] == list(range(steps))
    assert [t.result.version for t in taken] == [rollout_version(s, 1) for s in range(steps)]


@pytest.mark.parametrize("failure, message", [
    ("die_at_step", r"rollout worker \(pid \d+\) died \(exit code 3\) while the trainer waited for the rollout of step 2"),
    ("fail_at_step", r"(?s)rollout worker \(pid \d+\) failed:.*ValueError: engine failure at step 2"),
    ("hang_at_step", r"rollout worker \(pid \d+\) sent nothing for 3 s \(rollout.pipeline.take_timeout_s\)"),
])
def test_a_dead_failing_or_wedged_worker_fails_the_step_naming_it(failure, message):
    trainer = Trainer()
    executor = executor_for(trainer, SleepingEngineSpec(0.0, **{failure: 2}), timeout_s=3.0)
    pipeline = RolloutPipeline(0, executor)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutWorkerError, match=message):
            train(pipeline, trainer, steps=4)
    finally:
        executor.close()
    assert time.monotonic() - start < 3 * TRAIN_S + 3.0 + 5.0      # within the timeout, not a hang
    assert not executor.process.is_alive()


TRAINER_SCRIPT = """
import os, sys, time, torch
sys.path.insert(0, {repo!r})
from quatro_nemo.engine.executors import ProcessExecutor
from tests.engine.rollout_worker_stubs import SleepingEngineSpec
if __name__ == "__main__":
    policy = torch.nn.Linear(2, 2, bias=False)
    executor = ProcessExecutor(lambda step: None, SleepingEngineSpec(0.0), policy, lambda: (0, 0), 60.0)
    executor.push(0)
    executor._receive("start")
    print(executor.process.pid, flush=True)
    time.sleep(3600)
"""


def test_the_worker_dies_with_the_trainer(tmp_path):
    """SIGKILL of the trainer alone (not its process group) leaves no worker behind."""
    from .conftest import REPO

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT.format(repo=str(REPO)))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    worker_pid = int(trainer.stdout.readline())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker_pid):
        time.sleep(0.1)
    assert not _alive(worker_pid)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
