"""Run a test function on forked ranks over gloo; each rank saves its results for the parent.

NeMo / NeMo-Aligner / megatron are imported in the parent (by the test module) before forking,
so ranks start in well under a second (``shared/docs/stack-facts.md``).
"""
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank, world_size, port, out_dir, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        from quatro_nemo.megatron.parallel import destroy_parallel

        destroy_parallel()


def run_ranks(world_size, out_dir, fn, *args):
    """``[fn(rank, *args) for each rank]``, each run in its own forked process (raises if one fails)."""
    mp.start_processes(_rank_entry, args=(world_size, _free_port(), str(out_dir), fn, args),
                       nprocs=world_size, join=True, start_method="fork")
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]
