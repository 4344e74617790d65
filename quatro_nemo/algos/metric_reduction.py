"""How each training metric is reduced: the one place that declares it (docs/interfaces.md).

Every metric that is reduced over micro-batches, data-parallel ranks or a rollout step's
optimizer steps declares its :class:`Reduction` in :data:`METRIC_REDUCTIONS`: a maximum, a
minimum, or an additive share of the optimizer step (a micro-batch's share of a global mean,
:mod:`quatro_nemo.megatron.loss`). The declaration fixes both reductions:

==========  =======================================  ===================================
reduction   over micro-batches and DP ranks          over a rollout step's updates
==========  =======================================  ===================================
SHARE       sum                                      mean
MAX         max                                      max
MIN         min                                      min
==========  =======================================  ===================================

A metric without a declaration is an error (:func:`metric_reduction`): a new metric of a loss
is declared here, beside the others.
"""
from __future__ import annotations

import enum
from typing import Dict, List, Mapping


class Reduction(enum.Enum):
    SHARE = "sum"
    MAX = "max"
    MIN = "min"


SHARE, MAX, MIN = Reduction.SHARE, Reduction.MAX, Reduction.MIN

METRIC_REDUCTIONS: Mapping[str, Reduction] = {
    # every policy loss (quatro_nemo.algos.losses; docs/interfaces.md "Losses")
    "policy/loss": SHARE, "policy/pg_loss": SHARE, "policy/kl_ref": SHARE, "policy/kl_old": SHARE,
    "policy/entropy": SHARE,
    "policy/ratio/mean": SHARE, "policy/ratio/max": MAX, "policy/ratio/min": MIN,
    "policy/seq_ratio/mean": SHARE, "policy/seq_ratio/max": MAX, "policy/seq_ratio/min": MIN,
    "policy/clip_frac": SHARE, "policy/dual_clip_frac": SHARE, "policy/clamp_frac": SHARE,
    "quatro/log_ratio_stat/mean": SHARE, "quatro/log_ratio_stat/max": MAX, "quatro/log_ratio_stat/min": MIN,
    "quatro/target_abs/mean": SHARE,
    # the loss closure's own (quatro_nemo.megatron.loss.LOSS_KEY) and each optimizer step's
    "loss": SHARE, "grad_norm": SHARE, "lr": SHARE,
    # the rollout engine's gap to the trainer (quatro_nemo.engine.loop.engine_gap_metrics): sums
    # and counts whose ratios are the logged means, and the logged maximum
    "engine_gap/token_abs_sum": SHARE, "engine_gap/tokens": SHARE, "engine_gap/seq_log_ratio_abs_sum": SHARE,
    "engine_gap/seq_ratio_sum": SHARE, "engine_gap/sequences": SHARE, "engine_gap/token_abs_max": MAX,
}


def metric_reduction(key: str) -> Reduction:
    """The declared reduction of metric ``key`` (module docstring); KeyError for an undeclared one."""
    try:
        return METRIC_REDUCTIONS[key]
    except KeyError:
        raise KeyError(f"metric {key!r} has no declared reduction: add it to METRIC_REDUCTIONS in "
                       f"quatro_nemo/algos/metric_reduction.py") from None


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
