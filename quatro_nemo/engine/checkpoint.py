"""Training checkpoints for exact resume: model, optimizer, RNG states and the loop position.

Layout under the run directory (one file per rank, so any TP x PP x DP layout saves in parallel):

    checkpoints/step_000010/rank_000.pt     this rank's model shard, optimizer state, RNG states
    checkpoints/step_000010/COMPLETE        written last, by rank 0, after every rank has written

A checkpoint counts only once COMPLETE exists, and each file is written to a temporary name and
renamed, so a process killed at any instant (SIGKILL included) leaves either the previous
complete checkpoint or the new one, never a half-written state that is loaded.

Resuming needs the same parallel layout (the shards are this layout's); converting a checkpoint to
another layout goes through quatro_nemo.megatron.checkpoint (full state dicts).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
COMPLETE = "COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> Dict[str, Any]:
    """Every random-number generator the training loop may touch."""
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # tracker not initialised (no model-parallel seed set)
        pass
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


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


def save_checkpoint(run_dir: str, step: int, state: Dict[str, Any], layout: Dict[str, int],
                    keep: int = 2) -> str:
    """Save this rank's `state` for `step` (collective: every rank calls it). Returns the folder.

    `state` holds at least the model and optimizer state dicts and the loop position; the RNG
    states are added here. `layout` (world size, tp, pp, dp) is recorded in COMPLETE and checked
    on load.
    """
    folder = checkpoint_dir(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    payload = dict(state, rng=rng_state(), layout=layout)
    _atomic_torch_save(payload, os.path.join(folder, f"rank_{_rank():03d}.pt"))
    _barrier()
    if _rank() == 0:
        _atomic_write_text(os.path.join(folder, COMPLETE), json.dumps({"step": step, "layout": layout}))
        for old in complete_steps(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    _barrier()
    return folder


def load_checkpoint(run_dir: str, step: int, layout: Dict[str, int]) -> Dict[str, Any]:
    """Load this rank's state for `step` and restore the RNG states. Raises on a layout mismatch."""
    folder = checkpoint_dir(run_dir, step)
    with open(os.path.join(folder, COMPLETE)) as f:
        saved_layout = json.load(f)["layout"]
    if saved_layout != layout:
        raise ValueError(
            f"checkpoint {folder} was saved with parallel layout {saved_layout}, but this run uses "
            f"{layout}; resume with the same parallel.* settings and world size, or convert the "
            f"checkpoint with recipes/convert_checkpoint.py")
    payload = torch.load(os.path.join(folder, f"rank_{_rank():03d}.pt"), map_location="cpu",
                         weights_only=False)
    set_rng_state(payload.pop("rng"))
    return payload
