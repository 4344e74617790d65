"""Issue 29's statistics against independent references: TOST against two one-sided scipy t tests,
the Holm-compatible simultaneous intervals against scipy's t intervals and a Monte-Carlo coverage,
the power of a paired t test under Holm against a Monte-Carlo of simulated studies, and the
EQUIVALENT verdict."""
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from quatro_nemo.study.stats import (EQUIVALENT, INCONCLUSIVE, NOT_SIGNIFICANT, REPRODUCED, SUPPORTS, WITHIN_MARGIN,
                                     Comparison, decide, holm_adjust, paired_power, paired_t, seeds_for_power,
                                     simultaneous_intervals, tost)


@pytest.mark.parametrize("shift", [0.0, 0.01, -0.02, 0.05])
def test_tost_is_two_one_sided_scipy_tests(shift):
    rng = np.random.default_rng(7)
    d = rng.normal(shift, 0.02, 12)
    margin = 0.03
    above = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    below = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
    assert tost(d, margin) == pytest.approx(max(above, below), rel=1e-10)
    # the same as: equivalent at alpha iff the 1 - 2 alpha interval lies inside (-margin, margin)
    interval = scipy_stats.ttest_1samp(d, 0.0).confidence_interval(0.9)
    assert (tost(d, margin) < 0.05) == (-margin < interval.low and interval.high < margin)
    assert tost([0.01], margin) is None
    assert tost([0.01, 0.01], margin) == 1.0           # no spread: nothing known, as paired_t
    with pytest.raises(ValueError, match="margin"):
        tost(d, 0.0)


def _family(rng, means, n=16, sd=0.02):
    return [Comparison(str(i), paired_t(rng.normal(mu, sd, n))) for i, mu in enumerate(means)]


def test_equivalent_needs_every_comparison_inside_the_margin():
    rng = np.random.default_rng(1)
    tight = _family(rng, [0.0, 0.002])
    assert decide(tight, 0.05, margin=0.03) == EQUIVALENT
    assert all(c.outcome == WITHIN_MARGIN for c in tight)
    raw = [tost(c.test.differences, 0.03) for c in tight]
    assert [c.tost_p_adjusted for c in tight] == pytest.approx(holm_adjust(raw))
    # without a margin the same data only say INCONCLUSIVE
    assert decide(_family(np.random.default_rng(1), [0.0, 0.002]), 0.05) == INCONCLUSIVE
    # one wide comparison keeps the claim INCONCLUSIVE ("wide"), the other still equivalent
    wide = [tight[0], Comparison("wide", paired_t(rng.normal(0.0, 0.2, 4)))]
    assert decide(wide, 0.05, margin=0.03) == INCONCLUSIVE
    assert [c.outcome for c in wide] == [WITHIN_MARGIN, NOT_SIGNIFICANT]
    # a significant difference is a difference, not an equivalence
    big = _family(rng, [0.02, 0.02], sd=0.005)
    assert decide(big, 0.05, margin=0.03) == REPRODUCED and all(c.outcome == SUPPORTS for c in big)


def _holm_rejected(tests, alpha):
    return [p < alpha for p in holm_adjust([t.p_value for t in tests])]


def test_simultaneous_intervals_against_scipy_and_holm():
    rng = np.random.default_rng(3)
    alpha = 0.05
    # nothing rejected: every interval is scipy's t interval at 1 - alpha / m
    tests = [paired_t(rng.normal(0.0, 1.0, 8)) for _ in range(3)]
    rejected = _holm_rejected(tests, alpha)
    assert not any(rejected)
    for (low, high), t in zip(simultaneous_intervals(tests, rejected, alpha), tests):
        ref = scipy_stats.ttest_1samp(t.differences, 0.0).confidence_interval(1 - alpha / 3)
        assert (low, high) == pytest.approx((ref.low, ref.high), rel=1e-10)
    # one of three rejected: it gets its half-line, the other two the interval at 1 - alpha / 2
    tests = [paired_t(rng.normal(3.0, 1.0, 8)), paired_t(rng.normal(0.0, 1.0, 8)), paired_t(rng.normal(0.1, 1.0, 8))]
    rejected = _holm_rejected(tests, alpha)
    assert rejected == [True, False, False]
    intervals = simultaneous_intervals(tests, rejected, alpha)
    assert intervals[0] == (0.0, math.inf)
    for (low, high), t in zip(intervals[1:], tests[1:]):
        ref = scipy_stats.ttest_1samp(t.differences, 0.0).confidence_interval(1 - alpha / 2)
        assert (low, high) == pytest.approx((ref.low, ref.high), rel=1e-10)
        assert low <= 0.0 <= high                         # consistent with Holm keeping it
    # all rejected: the Bonferroni interval cut at 0 on the rejected side
    tests = [paired_t(rng.normal(3.0, 1.0, 8)), paired_t(rng.normal(-3.0, 1.0, 8))]
    intervals = simultaneous_intervals(tests, _holm_rejected(tests, alpha), alpha)
    for (low, high), t in zip(intervals, tests):
        ref = scipy_stats.ttest_1samp(t.differences, 0.0).confidence_interval(1 - alpha / 2)
        assert (low, high) == pytest.approx((max(0.0, ref.low), ref.high) if t.mean > 0 else (ref.low, min(0.0, ref.high)))


def test_simultaneous_intervals_cover_jointly():
    # Monte-Carlo: 4 comparisons, two true effects, two null; every interval covers its true mean
    # in >= 95% of families (Bonferroni-type intervals are conservative: measured ~0.97)
    rng = np.random.default_rng(5)
    truth = np.array([1.0, 0.0, 0.0, 0.6])
    covered, families = 0, 2000
    for _ in range(families):
        tests = [paired_t(rng.normal(mu, 1.0, 10)) for mu in truth]
        intervals = simultaneous_intervals(tests, _holm_rejected(tests, 0.05), 0.05)
        covered += all(low <= mu <= high for (low, high), mu in zip(intervals, truth))
    assert covered / families >= 0.94


@pytest.mark.parametrize("effect,n,family", [(2.0, 6, 2), (1.0, 10, 1), (2.0, 8, 6), (0.8, 16, 2), (2.0, 16, 6),
                                             (-1.0, 8, 2)])
def test_paired_power_against_monte_carlo(effect, n, family):
    rng = np.random.default_rng(11)
    trials = 20000
    d = rng.normal(effect, 1.0, size=(trials, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    p = 2 * scipy_stats.t.sf(np.abs(t), n - 1)
    simulated = float(np.mean(p < 0.05 / family))
    assert paired_power(effect, n, family, 0.05) == pytest.approx(simulated, abs=0.012)


def test_seeds_for_power_is_the_smallest_n():
    for effect, family in ((2.0, 2), (2.0, 6), (1.0, 1)):
        n = seeds_for_power(effect, family, 0.05, 0.8)
        assert paired_power(effect, n, family) >= 0.8 > paired_power(effect, n - 1, family)
    # a 2-sd effect under Holm over 2 needs 6 seeds (power 0.91; 5 seeds: 0.78, the Monte-Carlo above)
    assert seeds_for_power(2.0, 2) == 6
    assert paired_power(1.0, 1) == 0.0
