"""The sweeps' search (``sweeps.search``): a method's next K or lr multiplier runs only once the one
before it held, so each sweep ends at the method's breaking point; the claims then compare methods
on the points both ran. Checked against hand-worked cases and against the whole grid's breaking
point (the search never changes it)."""
import random

import pytest

from quatro_nemo.study.analysis import breaking_point
from quatro_nemo.study.kept import archive_path, write_archive
from quatro_nemo.study.planner import build_plan, finished_rewards
from quatro_nemo.study.plan import searched_points
from tests.study.test_claims import claims_by_id, eval_records, load, small_study

GRID = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]


def test_searched_points_by_hand():
    means = {1.0: 0.5, 2.0: 0.48, 3.0: 0.46, 4.0: 0.40, 6.0: 0.47, 8.0: 0.1}
    assert searched_points(GRID, 1.0, means.get, 0.9) == [1.0, 2.0, 3.0, 4.0]   # x4 breaks (0.40 < 0.45): the last run
    assert searched_points(GRID, 1.0, means.get, 0.5) == GRID                   # holds to the top
    assert searched_points(GRID, 1.0, {1.0: 0.5, 2.0: 0.1}.get, 0.9) == [1.0, 2.0]
    # unknown means (runs not finished) end the list for now
    assert searched_points(GRID, 1.0, {1.0: 0.5}.get, 0.9) == [1.0, 2.0]
    assert searched_points(GRID, 1.0, {}.get, 0.9) == [1.0]
    # points below the default are not searched: always run
    assert searched_points([0.5, 1.0, 2.0, 4.0], 1.0, {1.0: 0.5, 2.0: 0.2}.get, 0.9) == [0.5, 1.0, 2.0]
    assert searched_points([1, 2, 4, 8], 1, {1: 0.5, 2: 0.5, 4: 0.44}.get, 0.9) == [1, 2, 4]


def test_the_search_finds_the_whole_grids_breaking_point():
    rng = random.Random(0)
    for _ in range(500):
        means = {x: rng.uniform(0.0, 1.0) for x in GRID}
        tolerance = rng.choice([0.5, 0.8, 0.9])
        searched = searched_points(GRID, 1.0, means.get, tolerance)
        assert breaking_point({x: means[x] for x in searched}, 1.0, tolerance) == breaking_point(means, 1.0, tolerance)
        # and it runs no point after the first that breaks
        assert len(searched) == min(len(GRID), GRID.index(breaking_point(means, 1.0, tolerance)) + 2)


def searched_study():
    return small_study(sweeps=dict(algorithms=["quatro", "gspo"], inner_loops=[1, 2, 4], lr_multipliers=[1, 2, 4, 16],
                                   seeds=[1, 2], search=True))


# final held-out reward per (algorithm, K, lr multiplier): GSPO breaks at lr x2 and at K = 4,
# QUATRO holds to lr x16 and K = 4 (0.9 x 0.6 = 0.54 is the floor)
REWARD = {("quatro", 1, 1.0): 0.6, ("quatro", 1, 2.0): 0.58, ("quatro", 1, 4.0): 0.57, ("quatro", 1, 16.0): 0.55,
          ("quatro", 2, 1.0): 0.59, ("quatro", 4, 1.0): 0.56,
          ("gspo", 1, 1.0): 0.6, ("gspo", 1, 2.0): 0.3, ("gspo", 2, 1.0): 0.57, ("gspo", 4, 1.0): 0.2}


def write_result(study_dir, plan, spec):
    s = spec.setting
    reward = REWARD.get((s.algorithm, s.inner_loops, s.lr_multiplier), 0.5) + 0.001 * spec.seed
    final = {"reward/mean": reward, "entropy": 0.2, "ucr": 0.1, **{f"pass@{k}": 0.5 for k in (1, 2, 4, 8, 16)},
             **{f"ucc@{k}": 0.5 for k in (1, 2, 4, 8, 16)}}
    write_archive(archive_path(study_dir, spec.name),
                  [dict(step=1, kind="train", **{"reward/mean": 0.3})] + eval_records(final, 1, plan.needs_full_evaluation(spec)))


def run_search(study_dir, cfg):
    """What the driver does: finish every run the plan asks for, rebuild the plan, until it asks for no more."""
    done = set()
    while True:
        plan = build_plan(cfg, study_dir)
        new = [spec for name, spec in plan.runs.items() if name not in done]
        if not new:
            return plan
        for spec in new:
            write_result(study_dir, plan, spec)
            done.add(spec.name)


def test_the_plan_follows_the_finished_runs(tmp_path):
    cfg, whole = searched_study()
    # no results directory (a SLURM sweep runs everything at once): the whole grids
    assert list(whole.sweep_lr["gspo"]) == [1.0, 2.0, 4.0, 16.0] and list(whole.sweep_inner["gspo"]) == [1, 2, 4]
    study_dir = str(tmp_path)
    start = build_plan(cfg, study_dir)      # nothing finished: only the sweeps' defaults
    assert list(start.sweep_lr["quatro"]) == [1.0] and list(start.sweep_inner["quatro"]) == [1]
    # a cost estimate counts what the results cannot decide as run
    assert set(build_plan(cfg, study_dir, unknown_holds=True).runs) == set(whole.runs)
    plan = run_search(study_dir, cfg)
    assert list(plan.sweep_lr["quatro"]) == [1.0, 2.0, 4.0, 16.0]
    assert list(plan.sweep_lr["gspo"]) == [1.0, 2.0]                 # x2 broke: x4 and x16 never run
    assert list(plan.sweep_inner["gspo"]) == [1, 2, 4] and list(plan.sweep_inner["quatro"]) == [1, 2, 4]
    assert not any(spec.setting.algorithm == "gspo" and spec.setting.lr_multiplier > 2 for spec in plan.runs.values())
    assert len(whole.runs) - len(plan.runs) == 2 * len(cfg.sweeps.seeds)
    assert set(build_plan(cfg, study_dir, unknown_holds=True).runs) == set(plan.runs)   # all decided
    # a run is judged at the claims' top-p, from its kept metrics
    reward_of = finished_rewards(cfg, study_dir)
    spec = plan.runs_of(plan.sweep_lr["gspo"][2.0], [1])[0]
    assert reward_of(spec) == pytest.approx(0.301)


def test_sweep_claims_compare_on_the_points_both_methods_ran(tmp_path):
    cfg, _ = searched_study()
    study_dir = str(tmp_path)
    plan = run_search(study_dir, cfg)
    claims = claims_by_id(load(study_dir, cfg, plan))
    (lr,) = claims["stability_lr"].comparisons
    # GSPO ran lr x2 only: loss 0.6 - 0.3 = 0.3 against QUATRO's 0.6 - 0.58 = 0.02 at x2 (seed noise cancels)
    assert lr.detail["points"] == "2"
    assert lr.detail["baseline_loss"] == pytest.approx(0.3, abs=1e-3)
    assert lr.detail["quatro_loss"] == pytest.approx(0.02, abs=1e-3)
    # QUATRO's own summary averages over all of its points: (0.02 + 0.03 + 0.05) / 3
    assert "+0.0333" in claims["stability_lr"].summary
    (inner,) = claims["stability_inner_loops"].comparisons
    assert "points" not in inner.detail                      # both ran K = 2 and 4: the whole axis
    assert inner.detail["baseline_loss"] == pytest.approx((0.03 + 0.4) / 2, abs=1e-3)
