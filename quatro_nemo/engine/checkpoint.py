"""Training checkpoints for exact resume: model, optimizer, loop position and RNG states.

Layout under the run directory:

    checkpoints/step_000010/model_optim/     megatron dist_checkpointing (torch_dist): model and
                                             optimizer shards, each rank writing its own share
    checkpoints/step_000010/rng/rank_003.pt  each rank's random-number generator states
    checkpoints/step_000010/COMPLETE         step and the layout that saved it
    checkpoints/step_000010/<name>           rank 0's further files (``save_checkpoint(files=)``):
                                             rollouts.pt, the rollouts in flight (rollout_store)
    checkpoints/step_000010/model_optim_reshardable/
                                             only after ``recipes/convert_checkpoint.py reshard``:
                                             the same state in a format any TP/PP sizes load

A checkpoint is written under ``step_000010.tmp`` and renamed by rank 0 once every rank has
finished and ``COMPLETE`` is in it, so a process killed at any instant (SIGKILL included) leaves
the previous complete checkpoint and an ignored ``.tmp`` folder, never a half-written checkpoint
under a final name.

The model and optimizer shards carry their global shapes and offsets
(:mod:`quatro_nemo.megatron.dist_checkpoint`). Every save writes the distributed optimizer in
megatron's ``dp_reshardable`` format, so a run resumes at any data-parallel size but only at the
TP and PP sizes that saved it. To change those, ``recipes/convert_checkpoint.py reshard`` (run at
the saved TP and PP sizes, any DP size) loads the checkpoint and writes it again beside itself in
the ``fully_reshardable`` format (:func:`write_reshardable_copy`), which a run at other TP/PP sizes
then loads; resuming at other TP/PP sizes without it is refused with that command. The RNG states
are per rank and are restored only at the same layout; the loop's own randomness does not depend
on them (rollout seeds are derived from (seed, step), ``step_rollout.derive_seed``), so a
resharded resume is exact too where dropout is off.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from quatro_nemo.megatron import dist_checkpoint, parallel
from quatro_nemo.megatron.collectives import barrier

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
COMPLETE = "COMPLETE"
SHARDS = "model_optim"
RESHARDABLE_SHARDS = "model_optim_reshardable"


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class TrainState:
    """The loop's position, what a checkpoint saves beside the weights, the optimizer and the RNG
    states, and what resume restores: the next rollout step, the optimizer steps taken (lr
    warm-up) and the algorithm's state between steps (``AlgorithmState.state_dict()``)."""

    next_step: int = 0
    optimizer_steps: int = 0
    algorithm_state: Dict[str, Any] = field(default_factory=dict)

    def to_common(self) -> Dict[str, Any]:
        """The checkpoint's ``common`` entry (plain Python values)."""
        return {"next_step": self.next_step, "optimizer_steps": self.optimizer_steps,
                "algorithm_state": dict(self.algorithm_state)}

    @classmethod
    def from_common(cls, common: Dict[str, Any]) -> "TrainState":
        """From a checkpoint's ``common``. Checkpoints written before ``algorithm_state`` existed
        hold QUATRO's delta controller at the top level (``delta_controller``): it is read as the
        algorithm state it is, so they resume exactly."""
        if "algorithm_state" in common:
            algorithm_state = dict(common["algorithm_state"])
        else:
            algorithm_state = {key: common[key] for key in ("delta_controller",) if key in common}
        return cls(next_step=int(common["next_step"]), optimizer_steps=int(common["optimizer_steps"]),
                   algorithm_state=algorithm_state)


def rng_state() -> Dict[str, Any]:
    """Every random-number generator the training loop may touch."""
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = parallel.model_parallel_rng_states()
    if tracker is not None:
        state["megatron_tracker"] = tracker
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron_tracker" in state:
        parallel.set_model_parallel_rng_states(state["megatron_tracker"])


