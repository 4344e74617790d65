"""Fork-started gloo ranks for the conversion tests (see docs/stack-facts.md: fork after importing
megatron once in the parent, ~0.4 GB and well under a second per rank)."""
from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Callable, List

import torch
import torch.multiprocessing as mp

import megatron.core  # noqa: F401  (imported once in the parent so forked ranks share it)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from quatro_nemo.megatron.parallel import destroy_parallel

    try:
        result = fn(rank, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_parallel()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args) -> List[object]:
    """Run ``fn(rank, *args)`` on ``world_size`` forked ranks; return each rank's result."""
    out_dir = tmp_path / f"ranks_{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(_rank_main, args=(world_size, _free_port(), str(out_dir), fn, args),
                           nprocs=world_size, join=True, start_method="fork")
    except Exception as error:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("*.err")))
        raise AssertionError(f"a rank failed:\n{errors}") from error
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
