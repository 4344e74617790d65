"""How each training metric is reduced: the one place that decides it (docs/interfaces.md).

A loss or estimator metric is one of three kinds, declared by its name: ``.../max`` is a maximum,
``.../min`` a minimum, anything else an additive share of the optimizer step (a micro-batch's
share of a global mean, :mod:`quatro_nemo.megatron.loss`). The kind fixes both reductions:

==========  =======================================  ===================================
kind        over micro-batches and DP ranks          over a rollout step's updates
==========  =======================================  ===================================
SHARE       sum                                      mean
MAX         max                                      max
MIN         min                                      min
==========  =======================================  ===================================
"""
from __future__ import annotations

import enum
from typing import Dict, List, Mapping


class Reduction(enum.Enum):
    SHARE = "sum"
    MAX = "max"
    MIN = "min"


def metric_reduction(key: str) -> Reduction:
    """The kind of metric ``key`` (module docstring)."""
    if key.endswith("/max"):
        return Reduction.MAX
    if key.endswith("/min"):
        return Reduction.MIN
    return Reduction.SHARE


def reduce_over_updates(updates: List[Mapping[str, float]]) -> Dict[str, float]:
    """One value per key from each optimizer step's metrics (the keys of the first): the mean of
    shares, the max of maxima, the min of minima (module docstring). Empty for no update."""
    out: Dict[str, float] = {}
    for key in (updates[0] if updates else []):
        values = [m[key] for m in updates]
        kind = metric_reduction(key)
        out[key] = (max(values) if kind is Reduction.MAX else
                    min(values) if kind is Reduction.MIN else sum(values) / len(values))
    return out
