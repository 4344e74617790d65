"""Issue 29's pre-registered design: conf/study/design.yaml (families, stress points with every
baseline, 128 problems, checkpoints), the claims at fixed stress points and at matched levels,
primary / secondary Holm families and the EQUIVALENT path (run identities: tests/engine/test_api.py)."""
import dataclasses
import math

import numpy as np
import pytest

from quatro_nemo.study.analysis import (RunData, Study, advantage_table, checkpoint_curve, claim_at_stress_point, claim_matched,
                                        evaluate_claims, matched_difference)
from quatro_nemo.study.config import StudyConfigError, load_study_config, study_config_from_dict
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.plan import train_args
from quatro_nemo.study.stats import EQUIVALENT, INCONCLUSIVE, REPRODUCED, holm_adjust, paired_power

TOP_P = 0.7
BASELINES = ["grpo", "gspo", "gpg", "gmpo", "dapo", "cispo"]


def test_design_config_states_every_claim_before_any_run():
    cfg = load_study_config("design")
    assert cfg.primary_baselines == ["grpo", "gspo"] and len(cfg.seeds) >= 16
    assert cfg.decision_top_p == 0.7 and set(cfg.evaluation.top_p) == {0.7, 1.0}
    assert cfg.evaluation.num_problems == 128
    assert set(cfg.stress.algorithms) == {"quatro", *BASELINES} and len(cfg.stress.seeds) >= 8
    assert {tuple(p.items()) for p in cfg.stress.points.values()} == {(("inner_loops", 8),), (("lr_multiplier", 4),)}
    assert cfg.stress.arms == {"quatro_kl_lr": {"lr_control": {"kind": "kl_adaptive"}}}
    assert cfg.equivalence_margins["passk_at_kmax"] == 0.03
    # the seeds give power >= 0.8 against a 2-sd effect in every family (Holm's first step)
    assert paired_power(2.0, len(cfg.seeds), 4) >= 0.8                       # secondary family
    assert paired_power(2.0, len(cfg.stress.seeds), 6 + 7) >= 0.8            # a stress point's family
    assert paired_power(2.0, len(cfg.ablation.seeds), 2) >= 0.8
    assert paired_power(2.0, len(cfg.deltas.seeds), len(cfg.deltas.values) - 1) >= 0.8


def test_a_stress_arm_is_checked_against_quatros_config_naming_the_arm():
    cfg = load_study_config("design")
    for fields, named in (({"lr_control": "kl_adaptive"}, "algorithm.lr_control is now algorithm.lr_control.kind"),
                          ({"lr_control": {"kin": "kl_adaptive"}}, "algorithm.lr_control.kin is not a field")):
        cfg.stress.arms = {"quatro_kl_lr": fields}
        with pytest.raises(StudyConfigError, match=rf"^stress\.arms\.quatro_kl_lr: {named}"):
            build_plan(cfg)


def test_the_kl_adaptive_arm_is_planned_at_each_stress_point():
    cfg = load_study_config("design")
    arm_runs = 2 * len(cfg.stress.seeds)
    plan = build_plan(cfg)
    arm = plan.stress["lr4"]["quatro_kl_lr"]
    assert arm.algo_overrides == (("lr_control.kind", "kl_adaptive"),)
    assert plan.runs_of(arm, cfg.stress.seeds)[0].name == "quatro-K1-lr4x-lr_control_kl_adaptive-s1"
    main = 7 * len(cfg.seeds)
    stress = 2 * 7 * len(cfg.stress.seeds) + arm_runs
    ablation = 2 * len(cfg.ablation.seeds)
    deltas = (len(cfg.deltas.values) - 1) * len(cfg.deltas.seeds)            # delta 0.1 is QUATRO's default run
    assert len(plan.runs) == main + stress + ablation + deltas
    for point, inner, lr in (("K8", 8, 1.0), ("lr4", 1, 4.0)):
        settings = plan.stress[point]
        assert set(settings) >= {"quatro", *BASELINES}
        assert all((s.inner_loops, s.lr_multiplier) == (inner, lr) for s in settings.values())
        assert all(len(plan.runs_of(s, cfg.stress.seeds)) == len(cfg.stress.seeds) for s in settings.values())
    args = train_args(cfg)
    for override in ("eval.num_problems=128", "eval.n_samples=32", "eval.top_p=0.7", "trainer.eval_every=20"):
        assert override in args
    # a study without checkpoints composes its runs as before (the committed studies' identities)
    assert train_args(load_study_config("full"))[-1] == "eval.num_problems=0"


