"""The rollout pipeline in the real loop (issue 39; docs/quatro-math.md Sec. 9), recipes/train.py on
the tiny task at rollout.pipeline.max_staleness=2 with the inline executor:

- each step's rollout is the one the weights of step max(0, s - 2) sample: resampled here from the
  checkpoint of that step (the base model for version 0), its tokens and its behaviour log-probs
  equal the rollouts in flight the run's checkpoints hold, bit for bit;
- the logged versions and staleness follow the schedule, and the engine gap is non-zero exactly
  where the weights moved between sampling and training;
- a run resumed from a checkpoint with rollouts in flight gives the uninterrupted run's records,
  and resuming with another max_staleness is refused, naming the key.
"""
import os
import shutil

import pytest
import torch

from .conftest import run_train
from .test_train_e2e import assert_same_records, finish, train_records

pytestmark = pytest.mark.slow

K, STEPS = 2, 4
# A warm-start long enough for rewards (and updates) on most steps: test_adaptive_delta_e2e's, so
# the session's warm-start cache serves both.
STALE = ["warmstart.steps=800", "rollout.n=8", "parallel.micro_batch_size=32", "trainer.inner_loops=2",
         "trainer.mini_batch_prompts=4", "trainer.lr=3e-3", "eval.num_problems=0", "trainer.keep_checkpoints=10",
         f"rollout.pipeline.max_staleness={K}"]


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory, warm_cache):
    from .conftest import TINY

    run_dir = str(tmp_path_factory.mktemp("stale") / "run")
    args = TINY + [f"warmstart.cache_dir={warm_cache}", f"run.dir={run_dir}", *STALE, f"trainer.steps={STEPS}"]
    code, output = finish(run_train(args))
    assert code == 0, output
    return args, run_dir


def test_versions_staleness_and_the_engine_gap_follow_the_schedule(stale_run):
    _, run_dir = stale_run
    records = [r for r in train_records(run_dir) if r["kind"] == "train"]
    assert [r["async/version"] for r in records] == [0, 0, 0, 1]             # max(0, s - 2), s = 0..3
    assert [r["async/staleness"] for r in records] == [0, 1, 2, 2]
    assert all(r["async/outstanding"] == K + 1 for r in records)
    moved = [r["async/staleness_optimizer_steps"] > 0 for r in records]
    assert moved[0] is False and any(moved), records                         # the run learned
    for r, weights_moved in zip(records, moved):
        assert (r["engine_gap/seq_log_ratio_abs_mean"] > 0) == weights_moved, r
        assert 0 < r["async/ess_frac"] <= 1.0 and (r["async/ess_frac"] < 1.0) == weights_moved


