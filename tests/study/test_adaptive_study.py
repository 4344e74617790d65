"""The adaptive-delta study (issue 19, quatro_nemo/study/adaptive.py) without training: its run
list against one written out here, every run's overrides composing into the intended config,
config errors naming the key, and the claims and report on synthetic kept metrics with planted
effects (written as the study writes them, so report_only=true reads them)."""
import os

import numpy as np
import pytest

from quatro_nemo.engine.config import load_config
from quatro_nemo.algos.config import DeltaControllerConfig, DeltaPerQueryConfig
from quatro_nemo.study.config import DEFAULT_CONDITION
from quatro_nemo.study.analysis import EVAL_KIND
from quatro_nemo.study.kept import archive_path, write_archive
from quatro_nemo.study.config import StudyConfigError, load_study_config, study_config_from_dict
from quatro_nemo.study.driver import write_report
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.plan import train_args
from quatro_nemo.study.stats import INCONCLUSIVE, NOT_REPRODUCED, NOT_TESTED, REPRODUCED, paired_power, seeds_for_power


def small(**adaptive):
    values = dict(tasks=["binary", "graded"], fixed_deltas=[0.05, 0.1, 0.2],
                  strategies={"controller": {"delta_controller": {"kind": "kl"}},
                              "variance": {"delta_per_query": {"kind": "reward_variance"}}},
                  stress={"lr4": {"lr_multiplier": 4}}, seeds=[1, 2, 3])
    values.update(adaptive)
    return study_config_from_dict({"kind": "adaptive", "adaptive": values, "train_overrides": ["trainer.steps=4"],
                                   "evaluation": {"num_problems": 8, "n_samples": 16, "top_p": [0.7],
                                                  "sweep_n_samples": 8}})


def test_the_committed_config_plans_every_arm_once_and_each_composes():
    cfg = load_study_config("adaptive")
    plan = build_plan(cfg)
    default = load_config(train_args(cfg))
    conditions = {DEFAULT_CONDITION: (default.trainer.inner_loops, 1.0), "lr4": (1, 4.0), "K4": (4, 1.0)}
    arms = {f"delta={d:g}": {"delta": d} for d in (0.02, 0.05, 0.1, 0.2)}
    arms["controller"] = {"delta_controller": DeltaControllerConfig(kind="kl", target=0.015)}
    arms["variance"] = {"delta_per_query": DeltaPerQueryConfig(kind="reward_variance")}
    expected = {(task, k, m, arm, seed) for task in ("binary", "graded") for k, m in conditions.values()
                for arm in arms for seed in (1, 2, 3)}
    assert len(plan.runs) == len(expected) == 108
    # The seeds of one setting differ in run.seed alone: each setting is composed once (a Hydra
    # composition is ~0.9 CPU-s) and its seeds are read from the run.seed override.
    seed_override = "run.seed={}".format
    settings = {}
    for spec in plan.runs.values():
        assert seed_override(spec.seed) in spec.overrides, spec.overrides
        setting = tuple(o for o in spec.overrides if o != seed_override(spec.seed))
        settings.setdefault(setting, []).append(spec)
    assert len(settings) == len(expected) // 3
    seen = set()
    for setting, specs in settings.items():
        composed = load_config(train_args(cfg) + list(specs[0].overrides))
        assert composed.run.seed == specs[0].seed
        algo = composed.algorithm
        arm = next(a for a, fields in arms.items() if all(getattr(algo, f) == v for f, v in fields.items())
                   and (a.startswith("delta=") == (not algo.adaptive_delta)))
        seen.update((composed.task.reward, composed.trainer.inner_loops,
                     composed.trainer.lr / default.trainer.lr, arm, spec.seed) for spec in specs)
        assert composed.trainer.steps == 60
        full_evaluation = (composed.trainer.lr == default.trainer.lr
                           and composed.trainer.inner_loops == default.trainer.inner_loops)
        assert all(plan.needs_full_evaluation(spec) == full_evaluation for spec in specs)
    assert seen == expected


def test_the_successor_asks_again_on_the_kl_adaptive_lr_with_seeds_for_power():
    """conf/study/adaptive_lr.yaml: the same arms, each with lr_control.kind=kl_adaptive, and seeds from
    stats.seeds_for_power for the largest Holm family (stable_: task x stress x fixed delta)."""
    cfg = load_study_config("adaptive_lr")
    ad = cfg.adaptive
    assert ad.fixed_deltas == [0.02, 0.05, 0.1, 0.2] and set(ad.strategies) == {"controller", "variance"}
    stable_family = len(ad.tasks) * len(ad.stress) * len(ad.fixed_deltas)      # 16
    frontier_family = len(ad.tasks) * 2                                        # pass@1 and pass@kmax per task
    assert len(ad.seeds) == seeds_for_power(2.0, stable_family, 0.05, 0.8) == 8
    assert paired_power(2.0, len(ad.seeds), stable_family) >= 0.8 and paired_power(2.0, len(ad.seeds), frontier_family) >= 0.8
    plan = build_plan(cfg)
    assert len(plan.runs) == len(ad.tasks) * (1 + len(ad.stress)) * (len(ad.fixed_deltas) + len(ad.strategies)) * 8
    for spec in list(plan.runs.values())[::23]:       # a spread of the 288 runs, each composed
        algo = load_config(train_args(cfg) + list(spec.overrides)).algorithm
        assert algo.lr_control.kind == "kl_adaptive", spec.name