@pytest.mark.parametrize("bad,key", [
    (dict(claim_top_p=0.5), "claim_top_p"),
    (dict(primary_baselines=["quatro"]), "primary_baselines"),
    (dict(primary_baselines=["grpo", "grpo"]), "primary_baselines"),
    (dict(equivalence_margins={"passk_at_kmax": 0}), "equivalence_margins.passk_at_kmax"),
    (dict(stress=dict(points={"K8": {"inner_loops": 8}}, algorithms=["grpo", "gspo"], seeds=[1, 2])), "stress.algorithms"),
    (dict(stress=dict(points={"K8": {"K": 8}}, algorithms=["quatro", "grpo"], seeds=[1, 2])), "stress.points.K8"),
    (dict(stress=dict(points={"K8": {"inner_loops": 8}}, algorithms=["quatro", "grpo"], seeds=[1, 2],
                      arms={"grpo": {"delta": 0.05}})), "stress.arms.grpo"),
    (dict(checkpoints=dict(every=-1)), "checkpoints.every"),
    (dict(power_target=1.0), "power_target"),
])
def test_bad_preregistration_names_the_key(bad, key):
    with pytest.raises(StudyConfigError, match=key.replace(".", r"\.")):
        study_config_from_dict(dict(algorithms=["quatro", "grpo"], seeds=[1, 2], evaluation=dict(top_p=[0.7, 1.0]),
                                    **bad))


# --------------------------------------------------------------------------------------------
# Claims on in-memory runs
# --------------------------------------------------------------------------------------------

SEEDS = list(range(1, 9))


@pytest.fixture(scope="module")
def design():
    cfg = study_config_from_dict(dict(
        name="simulated", algorithms=["quatro", *BASELINES], seeds=SEEDS, primary_baselines=["grpo", "gspo"],
        equivalence_margins={"passk_at_kmax": 0.03, "stress_K8": 0.03},
        stress=dict(points={"K8": {"inner_loops": 8}}, algorithms=["quatro", *BASELINES], seeds=SEEDS,
                    arms={"tight": {"delta": 0.05}}),      # an arm with a field QUATRO has today
        checkpoints=dict(every=20, n_samples=32),
        sweeps=dict(algorithms=["quatro"], inner_loops=[1], lr_multipliers=[1], seeds=[1]),
        ablation=dict(seeds=[1, 2]), deltas=dict(values=[0.05, 0.2], seeds=[1, 2]),
        evaluation=dict(top_p=[TOP_P, 1.0], n_samples=8, sweep_n_samples=4)))
    return cfg, build_plan(cfg)


def study_of(cfg, plan, value, checkpoints=lambda spec: []):
    """Every run's final pass@8 and reward = value(spec), with the given held-out checkpoints."""
    runs = {}
    for name, spec in plan.runs.items():
        v = value(spec)
        record = {"pass@1": v, "pass@8": v, "reward/mean": v, "ucc@8": v, "entropy": v}
        train, evals = checkpoints(spec) or ([], [])
        runs[name] = RunData(name, {TOP_P: record, 1.0: record}, train, evals)
    return Study(cfg, plan, runs)


def test_primary_and_secondary_families_are_holm_corrected_apart(design):
    cfg, plan = design
    rng = np.random.default_rng(2)
    noise = {(n, s): rng.normal(0, 0.02) for n in plan.runs for s in SEEDS}
    study = study_of(cfg, plan, lambda spec: 0.5 + (0.01 if spec.setting.algorithm == "quatro" else 0.0)
                     + noise[(spec.name, spec.seed)])
    advantages = advantage_table([0.05, 0.2], 8, plan.defaults.algorithm_fields["quatro"]["lambda_min"])
    claims = {c.id: c for c in evaluate_claims(study, advantages)}
    primary, secondary = claims["passk_at_kmax"], claims["passk_at_kmax_secondary"]
    assert [c.label for c in primary.comparisons] == ["grpo", "gspo"]
    assert [c.label for c in secondary.comparisons] == ["gpg", "gmpo", "dapo", "cispo"]
    for claim in (primary, secondary):
        raw = [c.test.p_value for c in claim.comparisons]
        assert [c.p_adjusted for c in claim.comparisons] == pytest.approx(holm_adjust(raw))
        assert len(raw) in (2, 4)
    assert primary.margin == 0.03 and secondary.margin is None
    assert "stress_K8" in claims and "ucc_matched_reward" in claims and "ucc_matched_kl_secondary" in claims


