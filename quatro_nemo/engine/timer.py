"""Wall-clock time of a training step's phases (NeMo-RL's ``Timer``, in a few lines)."""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator


class Timer:
    """``with timer.phase("rollout"): ...`` adds the block's seconds to ``time/rollout``;
    :meth:`metrics` also reports ``time/step``, the seconds since the timer was made."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begin

    def metrics(self) -> Dict[str, float]:
        out = {f"time/{name}": seconds for name, seconds in self.seconds.items()}
        out["time/step"] = time.perf_counter() - self.start
        return out
