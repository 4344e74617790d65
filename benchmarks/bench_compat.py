"""What the CPU compatibility mode costs per torch call (quatro_nemo.megatron.compat, workaround 3).

    OMP_NUM_THREADS=1 python benchmarks/bench_compat.py [--calls 50000] [--rounds 5]

Every torch function call of a CPU process passes through ``CudaToCpuDeviceMode.__torch_function__``
(a training step of the CPU default makes ~25k of them). Times a small op pair (``x + x`` and a
view) with no mode, with the mode, and with a pass-through mode that does nothing (the floor any
``TorchFunctionMode`` pays), interleaved round after round; prints the least time per call of
each and the mode's overhead over no mode and over the pass-through.
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
from torch.overrides import TorchFunctionMode  # noqa: E402

from quatro_nemo.megatron.compat import CudaToCpuDeviceMode  # noqa: E402


class PassThroughMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_call_us(calls: int) -> float:
    x = torch.randn(64, 64)
    start = time.perf_counter()
    for _ in range(calls):
        (x + x).view(-1)
    return (time.perf_counter() - start) / (2 * calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {"no mode": None, "CudaToCpuDeviceMode": CudaToCpuDeviceMode, "pass-through mode": PassThroughMode}
    best = {name: float("inf") for name in modes}
    for _ in range(args.rounds):
        for name, mode in modes.items():
            if mode is None:
                best[name] = min(best[name], per_call_us(args.calls))
                continue
            with mode():
                best[name] = min(best[name], per_call_us(args.calls))
    for name, us in best.items():
        print(f"{name:>20}: {us:.2f} us per call")
    mode, plain, floor = best["CudaToCpuDeviceMode"], best["no mode"], best["pass-through mode"]
    print(f"CudaToCpuDeviceMode: +{mode - plain:.2f} us per call over no mode (x{mode / plain:.2f}), "
          f"{mode - floor:+.2f} us over the pass-through mode")


if __name__ == "__main__":
    main()
