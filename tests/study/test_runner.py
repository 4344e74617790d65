"""The study runner with a stand-in for the study's job (tests/study/standin_job.py): finished
runs are skipped, failures are reported (not fatal), a run stopped by a signal (exit 75) is
stopped, not failed, no run inherits a rendezvous (MASTER_PORT) from the study process, and a run
directory of another run is never reused."""
import importlib
import json
import os
import time

import pytest

from quatro_nemo.engine.api import RunIdentityError, RunRequest, configured, preflight
from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.heldout import EvalRequest
from quatro_nemo.engine.run_dir import RunDir
from quatro_nemo.study import runner
from quatro_nemo.study.forkserver import encode_call
from quatro_nemo.study.plan import RunSpec, Setting
from tests.study.standin_job import run_standin


# The server imports what a child needs to unpickle a request once (as the study's preload does).
PRELOAD = encode_call(importlib.import_module, "quatro_nemo.engine.api")


@pytest.fixture(scope="module")
def base_config():
    return load_config([])


class Runs:
    """The runner's view of a study: each run the default config at its seed, evaluated with 8
    samples (QUATRO) or 4; done once its directory holds the stand-in's evaluation."""

    def __init__(self, study_dir, base):
        self.study_dir, self.base, self.ended_runs = study_dir, base, []

    def request(self, spec):
        config = configured(self.base, {"run.dir": runner.run_dir(self.study_dir, spec.name), "run.seed": spec.seed})
        return RunRequest(config, EvalRequest(4, 8 if spec.setting.algorithm == "quatro" else 4, (0.7,)))

    def is_done(self, spec):
        return RunDir(runner.run_dir(self.study_dir, spec.name)).is_evaluated()

    def ended(self, spec, result):
        self.ended_runs.append((spec.name, result.status))


def spec(algorithm, seed):
    return RunSpec(Setting(algorithm, 1, 1.0), seed)


def behave(study_dir, **behaviour):
    os.makedirs(study_dir, exist_ok=True)
    with open(os.path.join(study_dir, "behaviour.json"), "w") as f:
        json.dump({spec(*key.split("_")).name if "_" in key else key: what for key, what in behaviour.items()}, f)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(runner, "run_job", run_standin)


def test_execute_skips_done_runs_reports_failures_and_isolates_runs(tmp_path, monkeypatch, standin, base_config):
    monkeypatch.setenv("MASTER_PORT", "29999")
    study_dir = str(tmp_path / "study")
    runs = Runs(study_dir, base_config)
    done_before = spec("grpo", 1)
    os.makedirs(runner.run_dir(study_dir, done_before.name))
    open(os.path.join(runner.run_dir(study_dir, done_before.name), "study_eval.jsonl"), "w").write("{}\n")
    specs = [done_before, spec("quatro", 1), spec("quatro", 2), spec("gspo", 1), spec("gpg", 1)]
    behave(study_dir, **{specs[3].name: "fail", specs[4].name: "stop"})
    messages = []
    results = runner.execute(specs, study_dir, runs, workers=2, log=messages.append, poll_s=0.05, preload=PRELOAD)
    status = {r.name: r.status for r in results}
    assert status == {done_before.name: "skipped", specs[1].name: "done", specs[2].name: "done",
                      specs[3].name: "failed", specs[4].name: "stopped"}
    assert sorted(runs.ended_runs) == sorted((name, s) for name, s in status.items() if s != "skipped")
    assert next(r for r in results if r.status == "failed").returncode == 3
    assert all(r.cpu_seconds > 0 for r in results if r.status != "skipped")   # from the process's rusage
    assert any("FAILED (exit 3)" in m for m in messages) and any("stopped (exit 75" in m for m in messages)
    for s, n_samples in ((specs[1], 8), (specs[2], 8)):
        seen = json.load(open(os.path.join(runner.run_dir(study_dir, s.name), "seen.json")))
        assert seen["master_port"] is None and seen["threads"] == "1"
        assert seen["seed"] == s.seed and seen["n_samples"] == n_samples and seen["digest"] == runs.request(s).digest()
    # a second pass trains nothing that finished
    again = runner.execute(specs[:3], study_dir, runs, workers=2, log=messages.append, poll_s=0.05, preload=PRELOAD)
    assert {r.status for r in again} == {"skipped"}
    # a run directory claimed by another run: an error naming the difference, never a silent reuse
    other = spec("gmpo", 1)
    claimed = runs.request(other)
    preflight(RunRequest(configured(claimed.config, {"trainer.steps": 3}), claimed.evaluation))
    with pytest.raises(RunIdentityError, match="trainer.steps"):
        runner.execute([other], study_dir, runs, workers=1, log=messages.append, poll_s=0.05, preload=PRELOAD)


