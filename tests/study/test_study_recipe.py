"""recipes/study.py as a Hydra app, in process and without training: bad command lines fail
naming the key (Hydra's exit 1 or validation's exit 2) and write nothing; the cheap modes
(emit_sweep, estimate) on the shipped quick study against hand counts; the exit codes of an
interrupted study (75) and of failed runs (1)."""
import importlib.util
import json
import os

import pytest

from quatro_nemo.study import driver
from quatro_nemo.study.runner import StudyInterrupted
from tests.study.test_timing import QUICK_MINUTES_FROM_MADE_UP_TIMINGS, made_up_timed_study

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def study_main(argv):
    spec = importlib.util.spec_from_file_location("recipe_study", os.path.join(ROOT, "recipes", "study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.parametrize("argv, exit_code, named", [
    # Hydra rejects the override itself (exit 1), naming the key
    (["study.seedz=[1]"], 1, "study.seedz"),
    (["study.workers=two"], 1, "study.workers"),
    (["study=quick", "study.sweeps.inner_lops=[1]"], 1, "study.sweeps.inner_lops"),
    (["study=adaptive", "study.adaptive.taskz=[binary]"], 1, "study.adaptive.taskz"),
    (["study.kind=survey"], 1, "study.kind"),
    (["study=no_such_study"], 1, "study/no_such_study"),
    (["report_onli=true"], 1, "report_onli"),
    (["report_only=maybe"], 1, "report_only"),
    # our validation rejects the value (exit 2), naming the key
    (["study.workers=0"], 2, "workers"),
    (["study=quick", "study.sweeps.lr_multipliers=[2,4]"], 2, "sweeps.lr_multipliers"),
    (["study=quick", 'study.train_overrides=["run.seed=3"]'], 2, "train_overrides[0]"),
    (["study=adaptive", "study.adaptive.tasks=[exact]"], 2, "adaptive.tasks"),
    (["report_only=true", "emit_sweep=sweep.txt"], 2, "config keys report_only and emit_sweep"),
    (["estimate=no_such_dir"], 2, "config key estimate"),
    (["collect=no_such_dir"], 2, "config key collect"),
])
def test_study_recipe_names_the_bad_key_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, exit_code, named):
    monkeypatch.chdir(tmp_path)       # relative paths: nothing may appear here
    assert study_main(argv) == exit_code
    assert named in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_emit_sweep_applies_study_overrides_and_names_the_study(tmp_path):
    sweep = tmp_path / "sweep.txt"
    assert study_main(["study=quick", "study.seeds=[1]", f"emit_sweep={sweep}"]) == 0
    text = sweep.read_text()
    runs = [line for line in text.splitlines() if line and not line.startswith("#")]
    # conf/study/quick.yaml with one main-comparison seed: 7 algorithms x 1 seed; the sweeps of
    # quatro and gspo at seeds 1 and 2: their default point (K = 1, lr x1) at seed 2, no longer a
    # main-comparison run (2), K = 2 and lr x4 (8); the ablation's log_ratio=none arm x 2 seeds
    # (its seq_sum arm is quatro's K = 2 point); deltas 0.05 and 0.2 x 2 seeds (4)
    assert len(runs) == 7 + 2 + 8 + 2 + 4
    grpo = [line.split() for line in runs if "algorithm=grpo" in line.split()]
    assert len(grpo) == 1 and "run.seed=1" in grpo[0] and "trainer.steps=8" in grpo[0]
    assert text.startswith("# quatro-nemo study 'quick': 23 runs")   # the name is the chosen option's


def test_estimate_costs_the_chosen_study_from_a_timed_one(tmp_path, capsys):
    made_up_timed_study(tmp_path)
    assert study_main(["study=quick", f"estimate={tmp_path}"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["runs"] == 28
    assert estimate["estimated_minutes"] == pytest.approx(QUICK_MINUTES_FROM_MADE_UP_TIMINGS, abs=0.05)


def test_interrupted_study_exits_75_and_failed_runs_exit_1(tmp_path, monkeypatch, capsys):
    def interrupted(cfg, out, **_):
        raise StudyInterrupted([], runs_started=3)

    monkeypatch.setattr(driver, "run_study", interrupted)
    assert study_main(["study=quick", f"out={tmp_path}"]) == 75
    assert "the same command continues it" in capsys.readouterr().err

    def failed(cfg, out, results_dir, publish):
        assert (cfg.name, out) == ("quick", str(tmp_path))
        # the committed results of the study's name count as done; publishing them is asked for
        assert (results_dir, publish) == (os.path.join(ROOT, "docs", "study_results", "quick"), False)
        return {"claims": [], "paths": {"markdown": os.path.join(out, "report.md")}, "info": {"failed_runs": ["a"]}}

    monkeypatch.setattr(driver, "run_study", failed)
    assert study_main(["study=quick", f"out={tmp_path}"]) == 1

    def published(cfg, out, results_dir, publish):
        assert (results_dir, publish) == (str(tmp_path / "results"), True)
        return {"claims": [], "paths": {"markdown": os.path.join(out, "report.md")}, "info": {}}

    monkeypatch.setattr(driver, "run_study", published)
    assert study_main(["study=quick", f"out={tmp_path}", f"results={tmp_path / 'results'}", "publish=true"]) == 0
    assert study_main(["study=quick", f"out={tmp_path}", "publish=true", "report_only=true"]) == 2
    assert "config key publish" in capsys.readouterr().err


def test_a_study_config_of_ones_own_is_chosen_with_config_dir(tmp_path):
    """--config-dir DIR study=NAME reads DIR/study/NAME.yaml; the study is named NAME."""
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "mine.yaml").write_text(
        "algorithms: [quatro, grpo]\nseeds: [1]\n"
        "sweeps: {algorithms: [quatro], inner_loops: [1], lr_multipliers: [1], seeds: [1]}\n"
        "ablation: {delta: 0.1, inner_loops: 1, log_ratios: [seq_sum, none], seeds: [1]}\n"
        "deltas: {values: [0.05, 0.2], seeds: [1]}\n")
    sweep = tmp_path / "sweep.txt"
    assert study_main([f"--config-dir={tmp_path}", "study=mine", f"emit_sweep={sweep}"]) == 0
    text = sweep.read_text()
    assert text.startswith("# quatro-nemo study 'mine': ")
    algorithms = [word for line in text.splitlines() if not line.startswith("#")
                  for word in line.split() if word.startswith("algorithm=")]
    assert set(algorithms) == {"algorithm=quatro", "algorithm=grpo"} and algorithms.count("algorithm=grpo") == 1
