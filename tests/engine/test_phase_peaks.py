"""PhasePeaks (quatro_nemo/engine/phase_peaks.py): each phase's host peak from the kernel's own
high-water mark, reset between phases; on CUDA, torch's peaks reset at each phase's start (torch.cuda
faked at its boundary here: the figures are the fake's, by hand); recurring phases merged."""
from __future__ import annotations

import pytest
import torch

from quatro_nemo.engine import phase_peaks
from quatro_nemo.engine.phase_peaks import PhasePeaks, host_memory_kb, reset_host_peak

pytestmark = pytest.mark.skipif(not reset_host_peak(), reason="the kernel refuses to reset VmHWM here")
BLOCK = 300 * 2**20


def test_each_phase_has_its_own_host_peak():
    phases = PhasePeaks()
    with phases.phase("big"):
        before_kb = host_memory_kb("VmRSS")
        block = b"\x01" * BLOCK   # written: every page resident
        del block
    with phases.phase("small"):
        after_kb = host_memory_kb("VmRSS")
    figures = phases.pop()
    # the kernel syncs its per-thread resident counters in batches: a few pages of slack
    assert figures["big/host_peak_gb"] >= (before_kb * 1024 + 0.95 * BLOCK) / 1e9
    # the second phase's peak starts again from what is resident (the block was freed)
    assert figures["small/host_peak_gb"] < figures["big/host_peak_gb"] - 0.25
    assert figures["small/host_peak_gb"] * 1e9 >= after_kb * 1024 * 0.99
    assert figures["big/seconds"] >= 0 and "big/peak_allocated_gb" not in figures  # no CUDA here
    assert phases.pop() == {}


def test_a_recurring_phase_adds_seconds_and_keeps_the_larger_peak(monkeypatch):
    # made; each phase: started, measured, the next phase started
    clock = iter([0.0, 10.0, 12.0, 50.0, 100.0, 103.0, 150.0])
    monkeypatch.setattr(phase_peaks.time, "perf_counter", lambda: next(clock))
    peaks = iter([5 * 2**20, 2 * 2**20])   # kB of VmHWM at each phase's end
    monkeypatch.setattr(phase_peaks, "host_memory_kb", lambda field: next(peaks))
    phases = PhasePeaks()
    with phases.phase("save"):   # 10.0 -> 12.0
        pass
    with phases.phase("save"):   # 100.0 -> 103.0
        pass
    assert phases.pop() == {"save/seconds": 5.0, "save/host_peak_gb": 5 * 2**30 / 1e9}


class FakeCuda:
    """torch.cuda's memory statistics, by hand: phase i (counted by mem_get_info, which PhasePeaks
    reads first at each phase's end) had the i-th figures."""

    def __init__(self):
        self.resets, self.measured = 0, 0
        self.phase_figures = [(3e9, 4e9, 3.5e9, (10e9, 150e9)), (7e9, 9e9, 8e9, (20e9, 150e9))]

    def is_available(self):
        return True

    def reset_peak_memory_stats(self):
        self.resets += 1

    def mem_get_info(self):
        self.measured += 1
        return self.phase_figures[self.measured - 1][3]

    def max_memory_allocated(self):
        return self.phase_figures[self.measured - 1][0]

    def max_memory_reserved(self):
        return self.phase_figures[self.measured - 1][1]

    def memory_reserved(self):
        return self.phase_figures[self.measured - 1][2]


def test_on_cuda_each_phase_reads_torch_peaks_reset_at_its_start(monkeypatch):
    fake = FakeCuda()
    for name in ("is_available", "reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved",
                 "memory_reserved", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    phases = PhasePeaks()
    assert fake.resets == 1
    for name in ("rollout", "train"):
        resets = fake.resets
        with phases.phase(name):
            assert fake.resets == resets + 1   # the peaks start again with the phase
    figures = phases.pop()
    assert {k: v for k, v in figures.items() if k.startswith("rollout/") and k.endswith("_gb")
            and "host" not in k} == {"rollout/peak_allocated_gb": 3.0, "rollout/peak_reserved_gb": 4.0,
                                     "rollout/reserved_gb": 3.5, "rollout/device_used_gb": 140.0}
    assert figures["train/peak_allocated_gb"] == 7.0 and figures["train/device_used_gb"] == 130.0


def test_the_resume_comparison_leaves_out_the_phases_and_the_push_check():
    from quatro_nemo.engine.logging import deterministic_view

    records = [{"step": 1, "kind": "train", "loss": 0.5, "time/step": 2.0, "engine_push/qkv_rel_err": 3e-3},
               {"step": 1, "kind": "phases", "resume/seconds": 4.0, "resume/host_peak_gb": 9.0},
               {"step": 1, "kind": "eval", "pass@1": 0.25}]
    assert deterministic_view(records) == [{"step": 1, "kind": "train", "loss": 0.5},
                                           {"step": 1, "kind": "eval", "pass@1": 0.25}]
