"""Where a study's results go (quatro_nemo/study/results.py, kept.py): a run is done when kept
metrics with its identity are there, or in the committed results (copied in); a kept run of other
settings is not done; a finished run directory is kept; publish copies what is kept; old kept files
get their identity recorded without a record of theirs changing."""
import json
import os

import pytest

from quatro_nemo.engine.api import RunIdentityError, RunRequest, configured, preflight
from quatro_nemo.study.config import study_config_from_dict
from quatro_nemo.study.kept import archive_path, keep, kept_identity, read_archive, write_archive
from quatro_nemo.study.planner import build_plan
from quatro_nemo.study.results import StudyRuns, eval_request, record_identities
from quatro_nemo.study.runner import RunResult, run_dir

RECORDS = [{"kind": "train", "step": 1, "reward/mean": 0.25}, {"kind": "study_eval", "step": 1, "top_p": 0.7,
                                                                 "reward/mean": 0.5}]


@pytest.fixture(scope="module")
def study():
    cfg = study_config_from_dict(dict(
        name="small", algorithms=["quatro", "grpo"], seeds=[1, 2],
        sweeps=dict(algorithms=["quatro"], inner_loops=[1], lr_multipliers=[1], seeds=[1]),
        ablation=dict(delta=0.1, inner_loops=1, log_ratios=["seq_sum", "none"], seeds=[1]),
        deltas=dict(values=[0.05, 0.1], seeds=[1]),
        evaluation=dict(num_problems=4, n_samples=8, top_p=[0.7, 1.0], sweep_n_samples=4)))
    return cfg, build_plan(cfg)


def test_a_run_is_done_where_its_identity_is_kept(tmp_path, study):
    cfg, plan = study
    out, committed = str(tmp_path / "out"), str(tmp_path / "committed")
    messages = []
    runs = StudyRuns(cfg, plan, out, committed, log=messages.append)
    quatro, grpo, quatro2, none = (plan.runs_of(plan.compare["quatro"], [1])[0], plan.runs_of(plan.compare["grpo"], [1])[0],
                                   plan.runs_of(plan.compare["quatro"], [2])[0], plan.runs_of(plan.ablation["none"], [1])[0])
    assert not runs.is_done(quatro)
    # the request: the plan's config in the study's run directory, the study's evaluation of it
    assert runs.request(quatro).config.run.dir == run_dir(out, quatro.name)
    assert runs.request(quatro).evaluation == eval_request(cfg, full=True)
    assert runs.request(none).evaluation.n_samples == 4 and runs.request(none).evaluation.top_p == (0.7,)
    # kept in the committed results with its identity: done, and copied in
    keep(committed, quatro.name, runs.request(quatro).identity_record(), RECORDS)
    assert runs.is_done(quatro) and read_archive(archive_path(out, quatro.name))[1:] == RECORDS
    # kept with another run's identity (the study's settings changed), or with none: not done
    keep(out, grpo.name, runs.request(quatro).identity_record(), RECORDS)
    write_archive(archive_path(out, quatro2.name), RECORDS)
    assert not runs.is_done(grpo) and not runs.is_done(quatro2)
    assert any(grpo.name in m and "other settings" in m for m in messages)
    # a run directory that holds its finished run (stopped before it was kept): kept now
    request = runs.request(none)
    directory = preflight(request)
    with open(directory.file("metrics.jsonl"), "w") as f:
        f.write(json.dumps(RECORDS[0]) + "\n")
    with open(directory.file("study_eval.jsonl"), "w") as f:
        f.write(json.dumps(RECORDS[1]) + "\n")
    assert runs.is_done(none) and kept_identity(archive_path(out, none.name))["digest"] == request.digest()
    assert read_archive(archive_path(out, none.name))[1:] == RECORDS
    # a run directory claimed by another run: an error, never a silent reuse
    delta = plan.runs_of(plan.deltas[0.05], [1])[0]
    other = runs.request(delta)
    preflight(RunRequest(configured(other.config, {"trainer.steps": 2}), other.evaluation))
    with pytest.raises(RunIdentityError, match="trainer.steps"):
        runs.is_done(delta)


def test_publish_copies_each_kept_run_into_the_results(tmp_path, study):
    cfg, plan = study
    out, results = str(tmp_path / "out"), str(tmp_path / "results")
    spec = plan.runs_of(plan.compare["grpo"], [2])[0]
    runs = StudyRuns(cfg, plan, out, results, publish_results=True, log=lambda m: None)
    request = runs.request(spec)
    directory = preflight(request)
    for name, record in (("metrics.jsonl", RECORDS[0]), ("study_eval.jsonl", RECORDS[1])):
        with open(directory.file(name), "w") as f:
            f.write(json.dumps(record) + "\n")
    runs.ended(spec, RunResult(spec.name, "done", 1.0, 0, 1.0))
    assert read_archive(archive_path(results, spec.name)) == read_archive(archive_path(out, spec.name))
    assert kept_identity(archive_path(results, spec.name))["digest"] == request.digest()
    progress = json.load(open(os.path.join(out, "progress.json")))
    assert (progress["runs_done"], progress["runs_total"], progress["state"]) == (1, len(plan.runs), "running")
    # a fresh study directory continues from the results alone
    assert StudyRuns(cfg, plan, str(tmp_path / "fresh"), results, log=lambda m: None).is_done(spec)


def test_old_kept_runs_get_their_identity_without_a_record_changing(tmp_path, study):
    cfg, plan = study
    results = str(tmp_path / "results")
    named = sorted(plan.runs)[:2]
    for name in named + ["not-a-run-of-this-study"]:
        write_archive(archive_path(results, name), RECORDS)
    messages = []
    assert record_identities(cfg, results, log=messages.append) == 2
    runs = StudyRuns(cfg, plan, str(tmp_path / "out"), results, log=lambda m: None)
    for name in named:
        assert read_archive(archive_path(results, name))[1:] == RECORDS
        assert runs.is_done(plan.runs[name])
    assert kept_identity(archive_path(results, "not-a-run-of-this-study")) is None
    assert any("not-a-run-of-this-study" in m for m in messages)
    assert record_identities(cfg, results, log=messages.append) == 0      # once only
