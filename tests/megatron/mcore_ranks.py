"""Start ``world_size`` ranks over gloo by fork (megatron already imported in the parent)."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

import megatron.core  # noqa: F401  (imported once here so forked ranks do not re-import it)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank, world_size, port, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        from quatro_nemo.megatron.parallel import destroy_parallel

        destroy_parallel()


def run_ranks(world_size: int, fn, *args) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` forked processes; raises if any rank fails."""
    mp.start_processes(_rank_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size,
                       join=True, start_method="fork")
