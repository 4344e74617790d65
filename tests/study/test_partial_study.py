"""Issue 29: a study stopped part-way. The runs start seed-major by claim priority (primary family,
secondary family, stress points, the rest), so every method of a family has the same seeds at
any stop; the report of a partial study (report_only on kept metrics) says which claims the runs
present decide and which are NOT RUN (n of N seeds), never deciding on fewer seeds than designed.
And the report's trust-region table (achieved KL against delta) on hand-made per-step metrics."""
import json
import math
import os

import pytest

from quatro_nemo.study.analysis import load_runs, trust_region_rows
from quatro_nemo.study.kept import archive_path
from quatro_nemo.study.config import study_config_from_dict
from quatro_nemo.study.driver import start_order, write_report
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.stats import REPRODUCED

from .test_claims import fill, load, quatro_wins_final, quatro_wins_train

SEEDS = [1, 2, 3]


def design(**extra):
    """A pre-registered design in small: primary QUATRO vs {GRPO, GSPO}, secondary {GPG}, a K = 4
    stress point with a QUATRO arm, a delta sweep and the log-ratio ablation."""
    values = dict(name="partial", algorithms=["quatro", "grpo", "gspo", "gpg"], seeds=SEEDS,
                  primary_baselines=["grpo", "gspo"],
                  stress=dict(points={"K4": {"inner_loops": 4}}, algorithms=["quatro", "grpo"], seeds=[1, 2],
                              arms={"tight": {"delta": 0.05}}),
                  sweeps=dict(algorithms=["quatro"], inner_loops=[1], lr_multipliers=[1], seeds=[1]),
                  ablation=dict(delta=0.1, inner_loops=2, log_ratios=["seq_sum", "none"], seeds=[1, 2]),
                  deltas=dict(values=[0.02, 0.1], seeds=[1, 2]),
                  evaluation=dict(num_problems=4, n_samples=16, top_p=[0.7, 1.0], sweep_n_samples=8))
    values.update(extra)
    cfg = study_config_from_dict(values)
    return cfg, build_plan(cfg)


def test_runs_start_seed_major_by_claim_priority():
    cfg, plan = design()
    order = [spec.name for spec in start_order(cfg, plan)]
    assert sorted(order) == sorted(plan.runs)             # every run once
    primary = [f"{a}-K1-lr1x-s{s}" for s in SEEDS for a in ("quatro", "grpo", "gspo")]
    secondary = [f"gpg-K1-lr1x-s{s}" for s in SEEDS]
    stress = [f"{m}-s{s}" for s in (1, 2) for m in ("quatro-K4-lr1x", "grpo-K4-lr1x", "quatro-K4-lr1x-delta_0.05")]
    assert order[:9] == primary
    assert order[9:12] == secondary
    assert order[12:18] == stress
    rest = order[18:]   # the ablation and the deltas, seed 1 before seed 2, heavier (K = 2) first in a seed
    assert [name.rsplit("-s", 1)[1] for name in rest] == sorted(name.rsplit("-s", 1)[1] for name in rest)
    assert rest[0].startswith("quatro-K2-")
    # stopped after any run of the primary family, its methods differ by at most the seed in progress
    for stop in range(1, 10):
        seeds = {a: {n.rsplit("-s", 1)[1] for n in order[:stop] if n.startswith(f"{a}-K1-lr1x-s")}
                 for a in ("quatro", "grpo", "gspo")}
        assert max(map(len, seeds.values())) - min(map(len, seeds.values())) <= 1
        if stop % 3 == 0:
            assert len({frozenset(s) for s in seeds.values()}) == 1


def test_without_a_primary_family_every_compared_method_comes_first():
    cfg, plan = design(primary_baselines=[])
    order = [spec.name for spec in start_order(cfg, plan)]
    assert order[:12] == [f"{a}-K1-lr1x-s{s}" for s in SEEDS for a in ("quatro", "grpo", "gspo", "gpg")]


