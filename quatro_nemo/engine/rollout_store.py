"""Rollouts in flight, in the checkpoint (issue 39; docs/quatro-math.md Sec. 9.1).

With ``rollout.pipeline.max_staleness = k``, a checkpoint written after step ``t`` (next step
``t + 1``) holds weights theta_{t+1}, but the rollouts of steps ``t + 1 .. t + k`` were sampled by
older weights that no checkpoint keeps: they cannot be sampled again. So the checkpoint drains the
pipeline and writes them (``rollouts.pt``, through ``checkpoint.save_checkpoint(files=...)``, inside
the atomic ``.tmp`` + ``COMPLETE`` scheme): tokens, masks, the sampler's and mu's log-probs, each
step's version and optimizer-step count, keyed by **global prompt slot**, so a run resumed at
another data-parallel layout takes its own slots. A resumed run restores them, pushes theta_{t+1}
and submits from ``t + k + 1`` on: it is the uninterrupted run, bit for bit.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from quatro_nemo.engine.pipeline import RolloutPipeline, RolloutResult
from quatro_nemo.engine.rollout import RolloutBatch
from quatro_nemo.megatron.collectives import all_gather_objects
from quatro_nemo.megatron.parallel import global_rank
from quatro_nemo.megatron.sampling import SampleOutput
from quatro_nemo.validation import ConfigError

ROLLOUTS_FILE = "rollouts.pt"
FORMAT = 1
_ROW_FIELDS = ("response_mask", "logprobs")   # [S, L-1] fields of SampleOutput, 0 past each row


def slot_records(batch: RolloutBatch, slots: Sequence[int]) -> Dict[int, Dict[str, Any]]:
    """This rank's rows of ``batch`` by global prompt slot (``slots[g]`` holds rows g*N .. g*N+N-1),
    each slot's tensors trimmed to its own longest row."""
    sample, n = batch.sample, batch.num_samples
    lengths = sample.prompt_lengths + sample.response_lengths
    records = {}
    for local, slot in enumerate(slots):
        rows = slice(local * n, (local + 1) * n)
        width = int(lengths[rows].max())
        record = {"tokens": sample.tokens[rows, :width].clone(),
                  "prompt_lengths": sample.prompt_lengths[rows].clone(),
                  "response_lengths": sample.response_lengths[rows].clone(),
                  "finished": sample.finished[rows].clone(),
                  "engine_logprobs": None if batch.engine_logprobs is None
                  else batch.engine_logprobs[rows, :width - 1].clone()}
        record.update({name: getattr(sample, name)[rows, :width - 1].clone() for name in _ROW_FIELDS})
        records[int(slot)] = record
    return records


def batch_from_slots(records: Dict[int, Dict[str, Any]], slots: Sequence[int], num_samples: int, pad_id: int,
                     timings: Optional[Dict[str, float]] = None) -> RolloutBatch:
    """The rollout of ``slots`` (this rank's) from :func:`slot_records`' records: rows right-padded
    to the longest (with ``pad_id``, 0 in the [S, L-1] fields), as the backends pad them."""
    parts = [records[int(slot)] for slot in slots]
    width = max(int(part["tokens"].shape[1]) for part in parts)

    def padded(name: str, columns: int, value) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(part[name], (0, columns - part[name].shape[1]), value=value)
                          for part in parts])

    sample = SampleOutput(tokens=padded("tokens", width, pad_id),
                          response_mask=padded("response_mask", width - 1, 0.0),
                          logprobs=padded("logprobs", width - 1, 0.0),
                          prompt_lengths=torch.cat([part["prompt_lengths"] for part in parts]),
                          response_lengths=torch.cat([part["response_lengths"] for part in parts]),
                          finished=torch.cat([part["finished"] for part in parts]))
    has_engine = [part["engine_logprobs"] is not None for part in parts]
    if any(has_engine) and not all(has_engine):
        raise ValueError("some prompt slots of a saved rollout have engine log-probs and others not")
    engine = padded("engine_logprobs", width - 1, 0.0) if all(has_engine) else None
    return RolloutBatch(sample=sample, num_prompts=len(parts), num_samples=num_samples, engine_logprobs=engine,
                        timings=dict(timings or {}))


def pipeline_state(pipeline: RolloutPipeline, next_step: int, slots: Sequence[int]) -> Optional[Dict[str, Any]]:
    """The pipeline's state for a checkpoint whose next step is ``next_step`` (collective: every
    rank drains its pipeline and sends its slots; global rank 0 gets the whole state, the others
    None). Ranks of one model-parallel group hold the same slots: the first copy is kept."""
    mine = {step: {"version": result.version, "optimizer_steps": result.optimizer_steps,
                   "timings": dict(result.batch.timings), "num_samples": result.batch.num_samples,
                   "slots": slot_records(result.batch, slots)}
            for step, result in pipeline.drain(next_step).items()}
    everyone = all_gather_objects(mine)
    if global_rank() != 0:
        return None
    results: Dict[int, Dict[str, Any]] = {}
    for rank_results in everyone:
        for step, part in rank_results.items():
            merged = results.setdefault(step, dict(part, slots={}))
            for slot, record in part["slots"].items():
                merged["slots"].setdefault(slot, record)
    return {"format": FORMAT, "max_staleness": pipeline.max_staleness, "next_step": next_step,
            "submitted_through": pipeline.submitted_through, "results": results}


def restore(state: Optional[Dict[str, Any]], next_step: int, max_staleness: int, slots: Sequence[int], pad_id: int,
            where: str) -> Tuple[Dict[int, RolloutResult], int]:
    """(the finished rollouts of this rank's ``slots`` by step, the last step submitted) from a
    checkpoint's :func:`pipeline_state` (None: a checkpoint written before the pipeline existed,
    by the synchronous loop). ``where`` names the checkpoint. A run resumed with another
    ``rollout.pipeline.max_staleness`` than the one that wrote it is refused: its rollouts of the
    coming steps were sampled on the other schedule, or not at all."""
    saved_k = 0 if state is None else int(state["max_staleness"])
    if saved_k != max_staleness:
        raise ConfigError(f"rollout.pipeline.max_staleness={max_staleness}, but the run's checkpoint {where} was "
                          f"written with rollout.pipeline.max_staleness={saved_k}: resume with {saved_k} (a run "
                          "keeps its staleness; the rollouts in flight were sampled on its schedule)")
    if state is None:
        return {}, next_step - 1
    if int(state["next_step"]) != next_step or int(state.get("format", 0)) != FORMAT:
        raise ValueError(f"{where}: {ROLLOUTS_FILE} is for next step {state['next_step']} (format "
                         f"{state.get('format')}), not {next_step} (format {FORMAT})")
    finished = {}
    for step, part in state["results"].items():
        batch = batch_from_slots(part["slots"], slots, part["num_samples"], pad_id, part["timings"])
        finished[int(step)] = RolloutResult(int(step), int(part["version"]), int(part["optimizer_steps"]), batch)
    return finished, int(state["submitted_through"])


__all__ = ["FORMAT", "ROLLOUTS_FILE", "batch_from_slots", "pipeline_state", "restore", "slot_records"]