def layout_signature(layout) -> Dict[str, int]:
    """What a checkpoint's shards depend on (a quatro_nemo.megatron.parallel.ParallelLayout)."""
    return {"world_size": layout.world_size, "tensor": layout.tensor_parallel,
            "pipeline": layout.pipeline_parallel, "data": layout.data_parallel}


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def complete_steps(run_dir: str) -> List[int]:
    """Steps that have a complete checkpoint, ascending."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, COMPLETE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(run_dir: str) -> Optional[int]:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def save_checkpoint(run_dir: str, step: int, ddp_model, optimizer, common: Dict[str, Any],
                    layout: Dict[str, int], keep: int = 2, files: Optional[Dict[str, Any]] = None) -> str:
    """Save model, optimizer, ``common`` (loop position; the same on every rank) and this rank's
    RNG states for ``step``, and rank 0's ``files`` (:func:`write_files`). Collective: every rank
    calls it. Returns the final folder."""
    folder = checkpoint_dir(run_dir, step)
    partial = folder + ".tmp"
    if parallel.global_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)   # left by a run killed while saving
        os.makedirs(os.path.join(partial, "rng"))
    barrier()
    dist_checkpoint.save_sharded(os.path.join(partial, SHARDS), ddp_model, optimizer, common)
    torch.save(rng_state(), _rng_path(partial))
    if parallel.global_rank() == 0:
        write_files(partial, files)
    barrier()
    if parallel.global_rank() == 0:
        _atomic_write_text(os.path.join(partial, COMPLETE), json.dumps(
            {"step": step, "layout": layout, "tied_embeddings": _tied_embeddings(ddp_model)}))
        shutil.rmtree(folder, ignore_errors=True)    # an older save of the same step
        os.replace(partial, folder)
        for old in complete_steps(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    barrier()
    return folder


def write_files(folder: str, files: Optional[Dict[str, Any]]) -> None:
    """Each ``{name: object}`` of ``files`` as ``folder/name`` (torch.save), inside the checkpoint
    before its COMPLETE marker: e.g. the rollouts in flight (quatro_nemo.engine.rollout_store)."""
    for name, value in (files or {}).items():
        torch.save(value, os.path.join(folder, name))


def load_file(run_dir: str, step: int, name: str) -> Optional[Any]:
    """An object :func:`write_files` saved in checkpoint ``step`` (None when it has no such file)."""
    path = os.path.join(checkpoint_dir(run_dir, step), name)
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _rng_path(folder: str) -> str:
    """This rank's RNG states in a checkpoint folder."""
    return os.path.join(folder, "rng", f"rank_{parallel.global_rank():03d}.pt")


def _tied_embeddings(ddp_model) -> bool:
    from quatro_nemo.megatron.checkpoint import model_chunks

    return bool(getattr(model_chunks(ddp_model)[0], "share_embeddings_and_output_weights", False))


def saved_layout(run_dir: str, step: int) -> Dict[str, int]:
    with open(os.path.join(checkpoint_dir(run_dir, step), COMPLETE)) as f:
        return json.load(f)["layout"]


def load_checkpoint(run_dir: str, step: int, ddp_model, optimizer, layout: Dict[str, int]) -> Dict[str, Any]:
    """Load ``step`` into the model and optimizer of the current layout (collective) and return
    ``common``. RNG states are restored when the layout is the one that saved (module docstring)."""
    folder = checkpoint_dir(run_dir, step)
    with open(os.path.join(folder, COMPLETE)) as f:
        saved = json.load(f)
    if saved["layout"]["pipeline"] > 1 and saved.get("tied_embeddings", True):
        raise ValueError(
            f"{folder} was saved at parallel.pipeline={saved['layout']['pipeline']} with tied embeddings: "
            "with megatron-core 0.16.1 such a checkpoint reloads a wrong embedding matrix after a "
            "training step (docs/cluster.md, 'Known limits'); train tied-embedding models at "
            "parallel.pipeline=1, or untie them (model.tie_embeddings=false)")
    shards, reshardable_copy = os.path.join(folder, SHARDS), os.path.join(folder, RESHARDABLE_SHARDS)
    if any(saved["layout"][key] != layout[key] for key in ("tensor", "pipeline")) and os.path.isdir(reshardable_copy):
        shards = reshardable_copy
    try:
        common = dist_checkpoint.load_sharded(shards, ddp_model, optimizer)
    except dist_checkpoint.ReshardRequired as exc:
        raise ValueError(
            f"{exc}: torchrun --nproc-per-node=<a multiple of {exc.saved_tensor * exc.saved_pipeline}> "
            f"recipes/convert_checkpoint.py reshard {run_dir} --step {step} (docs/cluster.md, "
            f"'Checkpoints'), then start this run again") from None
    if saved["layout"] == layout:
        set_rng_state(torch.load(_rng_path(folder), weights_only=False))
    return common


def write_reshardable_copy(run_dir: str, step: int, ddp_model, optimizer) -> str:
    """Load checkpoint ``step`` into ``ddp_model`` and ``optimizer`` (built at the TP and PP sizes
    that saved it, any data-parallel size) and write its model and optimizer state again, in the
    ``fully_reshardable`` format, beside the routine copy: ``step_N/model_optim_reshardable``,
    written under ``.tmp`` and renamed once complete, so the checkpoint stays whole whatever
    happens meanwhile. A run at other TP/PP sizes then resumes from it (:func:`load_checkpoint`).
    Collective; returns the new folder."""
    folder = checkpoint_dir(run_dir, step)
    common = dist_checkpoint.load_sharded(os.path.join(folder, SHARDS), ddp_model, optimizer)
    target = os.path.join(folder, RESHARDABLE_SHARDS)
    partial = target + ".tmp"
    if parallel.global_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    dist_checkpoint.save_sharded(partial, ddp_model, optimizer, common,
                                 optimizer_format=dist_checkpoint.RESHARDABLE_FORMAT)
    barrier()
    if parallel.global_rank() == 0:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    barrier()
    return target


def load_model_weights(run_dir: str, step: int, model) -> None:
    """Only the model's weights of ``step``, into ``model`` at the current layout (collective):
    evaluation and HF export."""
    dist_checkpoint.load_model(os.path.join(checkpoint_dir(run_dir, step), SHARDS), model)
