"""The start of a run with the vLLM backend on a GPU platform (the fake engine of
``tests/engine/fake_vllm`` at vLLM's import boundary, as in test_vllm_train.py) and the loop's
answer to a pending preemption signal (issue 38):

- the engine is asleep (level 2: weights and KV cache freed) while ``build_run`` builds DDP, the
  optimizer and pi_ref and loads a checkpoint to resume from (the memory plan's start-up and resume
  phases: awake, a 1-node 7B resume does not fit);
- with SIGUSR1 pending after a step whose held-out evaluation is due, the loop skips the
  evaluation and saves the checkpoint at once (the lead the SLURM templates give covers a step, an
  evaluation and a save, and the save must not wait for an evaluation).

One process: a 1-step run leaves a checkpoint; a second run resumes from it, is signalled after
its first step (step 2, evaluation due) and must exit through ``Preempted`` with the step-2
checkpoint saved and no evaluation run.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.distributed import run_ranks
from tests.engine.test_vllm_train import FAKE_VLLM, train_args

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _with(args, **values):
    """``args`` with the Hydra overrides ``key=value`` of ``values`` (dots as ``__``) replaced or added."""
    keys = {key.replace("__", "."): value for key, value in values.items()}
    return [a for a in args if a.split("=", 1)[0] not in keys] + [f"{k}={v}" for k, v in keys.items()]


def _run(rank: int, args, signal_after_step):
    sys.path.insert(0, FAKE_VLLM)
    import vllm

    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine import loop
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.megatron.preemption import Preempted

    assert vllm.__version__.endswith("quatro-fake")
    events = []
    real_load, real_evaluate, real_train_step = ckpt.load_checkpoint, loop.evaluate, loop.train_step

    def load_checkpoint(*a, **kw):
        engine = vllm.LLM.instances[-1]
        events.append({"call": "load_checkpoint", "asleep": sorted(engine.asleep_tags),
                       "engine_holds_weights": engine.weights is not None})
        return real_load(*a, **kw)

    def evaluate(run, step):
        events.append({"call": "evaluate", "step": step})
        return real_evaluate(run, step)

    def train_step(run, step):
        metrics = real_train_step(run, step)
        if step + 1 == signal_after_step:   # SLURM's USR1 arrives while the step runs
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    ckpt.load_checkpoint, loop.evaluate, loop.train_step = load_checkpoint, evaluate, train_step
    cfg = load_config(args)
    try:
        loop.train(cfg)
        outcome = "done"
    except Preempted as exc:
        outcome = f"preempted: {exc}"
    engine = vllm.LLM.instances[0]
    return {"events": events, "outcome": outcome, "latest": ckpt.latest_step(cfg.run.dir),
            "engine_calls": [e["call"] for e in engine.events]}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("sleep") / "run")
    args = _with(train_args(run_dir, 1), trainer__steps=1, eval__num_problems=0)
    (first,) = run_ranks(1, _run, args, None)
    assert first["outcome"] == "done" and first["latest"] == 1
    args = _with(args, trainer__steps=3, trainer__eval_every=1, eval__num_problems=2)
    (second,) = run_ranks(1, _run, args, 2)
    return first, second


def test_the_engine_is_asleep_when_the_checkpoint_loads(resumed):
    first, second = resumed
    # asleep right after it was built, before anything else touched it
    assert first["engine_calls"][:2] == ["LLM", "sleep"]
    (load,) = [e for e in second["events"] if e["call"] == "load_checkpoint"]
    assert load["asleep"] == ["kv_cache", "weights"] and not load["engine_holds_weights"]


def test_a_pending_preemption_signal_skips_the_due_evaluation_and_saves_at_once(resumed):
    _, resumed = resumed
    assert resumed["outcome"] == "preempted: SIGUSR1 at step 2"
    assert resumed["latest"] == 2   # the checkpoint of the signalled step
    assert [e for e in resumed["events"] if e["call"] == "evaluate"] == []   # step 2's evaluation was due
