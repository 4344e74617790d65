"""What the training state's offload around sampling costs per round trip, with host buffers
allocated once (quatro_nemo.megatron.training.HostTrainingState) against fresh host memory each
time (megatron-core's ``optimizer.offload_to_cpu``: ``tensor.cpu()`` on every offload).

    OMP_NUM_THREADS=1 python benchmarks/bench_offload.py [--mb 512] [--tensors 16] [--rounds 5]

An Adam state of ``--tensors`` float32 tensors (``--mb`` MB in all, moments included) on the run
device (CUDA when available, else the CPU), offloaded and reloaded round after round, both ways
interleaved; prints the least seconds per offload and per reload of each and their ratio.

On a GPU this is the comparison that matters: pinned buffers (direct DMA) against pageable memory
(a staging copy, and page faults on fresh memory). On the CPU no memory can be pinned, so the
ratio measures only what fresh host memory costs (first-touch page faults, the allocator), not the
transfer; the GPU figure comes from scripts/gpu_check.sh's ``time/offload`` / ``time/reload``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from quatro_nemo.megatron.compat import current_device  # noqa: E402
from quatro_nemo.megatron.training import HostTrainingState  # noqa: E402


class StateOnly:
    """What HostTrainingState reads from megatron's DDP and optimizer, without a model: Adam's
    state over parameters that are not the model's (a master-weight copy), no gradient buffers."""

    def __init__(self, params, optimizer):
        self.optimizer = optimizer           # a torch optimizer behind a megatron one
        self._params = params

    def parameters(self):
        return iter(())                      # no model weights: the whole state moves

    def offload_grad_buffers(self, synchronize: bool, empty_cache: bool) -> None:
        pass

    def restore_grad_buffers(self, synchronize: bool) -> None:
        pass


def adam_state(megabytes: int, tensors: int, device: torch.device):
    numel = megabytes * 2**20 // (4 * 3 * tensors)  # master weight + two moments per tensor
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return params, optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_round_trip(optimizer, device: torch.device):
    """megatron-core's offload_to_cpu / restore_from_cpu: new host memory every offload."""
    tensors = [(group["params"], i) for group in optimizer.param_groups for i in range(len(group["params"]))]
    start = time.perf_counter()
    for params, i in tensors:
        params[i].data = params[i].data.to("cpu", copy=True)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                state[key] = value.to("cpu", copy=True)
    synchronize(device)
    offload = time.perf_counter() - start
    start = time.perf_counter()
    for params, i in tensors:
        params[i].data = params[i].data.to(device, copy=True)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                state[key] = value.to(device, copy=True)
    synchronize(device)
    return offload, time.perf_counter() - start


def reused_round_trip(state: HostTrainingState):
    state.offload()
    state.reload()
    return state.seconds["time/offload"], state.seconds["time/reload"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(current_device())
    params, optimizer = adam_state(args.mb, args.tensors, device)
    holder = StateOnly(params, optimizer)
    reused = HostTrainingState(holder, holder)
    reused_round_trip(reused)  # allocates the host buffers once, as the first offload of a run does
    best = {"fresh host memory": [float("inf")] * 2, "reused host buffers": [float("inf")] * 2}
    for _ in range(args.rounds):
        for name, seconds in (("fresh host memory", fresh_round_trip(optimizer, device)),
                              ("reused host buffers", reused_round_trip(reused))):
            best[name] = [min(a, b) for a, b in zip(best[name], seconds)]
    pinned = all(buffer.is_pinned() for buffer in reused.host_buffers) if device.type == "cuda" else False
    print(f"device {device}, {args.mb} MB of Adam state in {args.tensors * 3} tensors, host buffers pinned: {pinned}")
    for name, (offload, reload) in best.items():
        print(f"{name:>20}: offload {offload * 1e3:8.1f} ms ({args.mb / 1e3 / offload:.2f} GB/s), "
              f"reload {reload * 1e3:8.1f} ms")
    (fresh_off, fresh_re), (reused_off, reused_re) = best["fresh host memory"], best["reused host buffers"]
    print(f"reused / fresh: offload x{reused_off / fresh_off:.2f}, reload x{reused_re / fresh_re:.2f}, "
          f"round trip x{(reused_off + reused_re) / (fresh_off + fresh_re):.2f}")


if __name__ == "__main__":
    main()
