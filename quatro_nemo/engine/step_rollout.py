"""What a rollout step samples, and the run's rollout pipeline (issue 39).

A step's prompts (:func:`step_prompt_indices`) and sampling noise (:func:`derive_seed`) are pure
functions of (run seed, step), so the data position needs no saving and a rollout sampled k steps
ahead is the same as one sampled now by the same weights. :func:`sampling_job` is steps 1-2 of a
training step; :func:`build_pipeline` puts it behind the run's
:class:`~quatro_nemo.engine.pipeline.RolloutPipeline` (``rollout.pipeline``), with the rollouts
in flight of the checkpoint the run resumes from.
"""
from __future__ import annotations

import random
import zlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from quatro_nemo.engine import checkpoint as ckpt
from quatro_nemo.engine import rollout_store
from quatro_nemo.engine.executors import InlineExecutor, ProcessExecutor
from quatro_nemo.engine.rollout import trainer_logprobs
from quatro_nemo.engine.pipeline import RolloutExecutor, RolloutExecutorName, RolloutPipeline, SamplingJob
from quatro_nemo.engine.rollout_worker import MegatronEngineSpec
from quatro_nemo.megatron.sampling import SamplingParams

if TYPE_CHECKING:
    from quatro_nemo.engine.loop import Run


def step_prompt_indices(step: int, batch_size: int, dataset_size: int, seed: int) -> List[int]:
    """Indices of the B prompts of rollout step `step`: epochs of seeded permutations, so the data
    position is a pure function of the step (nothing to save for exact resume)."""
    indices: List[int] = []
    position = step * batch_size
    while len(indices) < batch_size:
        epoch, offset = divmod(position, dataset_size)
        order = list(range(dataset_size))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        take = min(batch_size - len(indices), dataset_size - offset)
        indices.extend(order[offset:offset + take])
        position += take
    return indices


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from (run seed, purpose, step): independent noise streams, no state to save."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def step_problems(run: "Run", step: int) -> List[Dict[str, Any]]:
    """This DP rank's problems of rollout step ``step`` (a function of (seed, step): exact resume)."""
    indices = step_prompt_indices(step, run.cfg.trainer.prompts_per_step, len(run.task.train_problems),
                                  run.cfg.run.seed)
    return [run.task.train_problems[indices[s]] for s in run.slots]


def sampling_job(run: "Run", step: int) -> SamplingJob:
    """Steps 1-2 of rollout step ``step``: N responses for each of this DP rank's prompts (sampling
    noise keyed by (seed, step, global slot), so every layout draws the same responses)."""
    rollout_cfg = run.cfg.rollout
    params = SamplingParams(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                            max_new_tokens=rollout_cfg.max_new_tokens, seed=derive_seed(run.cfg.run.seed, "rollout", step))
    return SamplingJob([run.task.encode_prompt(p) for p in step_problems(run, step)], rollout_cfg.n, params,
                       list(run.slots))


def build_executor(run: "Run") -> RolloutExecutor:
    """The executor ``rollout.pipeline.executor`` names: mu's log-probs computed where the
    pipeline may make a rollout stale and the backend gives none (the megatron sampler)."""
    pipeline_cfg = run.cfg.rollout.pipeline
    position = lambda: (run.state.next_step, run.state.optimizer_steps)  # noqa: E731
    if pipeline_cfg.executor == RolloutExecutorName.process:
        engine = MegatronEngineSpec(run.task.model_config(run.cfg.model), tuple(run.task.stop_token_ids),
                                    run.task.pad_id, run.batching, run.cfg.run.seed)
        return ProcessExecutor(lambda step: sampling_job(run, step), engine, run.policy, position,
                               pipeline_cfg.take_timeout_s)
    behaviour = trainer_logprobs(run.policy, run.batching) if pipeline_cfg.overlapped else None
    return InlineExecutor(lambda step: sampling_job(run, step).sample(run.backend), position, behaviour)


def build_pipeline(run: "Run", resume_from: Optional[int]) -> RolloutPipeline:
    """The run's rollout pipeline (``rollout.pipeline``, quatro_nemo.engine.pipeline), with the
    rollouts in flight of the checkpoint ``resume_from`` (a run keeps its max_staleness)."""
    pipeline_cfg = run.cfg.rollout.pipeline
    executor = build_executor(run)
    finished, submitted_through = {}, run.state.next_step - 1
    if resume_from is not None:
        finished, submitted_through = rollout_store.restore(
            ckpt.load_file(run.cfg.run.dir, resume_from, rollout_store.ROLLOUTS_FILE), run.state.next_step,
            pipeline_cfg.max_staleness, run.slots, run.task.pad_id, ckpt.checkpoint_dir(run.cfg.run.dir, resume_from))
    return RolloutPipeline(pipeline_cfg.max_staleness, executor, finished, submitted_through)


__all__ = ["build_executor", "build_pipeline", "derive_seed", "sampling_job", "step_problems", "step_prompt_indices"]