@pytest.fixture
def stopped(tmp_path):
    """The design stopped after 16 runs in start order: the primary family complete (9), the
    secondary family at 3 of 3 seeds (3), the stress point at seed 1 only (3 of its 6), one
    ablation run. Metrics of a QUATRO that wins everywhere (test_claims)."""
    cfg, plan = design()
    finished = start_order(cfg, plan)[:16]
    fill(str(tmp_path), plan, quatro_wins_final, quatro_wins_train)      # every run, then lose the rest
    for name in set(plan.runs) - {spec.name for spec in finished}:
        os.remove(archive_path(str(tmp_path), name))
    assert set(load_runs(str(tmp_path), list(plan.runs))) == {spec.name for spec in finished}
    return cfg, plan, tmp_path


def test_a_stopped_study_decides_the_complete_claims_and_marks_the_rest_not_run(stopped):
    cfg, plan, directory = stopped
    out = write_report(cfg, plan, str(directory), str(directory), {})
    claims = {c.id: c for c in out["claims"]}
    for claim_id in ("passk_at_kmax", "passk_at_kmax_secondary", "entropy_final", "ucc_at_kmax_secondary"):
        assert claims[claim_id].verdict == REPRODUCED, claim_id
    assert claims["stress_K4"].verdict == "NOT RUN (1 of 2 seeds)"
    assert claims["logratio_ablation"].verdict == "NOT RUN (0 of 2 seeds)"   # one arm of seed 1 only
    assert claims["lambda_vs_delta"].verdict == "NOT RUN (0 of 2 seeds)"
    for claim_id in ("stress_K4", "logratio_ablation", "lambda_vs_delta"):
        assert claims[claim_id].comparisons == []             # nothing decided, no Holm over fewer seeds
    # quatro - grpo, tight - grpo, tight - quatro: a family of 3 at the design's 2 seeds
    assert claims["stress_K4"].family_size == 3 and claims["stress_K4"].design_seeds == 2
    text = (directory / "report.md").read_text()
    assert "| stress_K4 |" in text and "**NOT RUN (1 of 2 seeds)**" in text
    partial = next(line for line in text.splitlines() if line.startswith("**Partial study.**"))
    assert "passk_at_kmax," in partial and "stress_K4 (1 of 2 seeds)" in partial
    # the one-point sweeps have nothing to test: named apart, not as decided
    assert partial.endswith("NOT TESTED (nothing to test in this design): stability_inner_loops, stability_lr.")
    # the power table lists a NOT RUN claim at its design: family 3, 2 seeds
    assert any(line.startswith("| stress_K4 | 3 | 2 |") for line in text.splitlines())
    summary = json.loads((directory / "report.json").read_text())
    assert {c["id"]: c["verdict"] for c in summary["claims"]}["stress_K4"] == "NOT RUN (1 of 2 seeds)"


def test_a_claim_short_of_its_design_is_not_decided_on_fewer_seeds(stopped):
    cfg, plan, directory = stopped
    os.remove(archive_path(str(directory), "gspo-K1-lr1x-s3"))          # a hole in the primary family
    out = write_report(cfg, plan, str(directory), str(directory), {})
    claims = {c.id: c for c in out["claims"]}
    assert claims["passk_at_kmax"].verdict == "NOT RUN (2 of 3 seeds)"      # QUATRO vs GRPO alone is not enough
    assert claims["passk_at_kmax_secondary"].verdict == REPRODUCED           # gpg's family is complete


# --------------------------------------------------------------------------------------------
# The trust region where the step is taken
# --------------------------------------------------------------------------------------------

# per seed: the per-step achieved KL, its per-prompt max and the lr multiplier (QUATRO runs)
ACHIEVED = {1: [0.001, 0.003, 0.002, None], 2: [0.004, 0.002, 0.006, 0.005]}
PROMPT_MAX = {1: [0.002, 0.009, 0.004, None], 2: [0.01, 0.003, 0.02, 0.012]}


def trust_region_train(spec):
    rows = quatro_wins_train(spec)
    if spec.setting.algorithm != "quatro" or spec.seed not in ACHIEVED:   # seed 3: main comparison only
        return rows
    overrides = dict(spec.setting.algo_overrides)
    delta = overrides.get("delta", 0.1)
    adaptive = overrides.get("lr_control.kind") == "kl_adaptive"
    for t, row in enumerate(rows):
        kl = ACHIEVED[spec.seed][t]
        if kl is not None:                  # a step whose groups were all constant logs none
            row.update({"trust_region/achieved_kl": kl, "trust_region/achieved_kl_max": PROMPT_MAX[spec.seed][t],
                        "trust_region/achieved_over_delta": kl / delta})
        if adaptive:
            row["trust_region/lr_multiplier"] = 1.5 ** t
    return rows


