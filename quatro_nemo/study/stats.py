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
    EQUIVALENT      no significant difference, and every comparison equivalent within the claim's
                    stated margin (TOST, below; only for a claim that states a margin)
    INCONCLUSIVE    no significant difference (and not shown equivalent: the interval is wide)
    NOT TESTED      fewer than two paired seeds for every comparison (or runs missing)
    NOT RUN (n of N seeds)  only n of the N seeds the design states have every run of the claim
                    finished (an interrupted study): not decided on fewer seeds than pre-registered

Equivalence: **two one-sided tests** (TOST; Schuirmann 1987, "A comparison of the two one-sided
tests procedure and the power approach for assessing the equivalence of average
bioavailability"; Wellek, *Testing Statistical Hypotheses of Equivalence*, Ch. 2) with a margin
``m`` stated before the runs: H0 ``|mu| >= m`` is rejected when both one-sided paired t tests
reject, ``p_tost = max(P(T >= (mean + m)/se), P(T <= (mean - m)/se))`` (n - 1 degrees of
freedom), equivalently when the ``1 - 2 alpha`` interval lies inside ``(-m, m)``. The family's
TOST p-values are Holm-adjusted like the difference tests'.

Simultaneous intervals (:func:`simultaneous_intervals`): the Holm-compatible confidence
intervals of Strassburger & Bretz (2008, "Compatible simultaneous lower confidence bounds for the
Holm procedure and other Bonferroni-based closed tests", Stat. Med. 27), applied to each
direction: with R the comparisons Holm rejects in a family of m, a comparison not in R gets the
t interval at level ``1 - alpha / (m - |R|)``; one in R gets the half-line on its side of 0 when
R is not the whole family, and the Bonferroni interval ``1 - alpha / m`` cut at 0 when it is.
They cover every mean difference at once with probability >= 1 - alpha, and each lies on one side
of 0 (0 at most an endpoint) exactly when Holm rejects it: a comparison Holm keeps has
p >= alpha / (m - |R|), so its interval at that level contains 0.

Power (:func:`paired_power`, :func:`seeds_for_power`): a paired t test over n seeds of an effect
of ``effect_sd`` standard deviations of the per-seed difference has statistic
``T ~ noncentral t(n - 1, effect_sd * sqrt(n))``; under Holm over a family of m the first step
tests at ``alpha / m`` (a lower bound on the power of any comparison of the family: later steps
test at larger levels), so ``power = P(|T| > t_{1 - alpha / (2m), n - 1})``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy import stats as scipy_stats

REPRODUCED, PARTLY, NOT_REPRODUCED, EQUIVALENT, INCONCLUSIVE, NOT_TESTED = (
    "REPRODUCED", "PARTLY", "NOT REPRODUCED", "EQUIVALENT", "INCONCLUSIVE", "NOT TESTED")
VERDICTS = (REPRODUCED, PARTLY, NOT_REPRODUCED, EQUIVALENT, INCONCLUSIVE, NOT_TESTED)
SUPPORTS, OPPOSES, NOT_SIGNIFICANT, WITHIN_MARGIN = "supports", "opposes", "not significant", "equivalent"


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
    p = float(2.0 * scipy_stats.t.sf(abs(mean / se), n - 1))
    return PairedTest(mean, *t_interval(d, confidence), p, n, d.tolist())


def tost(differences: Sequence[float], margin: float) -> Optional[float]:
    """Two one-sided paired t tests of H0 |mean| >= margin (module docstring): their larger
    p-value; None for fewer than 2 seeds. With zero spread nothing is known (p = 1), as in
    :func:`paired_t`."""
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be > 0, got {margin}")
    d = np.asarray([float(x) for x in differences], dtype=np.float64)
    n = d.size
    if n < 2:
        return None
    se = float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return 1.0
    mean = float(d.mean())
    above = float(scipy_stats.t.sf((mean + margin) / se, n - 1))    # H0 mean <= -margin
    below = float(scipy_stats.t.cdf((mean - margin) / se, n - 1))   # H0 mean >= +margin
    return max(above, below)


def t_interval(differences: Sequence[float], confidence: float) -> Tuple[float, float]:
    """The two-sided t interval of the mean of ``differences`` (at least two) at ``confidence``."""
    d = np.asarray([float(x) for x in differences], dtype=np.float64)
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(d.size)
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2.0, d.size - 1)) * se
    return mean - half, mean + half


