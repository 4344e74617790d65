"""The study runner with a stand-in for recipes/train.py: finished runs are skipped, failures are
reported (not fatal), and no run inherits a rendezvous (MASTER_PORT) from the study process."""
import json
import os
import textwrap

import pytest

from quatro_nemo.study import runner
from quatro_nemo.study.plan import RunSpec, Setting

STANDIN = textwrap.dedent('''
    import json, os, sys
    argv = sys.argv[1:]
    evaluate = argv[argv.index("--evaluate") + 1:] if "--evaluate" in argv else None
    argv = argv[:argv.index("--evaluate")] if evaluate is not None else argv
    args = dict(a.split("=", 1) for a in argv)
    run_dir = args["run.dir"]
    if args.get("fail") == "yes":
        sys.exit(3)
    if args.get("finish_on_sigterm") == "yes":   # a run past its training: SIGTERM does not stop it
        import signal; signal.signal(signal.SIGTERM, lambda *_: None)
    if args.get("slow") == "yes":
        import time; time.sleep(60 if args.get("finish_on_sigterm") != "yes" else 6)
    with open(os.path.join(run_dir, "seen.json"), "w") as f:
        json.dump({"master_port": os.environ.get("MASTER_PORT"), "threads": os.environ.get("OMP_NUM_THREADS"),
                   "args": sys.argv[1:]}, f)
    open(os.path.join(run_dir, "report.json"), "w").write("{}")
    if evaluate is not None:
        json.dump(evaluate, open(os.path.join(run_dir, "study_eval.jsonl"), "w"))
''')


def spec(algorithm, seed, *extra):
    return RunSpec(Setting(algorithm, 1, 1.0), seed, (f"algorithm={algorithm}", f"run.seed={seed}", *extra))


def test_execute_skips_done_runs_reports_failures_and_isolates_runs(tmp_path, monkeypatch):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    monkeypatch.setattr(runner, "TRAIN", str(script))
    monkeypatch.setenv("MASTER_PORT", "29999")
    study_dir = str(tmp_path / "study")
    done_before = spec("grpo", 1)
    os.makedirs(runner.run_dir(study_dir, done_before.name))
    open(os.path.join(runner.run_dir(study_dir, done_before.name), "report.json"), "w").write("{}")
    specs = [done_before, spec("quatro", 1), spec("quatro", 2), spec("gspo", 1, "fail=yes")]
    messages = []
    results = runner.execute(specs, study_dir, ["config=config", "trainer.steps=2"], workers=2,
                             log=messages.append, poll_s=0.05)
    status = {r.name: r.status for r in results}
    assert status == {done_before.name: "skipped", specs[1].name: "done", specs[2].name: "done",
                      specs[3].name: "failed"}
    assert next(r for r in results if r.status == "failed").returncode == 3
    assert all(r.cpu_seconds > 0 for r in results if r.status != "skipped")   # from the process's rusage
    assert any("FAILED (exit 3)" in m for m in messages)
    seen = json.load(open(os.path.join(runner.run_dir(study_dir, specs[1].name), "seen.json")))
    assert seen["master_port"] is None and seen["threads"] == "1"
    assert seen["args"][:4] == ["config=config", "trainer.steps=2", "algorithm=quatro", "run.seed=1"]
    assert f"run.dir={runner.run_dir(study_dir, specs[1].name)}" in seen["args"]
    # a second pass trains nothing that finished, and retries the failure
    again = runner.execute(specs[:3], study_dir, ["config=config", "trainer.steps=2"], workers=2,
                           log=messages.append, poll_s=0.05)
    assert {r.status for r in again} == {"skipped"}
    # the same names with other settings: an error naming the difference, never a silent reuse (issue 29)
    with pytest.raises(runner.RunIdentityError, match="trainer.steps=2"):
        runner.execute(specs[:3], study_dir, ["config=config"], workers=2, log=messages.append, poll_s=0.05)


def test_with_evaluation_a_run_is_done_once_evaluated(tmp_path, monkeypatch):
    # With evaluation the process is the study job (training + evaluation); a run trained
    # before (report.json) but never evaluated is not skipped.
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    monkeypatch.setattr(runner, "JOB", [str(script)])
    study_dir = str(tmp_path / "study")
    trained = spec("quatro", 1)
    os.makedirs(runner.run_dir(study_dir, trained.name))
    open(os.path.join(runner.run_dir(study_dir, trained.name), "report.json"), "w").write("{}")
    results = runner.execute([trained, spec("grpo", 1)], study_dir, ["config=config"], workers=2,
                             log=lambda m: None, poll_s=0.05,
                             evaluation_args=lambda s: ["--n", "8" if s.setting.algorithm == "quatro" else "4"])
    assert {r.status for r in results} == {"done"}
    for algorithm, n in (("quatro", "8"), ("grpo", "4")):
        directory = runner.run_dir(study_dir, spec(algorithm, 1).name)
        assert json.load(open(os.path.join(directory, "study_eval.jsonl"))) == ["--n", n]
        assert runner.is_done(directory) and runner.is_trained(directory)
    again = runner.execute([trained], study_dir, ["config=config"], workers=1, log=lambda m: None, poll_s=0.05,
                           evaluation_args=lambda s: ["--n", "8"])
    assert [r.status for r in again] == ["skipped"]


