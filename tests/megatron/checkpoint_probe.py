"""Host memory and storage traffic of one checkpoint save and load, per rank, at DP 2 on the CPU.

    python tests/megatron/checkpoint_probe.py --strategy routine --size test --out DIR

Two ranks (forked, gloo) build a qwen2-style float32 model, wrap it in megatron-core's
``DistributedDataParallel`` and distributed optimizer as the engine does
(``quatro_nemo.megatron.training``), take one optimizer step (so that Adam's moments exist), save
a checkpoint with ``--strategy`` and load it back into the same objects. Each rank measures (the
script writes ``rank<r>.json``):

- ``save_peak_extra_bytes`` / ``load_peak_extra_bytes``: how far the high-water mark of its
  resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` just before) rose above the
  resident set before the save / the load;
- ``written_bytes``: the sizes of the files it wrote into the checkpoint (``torch_dist`` names each
  data file ``__<rank>_<n>.distcp``; the metadata files count to rank 0, which writes them);
- ``read_bytes``: the growth of ``rchar`` in ``/proc/self/io`` over the load, i.e. what it read
  through read(2) (gloo receives through recv(2), which ``rchar`` does not count: checked by
  ``test_gloo_receives_do_not_count_as_reads``);
- ``optimizer_shard_bytes``: its own share of the float32 master weights and Adam moments
  (12 bytes per parameter of its shard); ``model_bytes``: the float32 weights (replicated);
  ``checkpoint_bytes``: every file of the checkpoint.

Strategies:

- ``today``: the optimizer in megatron's ``fully_reshardable`` format without the memory-efficient
  flag and without the fully-parallel wrappers: what ``quatro_nemo/megatron/dist_checkpoint.py``
  did before it moved to the routine format (kept here as the reference the benchmark compares);
- ``routine``: :func:`quatro_nemo.megatron.dist_checkpoint.save_sharded` / ``load_sharded``
  (``dp_reshardable`` through the fully-parallel wrappers);
- ``reshardable``: the same functions with ``optimizer_format="fully_reshardable"`` (the format
  ``recipes/convert_checkpoint.py reshard`` writes: memory-efficient gather on DP rank 0).

Each rank sets glibc's mmap threshold to 64 kB first (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_``
would): large blocks then go straight back to the kernel when freed, so the high-water mark
follows the live tensors rather than glibc's heap reuse. :func:`measure` runs the probe in a fresh
process (the benchmark: one per measurement); the test forks the ranks from its own process.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.engine.memory_probe import memory_kb, reset_peak  # noqa: E402

WORLD_SIZE = 2   # data parallel 2
STRATEGIES = ("today", "routine", "reshardable")
# ~6.6 M parameters (~79 MB of optimizer state) for the test; ~41 M (~490 MB) for the benchmark.
SIZES = {
    "test": dict(architecture="qwen2", vocab_size=8192, hidden_size=256, num_layers=6, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=768, max_position_embeddings=64, tie_embeddings=False,
                 params_dtype="float32"),
    "bench": dict(architecture="qwen2", vocab_size=16384, hidden_size=512, num_layers=8, num_attention_heads=8,
                  num_query_groups=2, ffn_hidden_size=1536, max_position_embeddings=64, tie_embeddings=False,
                  params_dtype="float32"),
}


def bytes_read() -> int:
    """``rchar`` of ``/proc/self/io``: bytes this process read through read(2) and its kin."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def _todays_state(ddp, optimizer, is_loading: bool):
    from quatro_nemo.megatron import mcore_fixes
    from quatro_nemo.megatron.training import inner_model

    model_state = inner_model(ddp).sharded_state_dict()
    (mcore_fixes.before_optimizer_load if is_loading else mcore_fixes.ensure_optimizer_state)(optimizer)
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})}


def _save(strategy: str, folder: str, ddp, optimizer) -> None:
    from megatron.core import dist_checkpointing

    from quatro_nemo.megatron import dist_checkpoint

    if strategy == "today":
        os.makedirs(folder, exist_ok=True)
        dist_checkpointing.save(_todays_state(ddp, optimizer, is_loading=False), folder)
    else:
        dist_checkpoint.save_sharded(folder, ddp, optimizer, {"next_step": 1}, optimizer_format={
            "routine": dist_checkpoint.ROUTINE_FORMAT, "reshardable": dist_checkpoint.RESHARDABLE_FORMAT}[strategy])


