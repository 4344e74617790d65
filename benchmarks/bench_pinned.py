"""Pinned host memory for the training state's offload: one pinned buffer per storage through
torch's caching host allocator (what HostTrainingState did) against one flat allocation page-locked
for exactly its size (quatro_nemo.megatron.training.FlatHostBuffer, what it does now).

    python benchmarks/bench_pinned.py [--config quatro_1p5b] [--nodes 1]

The storages are each data-parallel rank's distributed-optimizer state for the model of
conf/<config>.yaml at its tensor-parallel size and ``--nodes`` x ``cluster.gpus_per_node`` GPUs:
a float32 master weight, ``exp_avg`` and ``exp_avg_sq`` for each parameter range of the rank's
shard (megatron's DDP lays the parameters out in reverse order in one buffer, its
``DistributedOptimizer`` splits that into equal contiguous ranges over data-parallel ranks; each
parameter's piece is its own tensor).

Prints the bytes each way and their ratio, for the rank that pins the most and for the node.
Without CUDA from the arithmetic: torch's caching host
allocator reserves ``PowerOf2Ceil(size)`` per allocation (ATen ``CachingHostAllocator.h``), the flat
buffer the sizes at 256-byte alignment. With CUDA from the allocations themselves:
``torch.cuda.host_memory_stats()["allocated_bytes.current"]`` for the per-storage buffers, the flat
buffer's ``nbytes`` (torch's statistics do not count ``cudaHostRegister``ed memory); plus a
device-to-host and host-to-device round trip through each, checked bit for bit, with its GB/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
import yaml  # noqa: E402

from quatro_nemo.megatron.models import ModelConfig  # noqa: E402
from quatro_nemo.megatron.training import FlatHostBuffer, flat_offsets  # noqa: E402

FLOAT32_COPIES = 3  # master weight, exp_avg, exp_avg_sq


def run_config(name: str):
    """(ModelConfig, tensor-parallel size, GPUs per node) of conf/<name>.yaml, read as plain YAML."""
    with open(ROOT / "conf" / f"{name}.yaml") as f:
        conf = yaml.safe_load(f)
    fields = set(ModelConfig.__dataclass_fields__)
    model = ModelConfig(**{key: value for key, value in conf["model"].items() if key in fields})
    return model, conf["parallel"]["tensor"], conf.get("cluster", {}).get("gpus_per_node", 8)


def tensor_parallel_numels(cfg: ModelConfig, tp: int):
    """Elements of each parameter on one tensor-parallel rank, in megatron's order (TE spec names)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * head_dim // tp
    ffn_rows = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size // tp
    numels = [cfg.vocab_size // tp * cfg.hidden_size]                      # embedding
    for _ in range(cfg.num_layers):
        numels += [cfg.hidden_size, qkv_rows * cfg.hidden_size]            # qkv layer norm, linear_qkv
        numels += [qkv_rows] if cfg.qkv_bias else []
        numels += [cfg.hidden_size * cfg.num_attention_heads * head_dim // tp]  # linear_proj
        numels += [cfg.hidden_size, ffn_rows * cfg.hidden_size, cfg.hidden_size * cfg.ffn_hidden_size // tp]
    numels += [cfg.hidden_size] + ([] if cfg.tie_embeddings else [cfg.vocab_size // tp * cfg.hidden_size])
    return numels


def shard_numels(numels, dp: int, rank: int):
    """The pieces of each parameter in data-parallel ``rank``'s equal range of DDP's buffer (the
    parameters in reverse order: ``param_and_grad_buffer.py``, "roughly follow backprop order")."""
    numels, total = numels[::-1], sum(numels)
    per_rank = -(-total // dp)
    start, end, pieces, position = rank * per_rank, (rank + 1) * per_rank, [], 0
    for numel in numels:
        overlap = min(end, position + numel) - max(start, position)
        if overlap > 0:
            pieces.append(overlap)
        position += numel
    return pieces


def power_of_two_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def round_trip(device_tensors, host_buffers):
    """Seconds of a device-to-host then host-to-device copy of every tensor, and bit-identity."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensor, host in zip(device_tensors, host_buffers):
        host.copy_(tensor.view(torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    offload = time.perf_counter() - start
    back = [torch.empty_like(tensor) for tensor in device_tensors]
    start = time.perf_counter()
    for tensor, host in zip(back, host_buffers):
        tensor.view(torch.uint8).copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    reload = time.perf_counter() - start
    return offload, reload, all(torch.equal(a, b) for a, b in zip(device_tensors, back))


def measure_on_gpu(sizes):
    """Pinned bytes per storage (torch's allocator) and flat (cudaHostRegister), with a round trip."""
    device_tensors = [torch.randn(size // 4, device="cuda") for size in sizes]
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    start = time.perf_counter()
    per_storage = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
    per_storage_seconds = time.perf_counter() - start
    per_storage_bytes = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    start = time.perf_counter()
    flat = FlatHostBuffer(sizes, pin=True)
    flat_seconds = time.perf_counter() - start
    results = {"per storage": (per_storage_bytes, per_storage_seconds, per_storage),
               "flat": (flat.nbytes, flat_seconds, flat.parts)}
    pinned = all(part.is_pinned() for part in flat.parts)
    print(f"flat parts pinned (is_pinned): {pinned}")
    gb = sum(sizes) / 1e9
    for name, (nbytes, seconds, buffers) in results.items():
        offload, reload, identical = round_trip(device_tensors, buffers)
        print(f"{name:>12}: {nbytes / 1e9:7.3f} GB pinned in {seconds:5.2f} s; offload {gb / offload:6.1f} GB/s, "
              f"reload {gb / reload:6.1f} GB/s, round trip bit-identical: {identical}")
    return per_storage_bytes, flat.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quatro_1p5b", help="conf/<config>.yaml: model and tensor parallel")
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args()
    cfg, tp, gpus_per_node = run_config(args.config)
    dp = args.nodes * gpus_per_node // tp
    numels = tensor_parallel_numels(cfg, tp)
    ranks = [[4 * numel for numel in shard_numels(numels, dp, rank)] * FLOAT32_COPIES for rank in range(dp)]
    per_storage = [sum(power_of_two_ceil(size) for size in sizes) for sizes in ranks]
    flat = [flat_offsets(sizes)[1] for sizes in ranks]
    worst = max(range(dp), key=lambda rank: per_storage[rank])
    print(f"{args.config}: TP {tp}, DP {dp}; the rank pinning the most (DP rank {worst}): {len(ranks[worst])} "
          f"float32 storages, {sum(ranks[worst]) / 1e9:.3f} GB")
    print(f"arithmetic: per storage (power-of-two rounding) {per_storage[worst] / 1e9:.3f} GB, flat "
          f"{flat[worst] / 1e9:.3f} GB: x{flat[worst] / per_storage[worst]:.3f}; per node ({gpus_per_node} GPUs) "
          f"{tp * sum(per_storage) / args.nodes / 1e9:.1f} GB -> {tp * sum(flat) / args.nodes / 1e9:.1f} GB: "
          f"x{sum(flat) / sum(per_storage):.3f}")
    if torch.cuda.is_available():
        per_storage_bytes, flat_bytes = measure_on_gpu(ranks[worst])
        print(f"measured on {torch.cuda.get_device_name()}: flat / per storage x{flat_bytes / per_storage_bytes:.3f}")

if __name__ == "__main__":
    main()
