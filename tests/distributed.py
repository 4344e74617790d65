"""The one launcher of multi-rank tests: ``run_ranks`` forks ``world_size`` ranks over gloo on a
free port (:func:`quatro_nemo.megatron.parallel.free_port`) and returns each rank's result.

Ranks are forked, not spawned: megatron (and, in the aligner suite, NeMo) is imported once in the
parent, so a rank starts in well under a second with ~0.4 GB (``shared/docs/stack-facts.md``).
Each rank gets the ``env://`` variables torchrun would export and one thread; its process group
is torn down when ``fn`` returns or raises. A failing rank prints its traceback and the launcher
raises (torch.multiprocessing's ``ProcessRaisedException`` names the rank and carries it).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp

import megatron.core  # noqa: F401  (imported once in the parent so forked ranks share it)
from quatro_nemo.megatron.parallel import destroy_parallel, free_port


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        torch.save(fn(rank, *args), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        destroy_parallel()


def run_ranks(world_size: int, fn: Callable, *args: Any) -> List[Any]:
    """``[fn(rank, *args) for rank in range(world_size)]``, each rank in its own forked process
    (results travel back through ``torch.save``); raises if any rank fails."""
    with tempfile.TemporaryDirectory(prefix="quatro-ranks-") as out_dir:
        mp.start_processes(_rank_main, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
                           join=True, start_method="fork")
        return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
