"""The study's statistics (issue 16): paired t over seeds against scipy, Holm's correction against a
hand-computed example, paired vs unpaired on a constructed case, and the verdicts' rates on
simulated studies with no effect, a planted effect, and a reversed one, run through the study's
own claim code on in-memory runs."""
import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats as scipy_stats

from quatro_nemo.study.analysis import RunData, Study, claim_higher_than_baselines, claim_stability, final_metric
from quatro_nemo.study.config import study_config_from_dict
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.stats import (INCONCLUSIVE, NOT_REPRODUCED, NOT_TESTED, OPPOSES, PARTLY, REPRODUCED, SUPPORTS,
                                     Comparison, decide, holm_adjust, paired_differences, paired_t)

TOP_P = 0.7


def test_paired_t_matches_scipy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.5, 0.1, 6), rng.normal(0.45, 0.1, 6)
    mine = paired_t(a - b)
    ref = scipy_stats.ttest_rel(a, b)
    interval = ref.confidence_interval(0.95)
    assert mine.p_value == pytest.approx(ref.pvalue, rel=1e-10)
    assert (mine.low, mine.high) == pytest.approx((interval.low, interval.high), rel=1e-10)
    assert mine.mean == pytest.approx(float(np.mean(a - b)))
    assert paired_t([0.3]) is None                                   # one seed: no test
    # no spread: a coincidence of a discrete metric (e.g. +3/32 for both seeds), not certainty
    tie = paired_t([0.09375, 0.09375])
    assert tie.p_value == 1.0 and tie.low == tie.high == 0.09375
    assert paired_t([0.0, 0.0]).p_value == 1.0


def test_holm_against_a_hand_computed_example():
    # sorted: 0.005 -> 4 x 0.005 = 0.02; 0.01 -> 3 x 0.01 = 0.03; 0.03 -> 2 x 0.03 = 0.06;
    # 0.04 -> 1 x 0.04 = 0.04, raised to 0.06 (adjusted p-values never decrease along the order)
    assert holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjust([0.5, 0.9]) == pytest.approx([1.0, 1.0])     # capped at 1
    # so at alpha = 0.05 only the first and the last comparisons are significant, where
    # Bonferroni (4 x p) would keep only the last and no correction would keep all four
    comparisons = [Comparison(str(i), paired_t(d)) for i, d in enumerate(
        [[0.1, 0.2, 0.15], [0.1, 0.12, 0.13], [-0.3, -0.31, -0.29], [0.01, -0.01, 0.02]])]
    raw = [c.test.p_value for c in comparisons]
    decide(comparisons, 0.05)
    assert [c.p_adjusted for c in comparisons] == pytest.approx(holm_adjust(raw))


def test_verdicts_from_outcomes():
    def family(*means):
        return [Comparison(str(i), paired_t([m - 0.01, m, m + 0.01])) for i, m in enumerate(means)]

    assert decide(family(1.0, 1.0), 0.05) == REPRODUCED
    assert decide(family(1.0, 0.0), 0.05) == PARTLY
    assert decide(family(1.0, -1.0), 0.05) == NOT_REPRODUCED
    assert decide(family(0.0, 0.0), 0.05) == INCONCLUSIVE
    assert decide([Comparison("x", None)], 0.05) == NOT_TESTED
    mixed = family(1.0, -1.0, 0.0)
    decide(mixed, 0.05)
    assert [c.outcome for c in mixed][:2] == [SUPPORTS, OPPOSES]


def test_paired_vs_unpaired_on_a_constructed_case():
    # A large seed effect shared by both methods (seed s gives ~s), and a small, steady gain of
    # 0.1 for the first. Per seed: d = 0.10, 0.12, 0.08, 0.11, 0.09: mean 0.1, sd sqrt(2.5e-4),
    # so the paired t = 0.1 / (sqrt(2.5e-4) / sqrt(5)) = 10 sqrt(2) = 14.14 on 4 degrees of freedom.
    better = {1: 1.10, 2: 2.12, 3: 3.08, 4: 4.11, 5: 5.09}
    other = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}
    test = paired_t(paired_differences(better, other))
    assert test.mean == pytest.approx(0.1)
    assert test.p_value == pytest.approx(2 * scipy_stats.t.sf(10 * math.sqrt(2), 4))
    assert test.p_value < 2e-4
    # Unpaired, the seed effect is noise: t = 0.1 / sqrt(var(better)/5 + var(other)/5), with
    # var(better) = 9.941 / 4 and var(other) = 10 / 4, so t = 0.1002 and p ~ 0.92.
    unpaired = scipy_stats.ttest_ind(list(better.values()), list(other.values()), equal_var=False)
    assert unpaired.statistic == pytest.approx(0.1 / math.sqrt(9.941 / 20 + 10 / 20), rel=1e-6)
    assert unpaired.pvalue > 0.9
    assert decide([Comparison("b", test)], 0.05) == REPRODUCED
    # seeds are paired by their number, not by position: a missing seed drops out of both
    assert paired_differences({1: 1.0, 3: 3.5}, {3: 3.0, 2: 9.0}) == [0.5]