@pytest.mark.parametrize("adaptive, key", [
    ({"tasks": ["binary", "exact"]}, "adaptive.tasks"),
    ({"fixed_deltas": [0.1]}, "adaptive.fixed_deltas"),
    ({"strategies": {"bad": {"delta_controler": {"kind": "kl"}}}}, "adaptive.strategies.bad"),
    ({"strategies": {"bad": {"delta_controller": {"kind": "pid"}}}}, "adaptive.strategies.bad: QuatroConfig.delta_controller.kind"),
    ({"strategies": {"old": {"delta_controller": "kl"}}},
     "algorithm.delta_controller is now algorithm.delta_controller.kind"),
    ({"strategies": {"fixed": {"delta": 0.3}}}, "adaptive.strategies.fixed"),
    ({"stress": {"hot": {"lr": 4}}}, "adaptive.stress.hot"),
    ({"stress": {"many": {"inner_loops": 0}}}, "adaptive.stress.many.inner_loops"),
    ({"seeds": []}, "adaptive.seeds"),
    ({"nonsense": 1}, "adaptive.nonsense"),
    ({"common": {"delta": 0.3}}, "adaptive.common"),                    # the arms differ by their radius
    ({"common": {"lr_controll": {"kind": "kl_adaptive"}}}, "adaptive.common"),
    ({"common": {"lr_control": {"kind": "sometimes"}}}, "adaptive.common: QuatroConfig.lr_control.kind"),
    ({"common": {"lr_control_factor": 2}}, "adaptive.common.lr_control_factor is now adaptive.common.lr_control.factor"),
])
def test_bad_adaptive_section_names_the_key(adaptive, key):
    with pytest.raises(StudyConfigError, match=key.replace(".", r"\.")):
        small(**adaptive)


def test_kind_and_section_go_together():
    with pytest.raises(StudyConfigError, match="kind: adaptive"):
        study_config_from_dict({"adaptive": {}})
    with pytest.raises(StudyConfigError, match="kind"):
        study_config_from_dict({"kind": "sweep"})


# --------------------------------------------------------------------------------------------
# Claims on planted effects
# --------------------------------------------------------------------------------------------

# Held-out numbers per (condition, arm), the same for both tasks; noise sd 0.002 per seed.
PLANTED = {
    # default condition: the fixed sweep trades pass@1 for pass@16
    (DEFAULT_CONDITION, "delta=0.05"): dict(reward=0.50, p1=0.35, pk=0.80),
    (DEFAULT_CONDITION, "delta=0.1"): dict(reward=0.50, p1=0.40, pk=0.75),
    (DEFAULT_CONDITION, "delta=0.2"): dict(reward=0.50, p1=0.42, pk=0.70),
    (DEFAULT_CONDITION, "controller"): dict(reward=0.50, p1=0.30, pk=0.60),   # below the frontier
    (DEFAULT_CONDITION, "variance"): dict(reward=0.50, p1=0.47, pk=0.85),     # beyond the best fixed
    # lr x4: the two larger fixed deltas break (0.2 < 0.9 x 0.5), 0.05 holds
    ("lr4", "delta=0.05"): dict(reward=0.48, p1=0.3, pk=0.7),
    ("lr4", "delta=0.1"): dict(reward=0.20, p1=0.1, pk=0.3),
    ("lr4", "delta=0.2"): dict(reward=0.15, p1=0.1, pk=0.3),
    ("lr4", "controller"): dict(reward=0.49, p1=0.3, pk=0.7),                 # stable
    ("lr4", "variance"): dict(reward=0.05, p1=0.1, pk=0.3),                   # breaks worse
}


def plant(study_dir, plan, table=PLANTED):
    rng = np.random.default_rng(0)
    ad = plan.adaptive
    for (task, condition, arm), setting in ad.settings.items():
        values = table[(condition, arm)]
        for spec in plan.runs_of(setting, ad.seeds):
            noise = lambda: float(rng.normal(0, 0.002))  # noqa: E731
            train = [{"kind": "train", "step": s, "reward/mean": 0.3, "entropy": 0.5,
                      **({"quatro/delta/mean": 0.1 / s} if arm in ad.strategies else {})} for s in (1, 2, 3, 4)]
            evaluation = {"kind": EVAL_KIND, "top_p": 0.7, "n_samples": 16, "num_problems": 8,
                          "reward/mean": values["reward"] + noise(), "pass@1": values["p1"] + noise(),
                          "pass@16": values["pk"] + noise(), "ucc@16": 2 * values["pk"] + noise(),
                          "entropy": 0.4 + noise()}
            write_archive(archive_path(study_dir, spec.name), train + [evaluation])
    write_archive(archive_path(study_dir, "base"), [{"kind": EVAL_KIND, "top_p": 0.7, "pass@1": 0.3, "pass@16": 0.8,
                                                      "ucc@16": 1.7}])


