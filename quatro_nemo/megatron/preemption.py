"""Checkpoint-and-exit on SIGUSR1 / SIGTERM, shared by the training loop and the NeMo-Aligner
trainer (docs/interfaces.md, "Signals"): the signal sets a flag, the trainer checks it at the next
step boundary on every rank (one collective), saves a checkpoint, raises :class:`Preempted`, and
the recipe exits with :data:`PREEMPTED_EXIT_CODE`, which the SLURM templates requeue on.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from quatro_nemo.megatron.compat import current_device

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpoint saved, requeue me (docs/interfaces.md)


class Preempted(RuntimeError):
    """Raised after a SIGUSR1/SIGTERM-triggered checkpoint; the entry point exits with 75."""


@contextlib.contextmanager
def preemption_exits() -> Iterator[None]:
    """Around an entry point's training: :class:`Preempted` is reported on stderr and the process
    exits with :data:`PREEMPTED_EXIT_CODE` (a ``SystemExit``, which Hydra's job runner passes on)."""
    try:
        yield
    except Preempted as exc:
        print(f"preempted: {exc}; checkpoint saved, exiting with {PREEMPTED_EXIT_CODE}", file=sys.stderr)
        raise SystemExit(PREEMPTED_EXIT_CODE) from exc


class PreemptionFlag:
    """SIGUSR1 / SIGTERM set a flag (installed on construction); the trainer checkpoints at the
    next step boundary."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def any_rank_signalled(self) -> bool:
        """True on every rank if any rank was signalled (a collective over the default group, on
        the run device)."""
        if not dist.is_initialized():
            return self.signal_name is not None
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
