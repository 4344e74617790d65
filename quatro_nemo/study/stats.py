"""The study's statistics: paired differences over seeds, Holm's correction, and the verdicts.

Unit of replication: the training seed. Runs of different methods with the same seed share the
warm-start (one base model per study), the order of the training prompts (a function of the seed
and the step) and the evaluation (the same held-out problems and the same sampling noise for
every run), so an effect is measured *paired by seed*: for each seed s present in both groups,
``d_s = metric(claimed-better, s) - metric(other, s)``, and the mean difference is tested with a
**paired t test over seeds** (Student 1908; e.g. Wasserman, *All of Statistics*, Sec. 10.2):

    t = mean(d) / (sd(d) / sqrt(n)),  n - 1 degrees of freedom,
    95% interval: mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n).

Why a paired t over seeds and not a bootstrap over problems: the run-to-run variation of RL
training is the noise that decides whether a method is better, and only replicating the training
(seeds) measures it; a bootstrap over the held-out problems of one run per method measures the
evaluation noise only, and a bootstrap over 5 seeds has too few values to resample. The
interval is conditional on the fixed held-out problem set, which every run shares.

Multiplicity: the comparisons that decide one claim (one per baseline, or the steps of one
ordering) form a family; their two-sided p-values are adjusted with **Holm's step-down method**
(Holm 1979, "A simple sequentially rejective multiple test procedure"): with the m p-values
sorted, ``p_(1) <= ... <= p_(m)``, the adjusted value is
``max_{j <= i} min(1, (m - j + 1) * p_(j))``, and a comparison is significant when its adjusted
p-value is below ``alpha``. This bounds the probability of any false significance in the family
by ``alpha`` whatever the dependence between the comparisons.

Verdicts of a claim from its comparisons (significant = Holm-adjusted p < alpha):
    REPRODUCED      every comparison significant in the claimed direction
    PARTLY          some significant in the claimed direction, none in the opposite one
    NOT REPRODUCED  at least one significant in the opposite direction
    INCONCLUSIVE    no significant difference
    NOT TESTED      fewer than two paired seeds for every comparison (or runs missing)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
from scipy import stats as scipy_stats

REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTED = (
    "REPRODUCED", "PARTLY", "NOT REPRODUCED", "INCONCLUSIVE", "NOT TESTED")
VERDICTS = (REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, NOT_TESTED)
SUPPORTS, OPPOSES, NOT_SIGNIFICANT = "supports", "opposes", "not significant"


@dataclass
class PairedTest:
    """A paired t test over seeds of d_s = better_s - other_s (two-sided)."""

    mean: float
    low: float                  # the confidence interval of the mean difference
    high: float
    p_value: float
    n: int                      # number of paired seeds
    differences: List[float] = field(default_factory=list)


def paired_t(differences: Sequence[float], confidence: float = 0.95) -> Optional[PairedTest]:
    """Paired t test of the mean of per-seed differences against 0; None for fewer than 2 seeds.

    With zero spread (every seed gives the same difference) the spread is unknown, not zero: with
    few seeds and a discrete metric (pass@n over a few dozen problems moves in steps of 1/problems)
    equal differences are a coincidence, so such a difference is not significant (p = 1; the
    interval is the point itself).
    """
    d = np.asarray([float(x) for x in differences], dtype=np.float64)
    n = d.size
    if n < 2:
        return None
    mean = float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return PairedTest(mean, mean, mean, 1.0, n, d.tolist())
    t = mean / se
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2.0, n - 1)) * se
    p = float(2.0 * scipy_stats.t.sf(abs(t), n - 1))
    return PairedTest(mean, mean - half, mean + half, p, n, d.tolist())


def paired_differences(better: Mapping[int, float], other: Mapping[int, float]) -> List[float]:
    """d_s = better[s] - other[s] for every seed s present (and finite) in both, in seed order."""
    seeds = sorted(s for s in better if s in other)
    out = []
    for s in seeds:
        a, b = better[s], other[s]
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            out.append(float(a) - float(b))
    return out


def holm_adjust(p_values: Sequence[float]) -> List[float]:
    """Holm (1979) step-down adjusted p-values, in the input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p_values[i])))
        adjusted[i] = running
    return adjusted


@dataclass
class Comparison:
    """One effect of a claim: ``test.mean`` > 0 supports the claim."""

    label: str
    test: Optional[PairedTest]
    p_adjusted: Optional[float] = None
    outcome: str = NOT_SIGNIFICANT
    detail: Dict[str, Any] = field(default_factory=dict)


def decide(comparisons: Sequence[Comparison], alpha: float) -> str:
    """Holm-adjust the family's p-values in place, set each outcome, and return the verdict."""
    tested = [c for c in comparisons if c.test is not None]
    if not tested:
        return NOT_TESTED
    for c, p in zip(tested, holm_adjust([c.test.p_value for c in tested])):
        c.p_adjusted = p
        if p < alpha:
            c.outcome = SUPPORTS if c.test.mean > 0 else OPPOSES
        else:
            c.outcome = NOT_SIGNIFICANT
    supports = sum(c.outcome == SUPPORTS for c in tested)
    opposes = sum(c.outcome == OPPOSES for c in tested)
    if opposes:
        return NOT_REPRODUCED
    if supports == len(comparisons):
        return REPRODUCED
    if supports:
        return PARTLY
    return INCONCLUSIVE


def exact_verdict(holds: Sequence[bool]) -> str:
    """For exact (noise-free) relations: REPRODUCED if every one holds, else NOT REPRODUCED."""
    if not holds:
        return NOT_TESTED
    return REPRODUCED if all(holds) else NOT_REPRODUCED
