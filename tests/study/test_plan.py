"""The study's run list: settings shared between parts, overrides from the composed defaults,
config validation naming the key, and the SLURM sweep file as slurm/lib/common.sh reads it."""
import math
import os
import subprocess

import pytest

from quatro_nemo.algos import ALGORITHMS
from quatro_nemo.engine.config import load_config
from quatro_nemo.study.config import StudyConfigError, load_study_config, study_config_from_dict
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.plan import run_config, sweep_lines, train_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(**extra):
    values = dict(algorithms=["quatro", "grpo", "gspo"], seeds=[1, 2],
                  sweeps=dict(algorithms=["quatro", "gspo"], inner_loops=[1, 2, 4], lr_multipliers=[1, 4], seeds=[1]),
                  ablation=dict(delta=0.1, inner_loops=2, log_ratios=["seq_sum", "none"], seeds=[1]),
                  deltas=dict(values=[0.02, 0.1], seeds=[1]))
    values.update(extra)
    return study_config_from_dict(values)


def expected_run_keys(cfg, default_delta, default_k):
    """The distinct (algorithm, K, lr multiplier, non-default QUATRO fields, seed), written out
    independently of plan.py: these are the runs the study must train, each once."""
    keys = set()
    for a in cfg.algorithms:
        keys |= {(a, default_k, 1.0, (), s) for s in cfg.seeds}
    for a in cfg.sweeps.algorithms:
        keys |= {(a, k, 1.0, (), s) for k in cfg.sweeps.inner_loops for s in cfg.sweeps.seeds}
        keys |= {(a, 1, float(m), (), s) for m in cfg.sweeps.lr_multipliers for s in cfg.sweeps.seeds}

    def fields(**f):
        return tuple(sorted((k, v) for k, v in f.items() if not (k == "delta" and v == default_delta)
                            and not (k == "log_ratio" and v == "seq_sum")))

    for g in cfg.ablation.log_ratios:
        keys |= {("quatro", cfg.ablation.inner_loops, 1.0, fields(delta=cfg.ablation.delta, log_ratio=g), s)
                 for s in cfg.ablation.seeds}
    for d in cfg.deltas.values:
        keys |= {("quatro", default_k, 1.0, fields(delta=d), s) for s in cfg.deltas.seeds}
    return keys


def test_each_distinct_run_appears_once_with_its_overrides():
    base = load_config([])
    default_delta = base.algorithm.delta
    cfg = config(ablation=dict(delta=default_delta, inner_loops=2, log_ratios=["seq_sum", "none"], seeds=[1]))
    plan = build_plan(cfg)
    got = {(s.setting.algorithm, s.setting.inner_loops, s.setting.lr_multiplier, s.setting.algo_overrides, s.seed)
           for s in plan.runs.values()}
    assert got == expected_run_keys(cfg, default_delta, base.trainer.inner_loops)
    assert len(plan.runs) == len(got)
    # the ablation's seq_sum arm at the default delta IS the K = 2 point of QUATRO's sweep
    assert plan.ablation["seq_sum"] == plan.sweep_inner["quatro"][2]
    for spec in plan.runs.values():
        ov = dict(o.split("=", 1) for o in spec.overrides)
        assert ov["algorithm"] == spec.setting.algorithm and int(ov["run.seed"]) == spec.seed
        assert int(ov["trainer.inner_loops"]) == spec.setting.inner_loops
        assert float(ov["trainer.lr"]) == pytest.approx(base.trainer.lr * spec.setting.lr_multiplier)
        # every override set composes into a valid training config
    spec = plan.runs[plan.runs_of(plan.ablation["none"], [1])[0].name]
    composed = load_config(list(spec.overrides))
    assert composed.algorithm.log_ratio == "none" and composed.trainer.inner_loops == 2


def test_lr_multipliers_follow_the_training_config_default():
    cfg = config(train_overrides=["trainer.lr=2e-3"])
    plan = build_plan(cfg)
    lrs = {m: dict(o.split("=", 1) for o in plan.runs_of(s, [1])[0].overrides)["trainer.lr"]
           for m, s in plan.sweep_lr["gspo"].items()}
    assert float(lrs[1.0]) == pytest.approx(2e-3) and float(lrs[4.0]) == pytest.approx(8e-3)


def test_sweep_file_is_read_by_the_slurm_library(tmp_path):
    cfg = config(train_overrides=["trainer.steps=3"])
    plan = build_plan(cfg)
    path = tmp_path / "sweep.txt"
    path.write_text("\n".join(sweep_lines(cfg, plan)) + "\n")
    script = f'source "{REPO}/slurm/lib/common.sh"; quatro_sweep_sets "{path}"'
    sets = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.splitlines()
    assert sets == [" ".join(["trainer.steps=3", *spec.overrides]) for spec in plan.runs.values()]
    assert not any("run.dir" in line or "config=" in line.split()[0] for line in sets)