def test_claims_and_report_on_planted_effects(tmp_path):
    cfg = small()
    plan = build_plan(cfg)
    plant(str(tmp_path), plan)
    result = write_report(cfg, plan, str(tmp_path), str(tmp_path), {})
    verdicts = {c.id: c.verdict for c in result["claims"]}
    assert verdicts == {"frontier_controller": NOT_REPRODUCED, "frontier_variance": REPRODUCED,
                        "stable_controller": REPRODUCED, "stable_variance": NOT_REPRODUCED}
    frontier = next(c for c in result["claims"] if c.id == "frontier_variance")
    # per task: pass@1 against the best fixed delta by pass@1 (0.2), pass@16 against the best by pass@16 (0.05)
    labels = sorted(c.label for c in frontier.comparisons)
    assert labels == sorted(f"{t}: {m} - best fixed (delta={d})" for t in ("binary", "graded")
                            for m, d in (("pass@1", "0.2"), ("pass@16", "0.05")))
    assert [c.test.mean for c in frontier.comparisons] == pytest.approx([0.05, 0.05, 0.05, 0.05], abs=0.01)
    stable = next(c for c in result["claims"] if c.id == "stable_controller")
    assert len(stable.comparisons) == 4     # 2 tasks x the 2 broken deltas; 0.05 held
    report = open(result["paths"]["markdown"]).read()
    assert "![frontier](frontier.png)" in report and "BREAKS" in report
    # the power table: families of 4 at 3 seeds (Holm's first step at 0.05 / 4: power 0.15; 7 seeds for 0.8)
    assert "| frontier_variance | 4 | 3 | 0.15 | 7 | - |" in report and "| stable_controller | 4 | 3 | 0.15 | 7 | - |" in report
    assert os.path.isfile(tmp_path / "frontier.png") and os.path.isfile(tmp_path / "radius.png")
    again = write_report(cfg, plan, str(tmp_path), str(tmp_path / "again"), {})
    assert open(again["paths"]["markdown"]).read() == report      # report_only=true gives the same report


def test_a_stopped_adaptive_study_is_not_run_where_seeds_are_missing(tmp_path):
    cfg = small()
    plan = build_plan(cfg)
    plant(str(tmp_path), plan)
    setting = plan.adaptive.settings[("graded", "lr4", "delta=0.1")]       # a stress run of seed 3 missing
    os.remove(archive_path(str(tmp_path), plan.runs_of(setting, [3])[0].name))
    verdicts = {c.id: c.verdict for c in write_report(cfg, plan, str(tmp_path), str(tmp_path), {})["claims"]}
    assert verdicts == {"frontier_controller": NOT_REPRODUCED, "frontier_variance": REPRODUCED,   # default runs complete
                        "stable_controller": "NOT RUN (2 of 3 seeds)", "stable_variance": "NOT RUN (2 of 3 seeds)"}


def test_no_broken_fixed_delta_leaves_stability_untested(tmp_path):
    cfg = small(stress={"lr4": {"lr_multiplier": 4}}, strategies={"controller": {"delta_controller": {"kind": "kl"}}})
    plan = build_plan(cfg)
    plant(str(tmp_path), plan, {key: dict(values, reward=0.5) if key[0] == "lr4" else values
                                for key, values in PLANTED.items()})
    claims = {c.id: c for c in write_report(cfg, plan, str(tmp_path), str(tmp_path), {})["claims"]}
    assert claims["stable_controller"].verdict == NOT_TESTED
    assert "no fixed delta broke" in claims["stable_controller"].note
    assert claims["frontier_controller"].verdict in (NOT_REPRODUCED, INCONCLUSIVE)


def test_wall_time_estimate_costs_the_adaptive_runs(tmp_path):
    from quatro_nemo.study.timing import estimate_minutes

    from .test_timing import made_up_timed_study

    made_up_timed_study(tmp_path)
    estimate = estimate_minutes(load_study_config("adaptive"), str(tmp_path))
    # 108 runs of 60 steps at 1 s + 4.5 s overhead; evaluations at 2 + 0.05 s per sample: the 36
    # default-condition runs 64 x 64 samples (one top-p), the 72 stress runs 64 x 32; the base model alone
    runs = 108 * (4.5 + 60 * 1.0 + 2.0) + 36 * 0.05 * 4096 + 72 * 0.05 * 2048
    base = 2.0 + 0.05 * 4096
    assert estimate["runs"] == 108
    assert estimate["estimated_minutes"] == pytest.approx((runs / 2 + base) / 60, abs=0.05)
