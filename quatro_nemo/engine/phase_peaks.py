"""Seconds and memory peaks of a run's phases: what ``recipes/plan_memory.py`` plans per phase
(start-up, resume, rollout, train, eval, save) measured in the run itself.

    phases = PhasePeaks()            # measuring starts here: the start-up phase
    ...
    phases.end("startup")            # the start-up's record; measuring starts again
    with phases.phase("rollout"):    # a phase's own record
        ...
    logger.log(step, phases.pop(), kind="phases")

For each phase ``P`` the record holds, all in GB (1e9 bytes) and for this rank:

- ``P/seconds``: the phase's wall-clock seconds;
- on CUDA, from torch's caching allocator: ``P/peak_allocated_gb`` and ``P/peak_reserved_gb``
  (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since the phase began: the
  peaks are reset at its start with ``torch.cuda.reset_peak_memory_stats``), ``P/reserved_gb``
  (``memory_reserved`` at its end) and ``P/device_used_gb`` (``total - free`` of
  ``torch.cuda.mem_get_info`` at its end: everything on the device, the CUDA context, NCCL's
  buffers and other allocators such as vLLM's sleep-mode pool included), so
  ``peak_reserved + device_used - reserved`` bounds the device's use during the phase;
- ``P/host_peak_gb``: the process's peak resident memory during the phase (Linux ``VmHWM`` of
  ``/proc/self/status``, reset at the phase's start by writing ``5`` to ``/proc/self/clear_refs``,
  proc(5)); absent where the kernel refuses the reset (the peak would be the process's lifetime one).

A phase that recurs before :meth:`PhasePeaks.pop` adds its seconds and keeps the larger peaks.
The figures are measurements of this process, like wall-clock time: they differ between two runs
of the same config (``quatro_nemo.engine.logging.deterministic_view`` leaves their records out).
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Optional

import torch

GB = 1e9
_PEAK_KEYS = ("peak_allocated_gb", "peak_reserved_gb", "host_peak_gb")


def host_memory_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``: resident now; ``VmHWM``: peak resident)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_host_peak() -> bool:
    """Reset ``VmHWM`` to the current resident size (proc(5): ``/proc/pid/clear_refs``, value 5).
    False where the kernel has no such file or refuses the write."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class PhasePeaks:
    """Per-phase seconds and memory peaks of this process (module docstring); measuring starts
    when it is made (after the run's device is chosen: it reads the current CUDA device)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.pending: Dict[str, float] = {}
        self._start = 0.0
        self._host_peak_reset = False
        self._begin()

    def _begin(self) -> None:
        self._start = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._host_peak_reset = reset_host_peak()

    def measure(self) -> Dict[str, float]:
        """The current phase's figures so far (keys without the phase name)."""
        figures = {"seconds": time.perf_counter() - self._start}
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            figures.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / GB,
                           peak_reserved_gb=torch.cuda.max_memory_reserved() / GB,
                           reserved_gb=torch.cuda.memory_reserved() / GB, device_used_gb=(total - free) / GB)
        if self._host_peak_reset:
            figures["host_peak_gb"] = host_memory_kb("VmHWM") * 1024 / GB
        return figures

    def end(self, name: str) -> None:
        """Record everything since the last boundary as phase ``name``; the next phase starts now."""
        for key, value in self.measure().items():
            full: str = f"{name}/{key}"
            previous: Optional[float] = self.pending.get(full)
            if previous is not None and key == "seconds":
                value += previous
            elif previous is not None and key in _PEAK_KEYS:
                value = max(value, previous)
            self.pending[full] = value
        self._begin()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The block's figures as phase ``name`` (measuring restarts at its start)."""
        self._begin()
        try:
            yield
        finally:
            self.end(name)

    def pop(self) -> Dict[str, float]:
        """The records since the last pop (``P/key``), for a ``kind="phases"`` metrics record."""
        records, self.pending = self.pending, {}
        return records
