"""The wall-time estimate's fitted costs, by hand on a made-up timed study."""
import json

import pytest

from quatro_nemo.study.analysis import EVAL_KIND
from quatro_nemo.study.kept import archive_path, write_archive
from quatro_nemo.study.config import load_study_config
from quatro_nemo.study.timing import INVOCATIONS_FILE, estimate_minutes, measured_costs


def timed_run(study_dir, name, optimizer_steps, step_s, samples_per_record, records, evaluate_s):
    train = [{"kind": "train", "step": s, "optimizer_steps": optimizer_steps, "time/step": step_s} for s in (1, 2)]
    evals = [{"kind": EVAL_KIND, "top_p": 0.7 + 0.1 * i, "num_problems": 2, "n_samples": samples_per_record // 2,
              "job_seconds": {"train": 0.0, "evaluate": evaluate_s}} for i in range(records)]
    write_archive(archive_path(study_dir, name), train + evals)


def made_up_timed_study(study_dir):
    """Steps 1 s (any number of optimizer steps), evaluation 2 s + 0.05 s per sample, overhead 4.5 s.

    a: alone on its CPU (wall = CPU): steps 1 s, evaluation 3 s of 20 samples, overhead 10-3-2 = 5
    b: waited half the time (CPU = wall / 2): steps 2 s -> 1 s, evaluation 8 s -> 4 s of 40
       samples, overhead 10 (CPU) - 4 - 2 = 4
    """
    timed_run(str(study_dir), "a", 4, 1.0, 20, 1, 3.0)
    timed_run(str(study_dir), "b", 8, 2.0, 20, 2, 8.0)
    (study_dir / INVOCATIONS_FILE).write_text(json.dumps({"runs_executed": 2, "minutes": 1.0,
                                                          "run_seconds": {"a": [10.0, 10.0], "b": [20.0, 10.0]}}))


# The quick study (conf/study/quick.yaml) costed from made_up_timed_study: 28 runs of 8 steps, 1 s
# each + 4.5 s overhead; evaluations of 16 x 32 x 2 (main and delta runs: 18) or 16 x 16 samples
# at 2 + 0.05 s per sample, on 2 workers; then the base model's alone. Every run also evaluates its
# held-out checkpoints (checkpoints: every 4 steps of 8, and step 0: 3 evaluations of 16 x 2).
QUICK_MINUTES_FROM_MADE_UP_TIMINGS = ((28 * (4.5 + 8 * 1.0 + 2.0 + 3 * (2.0 + 0.05 * 32)) + 18 * 0.05 * 1024
                                       + 10 * 0.05 * 256) / 2
                                      + 2.0 + 0.05 * 1024) / 60


def test_costs_are_fitted_on_cpu_time(tmp_path):
    made_up_timed_study(tmp_path)
    costs = measured_costs(str(tmp_path))
    assert costs["step_s"] == pytest.approx(1.0) and costs["step_s_per_optimizer_step"] == pytest.approx(0.0, abs=1e-12)
    assert costs["eval_s_per_sample"] == pytest.approx((4.0 - 3.0) / (40 - 20))
    assert costs["eval_s"] == pytest.approx(3.0 - 20 * 0.05)
    assert costs["train_overhead_s"] == pytest.approx(4.5)

    estimate = estimate_minutes(load_study_config("quick"), str(tmp_path))
    assert estimate["runs"] == 28
    assert estimate["estimated_minutes"] == pytest.approx(QUICK_MINUTES_FROM_MADE_UP_TIMINGS, abs=0.05)
