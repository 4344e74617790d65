"""The progress line of a run without a terminal (quatro_nemo.engine.progress), against
hand-written lines; the whole run's lines: test_train_e2e.py."""
from __future__ import annotations

import io

from quatro_nemo.engine.progress import StepProgress, format_duration, progress_line

METRICS = {"reward/mean": 0.41234, "policy/kl_ref": 0.00123, "engine_gap/token_abs_mean": 0.00312,
           "response_length/mean": 600.0, "time/step": 40.0}


def test_format_duration():
    assert [format_duration(s) for s in (0, 12.4, 245, 3600, 11_880)] == ["0s", "12s", "4m05s", "1h00m", "3h18m"]


def test_progress_line_names_each_number():
    # 2,048 sequences x 600 tokens / 40 s = 30,720 sampled tokens per second
    assert progress_line(12, 300, METRICS, 2048, 11_880) == (
        "[quatro] step 12/300 | reward 0.412 | kl_ref 0.0012 | engine gap 0.0031 | 30,720 tok/s | step 40.0 s | "
        "ETA 3h18m")
    without = {k: v for k, v in METRICS.items() if not k.startswith(("policy/", "engine_gap/"))}
    assert progress_line(1, 2, without, 10, 5) == "[quatro] step 1/2 | reward 0.412 | 150 tok/s | step 40.0 s | ETA 5s"


class _Config:
    class trainer:
        steps, prompts_per_step = 4, 8

    class rollout:
        n = 2

    class run:
        progress_bar = True

    algorithm_name = "quatro"


def test_lines_only_without_a_terminal_only_on_rank_0_and_only_for_logged_steps(capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    StepProgress(_Config, rank0=False, start_step=0, terminal=io.StringIO()).step_done(1, METRICS, logged=True)
    with_bar = StepProgress(_Config, rank0=True, start_step=0, terminal=Terminal())
    assert with_bar.bar is not None and not with_bar.lines
    with_bar.close()
    report = StepProgress(_Config, rank0=True, start_step=0, terminal=io.StringIO())
    report.step_done(1, METRICS, logged=False)
    report.step_done(2, dict(METRICS, **{"time/step": 20.0}), logged=True)
    # step 2 of 4: the mean of 40 s and 20 s, two steps left
    assert capsys.readouterr().out.splitlines() == [progress_line(2, 4, dict(METRICS, **{"time/step": 20.0}), 16, 60)]