def test_invocations_total_the_wall_time_of_those_that_trained(tmp_path):
    # A study finished over several invocations reports the sum of the ones that trained runs;
    # a report-only or all-skipped invocation (no run executed) adds nothing.
    from quatro_nemo.study.driver import INVOCATIONS_FILE, record_invocation
    assert record_invocation(str(tmp_path), 38.9, 63) == {"total_wall_minutes": 38.9, "training_invocations": 1}
    assert record_invocation(str(tmp_path), 0.4, 0) == {"total_wall_minutes": 38.9, "training_invocations": 1}
    totals = record_invocation(str(tmp_path), 24.1, 38, {"quatro-s1": [61.5, 58.0]})
    assert totals["training_invocations"] == 2 and abs(totals["total_wall_minutes"] - 63.0) < 1e-9
    lines = [json.loads(line) for line in open(tmp_path / INVOCATIONS_FILE)]
    assert [r["runs_executed"] for r in lines] == [63, 0, 38]
    assert lines[-1]["run_seconds"] == {"quatro-s1": [61.5, 58.0]}


def test_an_interrupted_study_reports_what_it_finished_and_its_cost_is_counted(tmp_path, monkeypatch):
    # SIGTERM while runs train: execute stops the runs and raises StudyInterrupted with the
    # finished ones (a run that finishes while the study stops among them) and how many it started;
    # that invocation's wall time counts in the total (the trainings it stopped resume next time).
    import signal
    import threading

    from quatro_nemo.study.driver import invocation_totals, record_invocation

    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    monkeypatch.setattr(runner, "TRAIN", str(script))
    study_dir = str(tmp_path / "study")
    specs = [spec("quatro", 1), spec("gspo", 1, "slow=yes"), spec("grpo", 1, "slow=yes", "finish_on_sigterm=yes")]
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        runner.execute(specs, study_dir, ["config=config"], workers=2, log=lambda m: None, poll_s=0.05)
        raise AssertionError("execute returned although SIGTERM arrived")
    except runner.StudyInterrupted as stop:
        assert [(r.name, r.status) for r in stop.results] == [(specs[0].name, "done"), (specs[2].name, "done")]
        assert stop.results[1].seconds > 5 and stop.results[1].cpu_seconds > 0
        assert stop.runs_started == 3          # quatro finished, then gspo and grpo were training
        assert not runner.is_trained(runner.run_dir(study_dir, specs[1].name))   # gspo was stopped
    finally:
        timer.cancel()
    assert signal.getsignal(signal.SIGTERM) is not runner._interrupt    # the handler is restored
    record_invocation(study_dir, 2.5, 0, runs_started=2, interrupted=True)
    record_invocation(study_dir, 4.0, 3)
    assert invocation_totals(study_dir) == {"total_wall_minutes": 6.5, "training_invocations": 2}


def test_runs_a_refill_adds_start_before_the_remaining_ones(tmp_path, monkeypatch):
    # A search adds runs once those it depends on are done: execute asks after each run ends and
    # starts what is new first.
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    monkeypatch.setattr(runner, "TRAIN", str(script))
    study_dir = str(tmp_path / "study")
    first, rest = spec("quatro", 1), [spec("grpo", s) for s in (1, 2, 3)]
    added = RunSpec(Setting("quatro", 1, 2.0), 1, ("algorithm=quatro", "run.seed=1", "lr=2"))

    def refill():
        return [first, *rest, added] if runner.is_done(runner.run_dir(study_dir, first.name), False) else [first, *rest]

    messages = []
    results = runner.execute([first, *rest], study_dir, ["config=config"], workers=1, log=messages.append,
                             poll_s=0.05, refill=refill)
    assert [r.name for r in results] == [first.name, added.name, *(r.name for r in rest)]
    assert all(r.status == "done" for r in results)
    assert messages[0].startswith("[study] 1/4 ") and messages[1].startswith("[study] 2/5 ")