def _load(strategy: str, folder: str, ddp, optimizer) -> None:
    from megatron.core import dist_checkpointing

    from quatro_nemo.megatron import dist_checkpoint, mcore_fixes
    from quatro_nemo.megatron.training import inner_model

    if strategy == "today":
        loaded = dist_checkpointing.load(_todays_state(ddp, optimizer, is_loading=True), folder,
                                         strict="assume_ok_unexpected")
        inner_model(ddp).load_state_dict(loaded["model"])
        mcore_fixes.load_optimizer_state(optimizer, loaded["optimizer"])
    else:
        dist_checkpoint.load_sharded(folder, ddp, optimizer)


def _written_by(folder: str, rank: int) -> int:
    total = 0
    for name in os.listdir(folder):
        writer = int(name.split("_")[2]) if name.startswith("__") and name.endswith(".distcp") else 0
        if writer == rank:
            total += os.path.getsize(os.path.join(folder, name))
    return total


def _return_large_blocks_to_the_kernel() -> None:
    M_MMAP_THRESHOLD = -3   # glibc's malloc.h
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)


def measure_rank(rank: int, strategy: str, size: str, out: str) -> Dict:
    """One rank of the probe (module docstring), saving into ``out``; its measurements. Run under
    ``tests.distributed.run_ranks``."""
    from quatro_nemo.megatron import training
    from quatro_nemo.megatron.collectives import barrier
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    _return_large_blocks_to_the_kernel()
    initialize_parallel(1, 1, seed=5)
    model = build_model(ModelConfig(**SIZES[size]))
    ddp = training.wrap_for_training(model, distributed_optimizer=True)
    optimizer = training.build_optimizer(ddp, training.OptimizerSettings(lr=1e-4, weight_decay=0.01))
    for param in ddp.parameters():   # one step on made-up gradients: Adam's moments exist
        param.main_grad.copy_(0.01 * param.detach())
    training.optimizer_step(ddp, optimizer)
    folder = os.path.join(out, "checkpoint")

    gc.collect()
    barrier()
    reset_peak()
    before = memory_kb("VmRSS")
    _save(strategy, folder, ddp, optimizer)
    save_peak = (memory_kb("VmHWM") - before) * 1024
    gc.collect()
    barrier()

    reset_peak()
    before, read_before = memory_kb("VmRSS"), bytes_read()
    _load(strategy, folder, ddp, optimizer)
    load_peak, read = (memory_kb("VmHWM") - before) * 1024, bytes_read() - read_before
    barrier()
    moments = sum(state["exp_avg"].numel() for inner in _torch_optimizers(optimizer) for state in inner.state.values())
    result = {
        "rank": rank, "strategy": strategy, "size": size,
        "save_peak_extra_bytes": save_peak, "load_peak_extra_bytes": load_peak,
        "written_bytes": _written_by(folder, rank), "read_bytes": read,
        "checkpoint_bytes": sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)),
        "optimizer_shard_bytes": 12 * moments,
        "model_bytes": sum(4 * p.numel() for p in model.parameters()),
    }
    return result


def _torch_optimizers(optimizer) -> List:
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def measure(strategy: str, size: str, out_dir: str, timeout: int = 600) -> List[Dict]:
    """Run the probe in a fresh process; returns each rank's measurements."""
    from quatro_nemo.megatron.parallel import standalone_environment

    env = dict(standalone_environment(), PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__), "--strategy", strategy,
                    "--size", size, "--out", str(out_dir)], env=env, check=True, timeout=timeout, cwd=ROOT)
    return [json.loads(open(os.path.join(out_dir, f"rank{rank}.json")).read()) for rank in range(WORLD_SIZE)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tests.distributed import run_ranks

    os.makedirs(args.out, exist_ok=True)
    for result in run_ranks(WORLD_SIZE, measure_rank, args.strategy, args.size, args.out):
        with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