# --------------------------------------------------------------------------------------------
# Simulated studies through the study's claim code
# --------------------------------------------------------------------------------------------

SEEDS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def plan_and_cfg():
    cfg = study_config_from_dict(dict(
        name="simulated", algorithms=["quatro", "grpo", "gpg", "gspo", "gmpo", "dapo", "cispo"], seeds=SEEDS,
        sweeps=dict(algorithms=["quatro", "grpo"], inner_loops=[1, 8], lr_multipliers=[1, 4], seeds=[1, 2, 3]),
        ablation=dict(delta=0.1, inner_loops=2, log_ratios=["seq_sum", "none"], seeds=[1, 2, 3]),
        deltas=dict(values=[0.05, 0.2], seeds=[1, 2, 3]), evaluation=dict(top_p=[TOP_P])))
    return cfg, build_plan(cfg)


def simulated_study(cfg, plan, rng, effect, seed_sd=1.0, run_sd=1.0, sweep=None):
    """Every run's final metric = (effect if QUATRO) + a seed effect shared by all runs of that
    seed (what pairing removes) + independent run noise. `sweep(spec)` adds to sweep runs."""
    seed_effect = {s: rng.normal(0.0, seed_sd) for s in SEEDS}
    runs = {}
    for name, spec in plan.runs.items():
        value = seed_effect[spec.seed] + rng.normal(0.0, run_sd)
        if spec.setting.algorithm == "quatro":
            value += effect
        if sweep is not None:
            value += sweep(spec, rng)
        runs[name] = RunData(name, {TOP_P: {"pass@8": value, "reward/mean": value}}, [])
    return Study(cfg, plan, runs)


def verdict_rates(plan_and_cfg, effect, studies=400):
    cfg, plan = plan_and_cfg
    rng = np.random.default_rng(11)
    verdicts = Counter()
    for _ in range(studies):
        study = simulated_study(cfg, plan, rng, effect)
        claim = claim_higher_than_baselines(study, "c", "s", final_metric("pass@8", TOP_P), "pass@8")
        verdicts[claim.verdict] += 1
    return {k: v / studies for k, v in verdicts.items()}


def test_no_effect_is_inconclusive_in_at_least_90_percent_of_studies(plan_and_cfg):
    # Holm bounds a false significance in the family of 6 baselines by alpha = 0.05, so >= 95%
    # of studies are INCONCLUSIVE (measured: 0.95); the old rule said NOT REPRODUCED in 63%.
    rates = verdict_rates(plan_and_cfg, effect=0.0)
    assert rates.get(INCONCLUSIVE, 0.0) >= 0.90, rates


def test_a_3_sigma_effect_is_reproduced(plan_and_cfg):
    # 3 standard deviations of a paired per-seed difference (sd sqrt(2) here): with 5 seeds and
    # 6 baselines the study says REPRODUCED in ~96% of simulated studies (and never the opposite).
    rates = verdict_rates(plan_and_cfg, effect=3.0 * math.sqrt(2.0))
    assert rates.get(REPRODUCED, 0.0) >= 0.90, rates
    assert rates.get(NOT_REPRODUCED, 0.0) == 0.0


def test_a_3_sigma_effect_the_other_way_is_not_reproduced(plan_and_cfg):
    rates = verdict_rates(plan_and_cfg, effect=-3.0 * math.sqrt(2.0))
    assert rates.get(NOT_REPRODUCED, 0.0) >= 0.90, rates


def test_sweep_points_use_their_own_spread(plan_and_cfg):
    # The main comparison is nearly noise-free, the sweep's non-default points are very noisy,
    # and the baseline loses a little more reward along the axis. Borrowing the main comparison's
    # spread would call that significant; each point's own seeds cannot tell.
    cfg, plan = plan_and_cfg
    rng = np.random.default_rng(5)

    def sweep(spec, rng):
        aggressive = spec.setting.inner_loops == 8 or spec.setting.lr_multiplier == 4.0
        if not aggressive:
            return 0.0
        return rng.normal(0.0, 0.5) - (0.1 if spec.setting.algorithm == "grpo" else 0.0)

    study = simulated_study(cfg, plan, rng, effect=0.0, seed_sd=0.0, run_sd=1e-3, sweep=sweep)
    claim = claim_stability(study, "k", "s", plan.sweep_inner, 1, "K")
    assert claim.verdict == INCONCLUSIVE, claim
    # the same loss with no noise at the sweep points is found
    quiet = simulated_study(cfg, plan, np.random.default_rng(5), effect=0.0, seed_sd=0.0, run_sd=1e-3,
                            sweep=lambda spec, rng: -0.1 if spec.setting.algorithm == "grpo" and (
                                spec.setting.inner_loops == 8) else 0.0)
    assert claim_stability(quiet, "k", "s", plan.sweep_inner, 1, "K").verdict == REPRODUCED