def test_trust_region_table_against_hand_computed_values(tmp_path):
    cfg, plan = design(stress=dict(points={"K4": {"inner_loops": 4}}, algorithms=["quatro", "grpo"], seeds=[1, 2],
                                   arms={"kl_lr": {"lr_control": {"kind": "kl_adaptive"}}}))
    fill(str(tmp_path), plan, quatro_wins_final, trust_region_train)
    rows = {(r.part, r.label): r for r in trust_region_rows(load(str(tmp_path), cfg, plan))}
    assert list(rows) == [("deltas", "delta=0.02"), ("deltas", "delta=0.1"), ("K4", "quatro"), ("K4", "kl_lr")]
    # seed 1: steps 0.001, 0.003, 0.002 -> median 0.002, max 0.003; seed 2: median 0.0045, max 0.006
    # (the +-5e-5 run jitter of test_claims.write_run on top)
    row = rows[("deltas", "delta=0.02")]
    assert row.delta == 0.02 and row.runs == 2
    stats = row.stats
    assert stats["median achieved KL"].mean == pytest.approx((0.002 + 0.0045) / 2, abs=1e-4)
    assert stats["median achieved KL"].std == pytest.approx(abs(0.0045 - 0.002) / math.sqrt(2), abs=1e-4)
    assert stats["max achieved KL"].mean == pytest.approx((0.003 + 0.006) / 2, abs=1e-4)
    assert stats["max per-prompt KL"].mean == pytest.approx((0.009 + 0.02) / 2, abs=1e-4)
    # achieved / delta at delta 0.02: medians 0.1 and 0.225, maxima 0.15 and 0.3
    assert stats["median achieved / delta"].mean == pytest.approx((0.1 + 0.225) / 2, abs=5e-3)
    assert stats["max achieved / delta"].mean == pytest.approx((0.15 + 0.3) / 2, abs=5e-3)
    assert rows[("deltas", "delta=0.1")].stats["max achieved / delta"].mean == pytest.approx(0.045, abs=1e-3)
    assert stats["median lr multiplier"] is None                             # fixed lr logs none
    # the arm at the stress point: multipliers 1, 1.5, 2.25, 3.375 -> median (1.5 + 2.25) / 2 per seed
    arm = rows[("K4", "kl_lr")]
    assert arm.delta == 0.1 and arm.stats["median lr multiplier"].mean == pytest.approx(1.875, abs=1e-3)
    out = write_report(cfg, plan, str(tmp_path), str(tmp_path), {})
    text = (tmp_path / "report.md").read_text()
    assert "## The trust region where the step is taken" in text and "![trust region](trust_region.png)" in text
    row = next(line for line in text.splitlines() if line.startswith("| deltas | delta=0.02 | 0.02 | 2 |"))
    mean, std = (float(x) for x in row.split("|")[5].split("±"))
    assert mean == pytest.approx(0.00325, abs=1e-4) and std == pytest.approx(0.0025 / math.sqrt(2), abs=1e-4)
    assert (tmp_path / "trust_region.png").stat().st_size > 1000 and "trust_region" in out["paths"]
    summary = json.loads((tmp_path / "report.json").read_text())
    assert summary["trust_region"][0]["setting"] == "delta=0.02"


def test_runs_without_the_achieved_kl_have_no_trust_region_section(tmp_path):
    cfg, plan = design()
    fill(str(tmp_path), plan, quatro_wins_final, quatro_wins_train)
    assert trust_region_rows(load(str(tmp_path), cfg, plan)) == []
    write_report(cfg, plan, str(tmp_path), str(tmp_path), {})
    assert "trust region where the step" not in (tmp_path / "report.md").read_text()
    assert "trust_region" not in json.loads((tmp_path / "report.json").read_text())