def simultaneous_intervals(tests: Sequence[PairedTest], rejected: Sequence[bool],
                           alpha: float) -> List[Tuple[float, float]]:
    """Holm-compatible simultaneous intervals (Strassburger & Bretz 2008; module docstring) of a
    family's mean differences, given which comparisons Holm rejected at ``alpha``."""
    m, r = len(tests), sum(bool(x) for x in rejected)
    out = []
    for test, rej in zip(tests, rejected):
        if test.low == test.high and not rej:     # no spread: unknown, as in paired_t (p = 1)
            out.append((-math.inf, math.inf))
        elif not rej:
            out.append(t_interval(test.differences, 1.0 - alpha / (m - r)))
        elif r < m:
            out.append((0.0, math.inf) if test.mean > 0 else (-math.inf, 0.0))
        else:
            low, high = t_interval(test.differences, 1.0 - alpha / m)
            out.append((max(0.0, low), high) if test.mean > 0 else (low, min(0.0, high)))
    return out


def paired_power(effect_sd: float, n: int, family_size: int = 1, alpha: float = 0.05) -> float:
    """Power of a two-sided paired t test over ``n`` seeds at level ``alpha / family_size`` (Holm's
    first step) against a mean difference of ``effect_sd`` standard deviations of the per-seed
    difference (module docstring)."""
    if n < 2:
        return 0.0
    df, noncentrality = n - 1, effect_sd * math.sqrt(n)
    critical = float(scipy_stats.t.ppf(1.0 - alpha / (2.0 * family_size), df))
    # P(T < -c) written as the upper tail of -T ~ nct(df, -nc): scipy's nct.cdf far in the lower
    # tail returns nan (e.g. df 15, nc 8)
    return float(scipy_stats.nct.sf(critical, df, noncentrality) + scipy_stats.nct.sf(critical, df, -noncentrality))


def seeds_for_power(effect_sd: float, family_size: int = 1, alpha: float = 0.05, power: float = 0.8,
                    most: int = 1000) -> int:
    """The fewest paired seeds whose :func:`paired_power` reaches ``power``."""
    for n in range(2, most + 1):
        if paired_power(effect_sd, n, family_size, alpha) >= power:
            return n
    raise ValueError(f"no n <= {most} reaches power {power} at {effect_sd} sd (family {family_size})")


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
    tost_p_adjusted: Optional[float] = None      # Holm-adjusted TOST p (a claim with a margin)
    simultaneous: Optional[Tuple[float, float]] = None   # the family's simultaneous interval


def decide(comparisons: Sequence[Comparison], alpha: float, margin: Optional[float] = None) -> str:
    """Holm-adjust the family's p-values in place, set each outcome and simultaneous interval, and
    return the verdict. With ``margin``, a comparison without a significant difference whose
    Holm-adjusted TOST p is below ``alpha`` is ``equivalent``; the claim is EQUIVALENT when every
    comparison is."""
    tested = [c for c in comparisons if c.test is not None]
    if not tested:
        return NOT_TESTED
    for c, p in zip(tested, holm_adjust([c.test.p_value for c in tested])):
        c.p_adjusted = p
        if p < alpha:
            c.outcome = SUPPORTS if c.test.mean > 0 else OPPOSES
        else:
            c.outcome = NOT_SIGNIFICANT
    intervals = simultaneous_intervals([c.test for c in tested], [c.p_adjusted < alpha for c in tested], alpha)
    for c, interval in zip(tested, intervals):
        c.simultaneous = interval
    if margin is not None:
        for c, p in zip(tested, holm_adjust([tost(c.test.differences, margin) for c in tested])):
            c.tost_p_adjusted = p
            if c.outcome == NOT_SIGNIFICANT and p < alpha:
                c.outcome = WITHIN_MARGIN
    supports = sum(c.outcome == SUPPORTS for c in tested)
    opposes = sum(c.outcome == OPPOSES for c in tested)
    if opposes:
        return NOT_REPRODUCED
    if supports == len(comparisons):
        return REPRODUCED
    if supports:
        return PARTLY
    if sum(c.outcome == WITHIN_MARGIN for c in tested) == len(comparisons):
        return EQUIVALENT
    return INCONCLUSIVE


def not_run(complete: int, designed: int) -> str:
    """The verdict of a claim whose runs are finished for only ``complete`` of its ``designed``
    seeds (module docstring): no test is decided on fewer seeds than the design states."""
    return f"NOT RUN ({complete} of {designed} seeds)"


def is_not_run(verdict: str) -> bool:
    return verdict.startswith("NOT RUN (")


def exact_verdict(holds: Sequence[bool]) -> str:
    """For exact (noise-free) relations: REPRODUCED if every one holds, else NOT REPRODUCED."""
    if not holds:
        return NOT_TESTED
    return REPRODUCED if all(holds) else NOT_REPRODUCED