def test_an_interrupted_study_reports_what_it_finished_and_its_cost_is_counted(tmp_path, standin, base_config):
    # SIGTERM while runs train: execute stops the runs and raises StudyInterrupted with the
    # finished ones (a run that finishes while the study stops among them) and how many it started;
    # that invocation's wall time counts in the total (the trainings it stopped resume next time).
    import signal
    import threading

    from quatro_nemo.study.timing import invocation_totals, record_invocation

    study_dir = str(tmp_path / "study")
    specs = [spec("quatro", 1), spec("gspo", 1), spec("grpo", 1)]
    behave(study_dir, **{specs[1].name: "slow", specs[2].name: "finish_on_sigterm"})

    def stop_once_grpo_started():   # quatro finished, gspo and grpo training
        while not os.path.exists(os.path.join(runner.run_dir(study_dir, specs[2].name), "started")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Thread(target=stop_once_grpo_started, daemon=True)
    timer.start()
    try:
        runner.execute(specs, study_dir, Runs(study_dir, base_config), workers=2, log=lambda m: None, poll_s=0.05,
                       preload=PRELOAD)
        raise AssertionError("execute returned although SIGTERM arrived")
    except runner.StudyInterrupted as stop:
        assert [(r.name, r.status) for r in stop.results] == [(specs[0].name, "done"), (specs[2].name, "done")]
        assert stop.results[1].seconds > 5 and stop.results[1].cpu_seconds > 0
        assert stop.runs_started == 3          # quatro finished, then gspo and grpo were training
        assert not RunDir(runner.run_dir(study_dir, specs[1].name)).is_trained()   # gspo was stopped
    finally:
        timer.join(timeout=60)
    assert signal.getsignal(signal.SIGTERM) is not runner._interrupt    # the handler is restored
    record_invocation(study_dir, 2.5, 0, runs_started=2, interrupted=True)
    record_invocation(study_dir, 4.0, 3)
    assert invocation_totals(study_dir) == {"total_wall_minutes": 6.5, "training_invocations": 2}


def test_invocations_total_the_wall_time_of_those_that_trained(tmp_path):
    # A study finished over several invocations reports the sum of the ones that trained runs;
    # a report-only or all-skipped invocation (no run executed) adds nothing.
    from quatro_nemo.study.timing import INVOCATIONS_FILE, record_invocation
    assert record_invocation(str(tmp_path), 38.9, 63) == {"total_wall_minutes": 38.9, "training_invocations": 1}
    assert record_invocation(str(tmp_path), 0.4, 0) == {"total_wall_minutes": 38.9, "training_invocations": 1}
    totals = record_invocation(str(tmp_path), 24.1, 38, {"quatro-s1": [61.5, 58.0]})
    assert totals["training_invocations"] == 2 and abs(totals["total_wall_minutes"] - 63.0) < 1e-9
    lines = [json.loads(line) for line in open(tmp_path / INVOCATIONS_FILE)]
    assert [r["runs_executed"] for r in lines] == [63, 0, 38]
    assert lines[-1]["run_seconds"] == {"quatro-s1": [61.5, 58.0]}


def test_runs_a_refill_adds_start_before_the_remaining_ones(tmp_path, standin, base_config):
    # A search adds runs once those it depends on are done: execute asks after each run ends and
    # starts what is new first.
    study_dir = str(tmp_path / "study")
    runs = Runs(study_dir, base_config)
    first, rest = spec("quatro", 1), [spec("grpo", s) for s in (1, 2, 3)]
    added = RunSpec(Setting("quatro", 1, 2.0), 1)

    def refill():
        return [first, *rest, added] if runs.is_done(first) else [first, *rest]

    messages = []
    results = runner.execute([first, *rest], study_dir, runs, workers=1, log=messages.append, poll_s=0.05,
                             refill=refill, preload=PRELOAD)
    assert [r.name for r in results] == [first.name, added.name, *(r.name for r in rest)]
    assert all(r.status == "done" for r in results)
    assert messages[0].startswith("[study] 1/4 ") and messages[1].startswith("[study] 2/5 ")