def _resample(rank, run_dir, checks):
    """In a fresh process: each (version, step) of ``checks`` sampled by the weights of that version
    (the checkpoint of that step; the base model for version 0), as (tokens, behaviour log-probs)."""
    from omegaconf import OmegaConf

    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine.config import validate
    from quatro_nemo.engine.rollout import trainer_logprobs
    from quatro_nemo.engine.loop import step_micro_batching
    from quatro_nemo.engine.rollout import MegatronRolloutBackend
    from quatro_nemo.engine.step_rollout import derive_seed, step_prompt_indices
    from quatro_nemo.engine.task import build_task
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.sampling import SamplingParams

    cfg = validate(OmegaConf.load(os.path.join(run_dir, "config.yaml")))
    parallel.initialize_parallel(1, 1, seed=cfg.run.seed)
    task = build_task(cfg)
    model_cfg = task.model_config(cfg.model)
    out = {}
    for version, step in checks:
        model = build_model(model_cfg)
        if version == 0:
            load_full_state_dict(model, task.load_base_state(model_cfg))
        else:
            ckpt.load_model_weights(run_dir, version, model)
        batch_size = cfg.trainer.prompts_per_step
        indices = step_prompt_indices(step, batch_size, len(task.train_problems), cfg.run.seed)
        problems = [task.train_problems[i] for i in indices]
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=cfg.rollout.max_new_tokens, seed=derive_seed(cfg.run.seed, "rollout", step))
        backend = MegatronRolloutBackend(model, stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
        rollout = task.generate(backend, problems, range(batch_size), cfg.rollout.n, params)
        out[(version, step)] = (rollout.tokens, trainer_logprobs(model, step_micro_batching(cfg))(rollout))
    return out


def test_each_steps_data_is_a_resample_from_the_checkpoint_of_step_s_minus_k(stale_run):
    """The checkpoint after step c holds the rollouts of steps c .. c + k - 1 (sampled, not yet
    trained): each is what the weights of step max(0, s - k) sample for step s."""
    from quatro_nemo.engine import checkpoint as ckpt
    from quatro_nemo.engine import rollout_store
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.task import build_task
    from tests.distributed import run_ranks

    args, run_dir = stale_run
    cfg = load_config(args)
    pad_id = build_task(cfg).pad_id
    saved = {}
    for checkpoint in range(1, STEPS + 1):
        state = ckpt.load_file(run_dir, checkpoint, rollout_store.ROLLOUTS_FILE)
        assert state["max_staleness"] == K and sorted(state["results"]) == list(range(checkpoint, checkpoint + K))
        for step, part in state["results"].items():
            batch = rollout_store.batch_from_slots(part["slots"], range(cfg.trainer.prompts_per_step),
                                                   part["num_samples"], pad_id)
            saved[step] = (part["version"], batch)
    assert {step: version for step, (version, _) in saved.items()} == {s: max(0, s - K) for s in range(1, STEPS + K)}
    checks = [(version, step) for step, (version, _) in sorted(saved.items()) if version < STEPS - 1]
    resampled = run_ranks(1, _resample, run_dir, checks)[0]
    for version, step in checks:
        tokens, behaviour = resampled[(version, step)]
        batch = saved[step][1]
        assert torch.equal(tokens, batch.tokens), (version, step)
        assert torch.equal(behaviour, batch.engine_logprobs), (version, step)


def test_a_run_resumed_with_rollouts_in_flight_is_the_uninterrupted_run(stale_run, tmp_path):
    """The uninterrupted run's directory as a run stopped after step 2 leaves it (its later
    checkpoints and records removed: the logger drops records after the checkpoint it resumes
    from); the same command resumes and writes the same records. Resuming with another staleness
    is refused, naming the key."""
    args, run_dir = stale_run
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(run_dir, resumed_dir)
    for step in range(3, STEPS + 1):
        shutil.rmtree(os.path.join(resumed_dir, "checkpoints", f"step_{step:06d}"))
    args = [a if not a.startswith("run.dir=") else f"run.dir={resumed_dir}" for a in args]
    code, output = finish(run_train(args))
    assert code == 0, output
    assert "steps 2->4" in output
    assert_same_records(resumed_dir, run_dir)

    code, output = finish(run_train(args + ["rollout.pipeline.max_staleness=1", f"trainer.steps={STEPS + 1}"]))
    assert code != 0
    assert "rollout.pipeline.max_staleness=1, but the run's checkpoint" in output, output[-3000:]
    assert "written with rollout.pipeline.max_staleness=2" in output


def test_the_process_executor_killed_while_sampling_resumes_to_the_inline_run_bit_for_bit(stale_run, tmp_path):
    """rollout.pipeline.executor=process (megatron's sampler in a worker process, fed the weights
    through shared memory): the run and its worker SIGKILLed at a random moment of step 3, after
    the checkpoint of step 2 (the worker samples step 4 + ... then), and the same command resumed:
    the records are the inline executor's, bit for bit (the same weights sample the same tokens;
    mu's log-probs are the same pass in the worker as in the trainer)."""
    import random
    import signal
    import time

    from .test_train_e2e import latest_complete_checkpoint, start_step

    args, inline_dir = stale_run
    run_dir = str(tmp_path / "process")
    args = [a if not a.startswith("run.dir=") else f"run.dir={run_dir}" for a in args] + ["rollout.pipeline.executor=process"]
    step_seconds = {r["step"]: r["time/step"] for r in train_records(inline_dir) if r["kind"] == "train"}
    process = run_train(args, start_new_session=True)
    marker = os.path.join(run_dir, "checkpoints", "step_000002", "COMPLETE")
    deadline = time.time() + 600
    while not os.path.exists(marker):
        assert process.poll() is None, process.communicate()[0]
        assert time.time() < deadline, "no checkpoint for step 2"
        time.sleep(0.05)
    time.sleep(random.Random(39).uniform(0.0, step_seconds[3]))
    assert process.poll() is None, "the run ended before the kill"
    os.killpg(process.pid, signal.SIGKILL)      # the trainer and its rollout worker
    process.communicate(timeout=120)
    resume_from = latest_complete_checkpoint(run_dir)
    code, output = finish(run_train(args))
    assert code == 0, output
    assert start_step(output) == resume_from >= 2
    assert_same_records(run_dir, inline_dir)