def test_stress_point_compares_at_that_point_with_every_baseline_and_the_arm(design):
    cfg, plan = design
    rng = np.random.default_rng(4)

    def value(spec):   # at K = 8 QUATRO and its arm hold 0.5, every baseline breaks to 0.3
        v = 0.5 if spec.setting.algorithm == "quatro" else 0.3
        return v + rng.normal(0, 0.01) if spec.setting.inner_loops == 8 else 0.5 + rng.normal(0, 0.01)

    claim = claim_at_stress_point(study_of(cfg, plan, value), "K8")
    labels = [c.label for c in claim.comparisons]
    assert labels == [f"quatro - {b}" for b in BASELINES] + [f"tight - {b}" for b in BASELINES] + ["tight - quatro"]
    for c in claim.comparisons[:12]:
        assert c.test.mean == pytest.approx(0.2, abs=0.02) and c.outcome == "supports"
    # the arm and QUATRO are equal within the 0.03 margin: that comparison is equivalent, the claim PARTLY
    assert claim.comparisons[-1].outcome == "equivalent" and claim.verdict == "PARTLY"

    # no difference anywhere at the point: EQUIVALENT by TOST, where a difference test says only INCONCLUSIVE
    rng = np.random.default_rng(4)
    flat = study_of(cfg, plan, lambda spec: 0.5 + rng.normal(0, 0.01))
    assert claim_at_stress_point(flat, "K8").verdict == EQUIVALENT
    rng = np.random.default_rng(4)     # the same data without a stated margin
    loose = study_of(dataclasses.replace(cfg, equivalence_margins={}), plan, lambda spec: 0.5 + rng.normal(0, 0.01))
    assert claim_at_stress_point(loose, "K8").verdict == INCONCLUSIVE


def test_matched_difference_by_hand():
    # mine reaches reward 0.6, the other 0.5: matched at 0.5. mine at 0.5: halfway from (0.4, 2) to
    # (0.6, 1) = 1.5; the other at 0.5: its last point, 1.2. Difference 0.3.
    mine, other = [(0.4, 2.0), (0.6, 1.0)], [(0.2, 2.0), (0.5, 1.2)]
    assert matched_difference(mine, other) == pytest.approx(0.3)
    assert matched_difference([(0.7, 1.0), (0.8, 1.0)], other) is None        # no common level
    assert matched_difference([(0.4, 2.0)], other) is None


def test_matched_comparison_differs_from_equal_steps(design):
    # QUATRO learns slower: at equal steps its diversity is higher only because it moved less.
    # Diversity falls along the same line in rollout reward for every method (ucc = 3 - 2 r), so at
    # matched reward there is no difference, and the matched claim must not call it one.
    cfg, plan = design
    rng = np.random.default_rng(8)

    def checkpoints(spec):
        speed = 0.5 if spec.setting.algorithm == "quatro" else 1.0
        train, evals = [], [{"kind": "eval", "step": 0, "ucc@32": 3.0}]
        for step in range(1, 81):
            reward = 0.2 + 0.4 * speed * step / 80 + rng.normal(0, 0.002)
            train.append({"kind": "train", "step": step, "reward/mean": reward, "policy/kl_ref": reward / 10})
            if step % 20 == 0:
                window = np.mean([r["reward/mean"] for r in train[-5:]])
                evals.append({"kind": "eval", "step": step, "ucc@32": 3.0 - 2.0 * window + rng.normal(0, 0.001)})
        return train, evals

    study = study_of(cfg, plan, lambda spec: 0.5, checkpoints)
    run = study.runs[plan.runs_of(plan.compare["grpo"], [1])[0].name]
    curve = checkpoint_curve(run, "reward/mean", "ucc@32")
    assert [round(x, 2) for x, _ in curve] == pytest.approx([0.3, 0.4, 0.5, 0.6], abs=0.02)  # step 0 left out
    matched = claim_matched(study, "m", "reward/mean", "rollout reward", "ucc@32", ["grpo"])
    assert abs(matched.comparisons[0].test.mean) < 0.01
    final = [e for e in run.checkpoints if e["step"] == 80][0]["ucc@32"]
    quatro = study.runs[plan.runs_of(plan.compare["quatro"], [1])[0].name]
    assert [e for e in quatro.checkpoints if e["step"] == 80][0]["ucc@32"] - final > 0.3   # equal steps: a gap