@pytest.mark.parametrize("values, key", [
    (dict(algorithms=["quatro", "ppo"]), "algorithms"),
    (dict(algorithms=["grpo", "gspo"]), "algorithms"),
    (dict(seeds=[]), "seeds"),
    (dict(sweeps=dict(inner_loops=[2, 4])), "sweeps.inner_loops"),
    (dict(sweeps=dict(lr_multipliers=[1, -4])), "sweeps.lr_multipliers"),
    (dict(ablation=dict(log_ratios=["seq_sum"])), "ablation.log_ratios"),
    (dict(deltas=dict(values=[0.1])), "deltas.values"),
    (dict(train_overrides=["run.seed=3"]), "train_overrides[0]"),
    (dict(workers=0), "workers"),
    (dict(alpha=1.5), "alpha"),
    (dict(evaluation=dict(top_p=[0.7, 0.7])), "evaluation.top_p"),
    (dict(evaluation=dict(n_samples=16, sweep_n_samples=32)), "evaluation.sweep_n_samples"),
    (dict(sweeps=dict(tolerance=0.0)), "sweeps.tolerance"),
    (dict(sweeps=dict(inner_lops=[1])), "sweeps.inner_lops"),
    (dict(colour="red"), "colour"),
])
def test_invalid_study_configs_name_the_key(values, key):
    with pytest.raises(StudyConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        study_config_from_dict(values)


@pytest.mark.parametrize("name", ["quick", "full"])
def test_shipped_study_configs_cover_every_algorithm(name):
    cfg = load_study_config(name)
    assert sorted(cfg.algorithms) == sorted(ALGORITHMS)
    # a paired test needs two seeds in every part
    for seeds in (cfg.seeds, cfg.sweeps.seeds, cfg.ablation.seeds, cfg.deltas.seeds):
        assert len(seeds) >= 2
    # trust-region radii on both sides of log(N / (N - 1)), where the region becomes inactive
    n = load_config(cfg.train_overrides).rollout.n
    assert min(cfg.deltas.values) < math.log(n / (n - 1)) < max(cfg.deltas.values)
    assert len(cfg.evaluation.top_p) >= 2 and cfg.evaluation.top_p[0] == 0.7
    plan = build_plan(cfg)   # every run's overrides compose
    if name == "full":       # issue 16
        assert len(cfg.seeds) >= 5 and len(cfg.sweeps.seeds) >= 3 and len(cfg.deltas.seeds) >= 3
        assert sorted(cfg.sweeps.algorithms) == sorted(ALGORITHMS)
        assert cfg.sweeps.inner_loops == [1, 2, 4, 8] and cfg.sweeps.lr_multipliers == [1, 2, 3, 4, 6, 8]
        assert cfg.evaluation.n_samples == 128 and set(cfg.evaluation.top_p) == {0.7, 1.0}
        assert load_config(list(cfg.train_overrides)).trainer.steps >= 80
        assert cfg.time_budget_minutes <= 150
    # the loop's own evaluation is off in every run: the study evaluates (and the base model once),
    # except at the held-out checkpoints of a study that has them (issue 29)
    expected = cfg.evaluation.num_problems if cfg.checkpoints.every else 0
    assert all(load_config(list(train_args(cfg)) + list(spec.overrides)).eval.num_problems == expected
               for spec in list(plan.runs.values())[:3])


@pytest.mark.parametrize("name", ["design", "adaptive_lr"])
def test_each_runs_typed_config_is_the_config_of_its_command_line(name):
    """The study builds each run's config typed (plan.run_config: its algorithm's base config with
    the run's values); the same run as recipes/train.py arguments (train_args + spec.overrides, the
    text the SLURM sweep file and the report show) composes by Hydra to the same resolved config.
    One run of each kind of change: each algorithm, K, lr multiplier, the algorithm fields set and
    the task (another seed or another value of the same key is the same typed path)."""
    cfg = load_study_config(name)
    plan = build_plan(cfg)
    one_per_kind = {}
    for spec in plan.runs.values():
        s = spec.setting
        kind = (s.algorithm, s.inner_loops, s.lr_multiplier, tuple(k for k, _ in s.algo_overrides), s.task_overrides)
        one_per_kind.setdefault(kind, spec)
    assert len(one_per_kind) >= 8
    for spec in one_per_kind.values():
        typed = run_config(plan.defaults, spec, "runs/x")
        composed = load_config(train_args(cfg) + list(spec.overrides) + ["run.dir=runs/x", "run.progress_bar=false"])
        assert typed.raw == composed.raw, spec.name
