"""The sbatch templates on a real one-node SLURM cluster: rendezvous, job array sweep,
SIGUSR1 -> checkpoint -> requeue -> resume, and failures that must not requeue.

All jobs are submitted at once (module fixture) so they run side by side; each test then checks
its own jobs. The jobs run slurm/quatro_1p5b.sh itself, with sbatch flags shrinking its resources
to this machine and overrides switching to the tiny CPU config (see conftest.py).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from quatro_nemo.eval.tables import AVERAGE

from .slurm_cluster import ROOT, expected_master_port, read_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

TEMPLATE = "slurm/quatro_1p5b.sh"
EVAL_FIXTURES = ROOT / "tests" / "fixtures" / "eval"
SWEEP_SETS = [  # one array task each; the seed makes every task's metrics different
    ["trainer.lr=0.05", "{seed}=1"],
    ["trainer.lr=0.02", "{seed}=2"],
]


def local_resources(log_dir: Path, ntasks: int) -> list:
    """sbatch flags that fit the template's H100 request onto this one small node."""
    return ["--nodes=1", f"--ntasks-per-node={ntasks}", "--gpus-per-node=1", "--cpus-per-task=1",
            "--mem=1500M", "--time=20", f"--output={log_dir}/%x-%j.out"]


@pytest.fixture(scope="module")
def jobs(local_slurm, recipe, tmp_path_factory):
    local_slurm.ensure(1)
    runs = tmp_path_factory.mktemp("runs")
    env = dict(recipe.env, QUATRO_RUNS_DIR=str(runs))
    log_dir = local_slurm.log_dir
    submitted = {}

    def submit(name, ntasks, overrides, extra_env=None, default_log=False):
        flags = local_resources(log_dir, ntasks)
        if default_log:  # keep the template's own --output (slurm/logs/%x-%j.out)
            flags = [f for f in flags if not f.startswith("--output")]
        run_dir = runs / name
        job_id = local_slurm.sbatch(f"--job-name=test-{name}", *flags, TEMPLATE,
                                    *overrides, f"run.dir={run_dir}", env={**env, **(extra_env or {})})
        submitted[name] = (job_id, run_dir)

    # Signalled first in the module: give it the head start.
    submit("resumed", 2, recipe.long)
    # The resumed run's reference, and the job whose two ranks the rendezvous test inspects.
    submit("uninterrupted", 2, recipe.long, default_log=True)
    submit("failing", 1, recipe.failing)
    submit("restart_limit", 1, recipe.long, extra_env={"QUATRO_MAX_RESTARTS": "0"})
    # slurm/eval.sh on the hand-labelled samples fixture, with the real recipes/evaluate.py (also
    # under the stand-in recipe) and its default output directory.
    submitted["eval"] = local_slurm.sbatch(
        "--job-name=test-eval", *local_resources(log_dir, 1), "slurm/eval.sh",
        f"+runs.base={EVAL_FIXTURES / 'samples_base.jsonl'}", f"+runs.trained={EVAL_FIXTURES / 'samples_trained.jsonl'}",
        "base_run=base", "ucc_metric=exact", "pairwise_metrics=[jaccard]", "grading_workers=1", "plots=false",
        env={"QUATRO_RUNS_DIR": str(runs)})
    submitted["eval_runs_dir"] = runs

    # What `#SBATCH --signal=B:USR1@600` does before the time limit: USR1 to the batch shell,
    # here as soon as each of these two jobs has finished its first step.
    to_signal = {name: submitted[name] for name in ("resumed", "restart_limit")}
    deadline = time.monotonic() + 300
    while to_signal:
        assert time.monotonic() < deadline, f"no metrics from {sorted(to_signal)} within 300 s"
        for name, (job_id, run_dir) in list(to_signal.items()):
            if first_metric_written(run_dir):
                local_slurm.run("scancel", "--batch", "--signal=USR1", job_id)
                del to_signal[name]
        time.sleep(0.3)

    sweep_file = runs / "sweep.txt"
    lines = [" ".join(o.format(seed=recipe.seed_key) for o in s) for s in SWEEP_SETS]
    sweep_file.write_text("# test sweep\n\n" + "\n".join(lines) + "\n")
    sweep_job = local_slurm.run(
        "bash", "slurm/sweep.sh", "--name=test-sweep", *local_resources(log_dir, 1), sweep_file,
        *recipe.tiny, env=env).strip()
    sweep_dirs = sorted((runs / "sweeps").glob("test-sweep-*"))
    assert len(sweep_dirs) == 1, sweep_dirs
    submitted["sweep"] = (sweep_job, sweep_dirs[0])
    submitted["sweep_lines"] = lines
    yield submitted
    # The job submitted with default_log wrote into the tree (slurm/logs/).
    template_log("uninterrupted", submitted["uninterrupted"][0]).unlink(missing_ok=True)


def template_log(name: str, job_id: str) -> Path:
    """The template's own log file (#SBATCH --output=slurm/logs/%x-%j.out) of job `test-<name>`."""
    return ROOT / "slurm" / "logs" / f"test-{name}-{job_id}.out"


def job_log(local_slurm, job_id) -> str:
    return Path(local_slurm.job(job_id)["StdOut"]).read_text()


def first_metric_written(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(line.strip() for line in path.read_text().splitlines())


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_metrics(local_slurm, recipe, jobs):
    job_id, run_dir = jobs["resumed"]
    reference_id, reference_dir = jobs["uninterrupted"]
    # The fixture sent USR1 to the batch shell after the first step.
    local_slurm.wait_until(lambda: local_slurm.job(job_id)["Restarts"] == "1"
                           and local_slurm.state(job_id) == "PENDING", 120, "the requeue")
    # Skip the ~2 min requeue hold, leaving slurmd a few seconds to clean up the job's first run.
    local_slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+5")
    final = local_slurm.wait_done([job_id, reference_id], timeout=400)

    assert final[job_id]["JobState"] == "COMPLETED", (final[job_id], job_log(local_slurm, job_id)[-3000:])
    assert final[reference_id]["JobState"] == "COMPLETED", job_log(local_slurm, reference_id)[-3000:]
    assert final[job_id]["Restarts"] == "1" and final[reference_id]["Restarts"] == "0"
    launches = read_jsonl(run_dir / "slurm_launches.jsonl")
    assert [(r["event"], r["restart_count"], r.get("action")) for r in launches] == [
        ("start", "0", None), ("end", "0", "requeue"), ("start", "1", None), ("end", "1", "done")]
    assert launches[1]["exit_code"] == "75" and launches[1]["usr1"] == "1"
    assert [r["master_port"] for r in launches if r["event"] == "start"] == [
        expected_master_port(job_id, 0), expected_master_port(job_id, 1)]
    # The second start resumed from a checkpoint (start step > 0), it did not begin again.
    starts = [int(m) for m in re.findall(r"steps (\d+)->\d+", job_log(local_slurm, job_id))]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] > 0, starts
    assert list((run_dir / "checkpoints").iterdir())
    # Same metrics, step by step, as the run nobody interrupted (CPU, float: bit-identical).
    resumed, reference = recipe.metrics(run_dir), recipe.metrics(reference_dir)
    assert len(reference) > 0
    assert any(r.get(recipe.update_key, 0) != 0 for r in reference), "the model never changed"
    assert resumed == reference


def test_all_ranks_ran_and_agreed_on_the_rendezvous(local_slurm, jobs):
    job_id, run_dir = jobs["uninterrupted"]
    final = local_slurm.wait_done([job_id], timeout=400)[job_id]
    assert final["JobState"] == "COMPLETED", job_log(local_slurm, job_id)[-3000:]
    ranks = read_jsonl(run_dir / "slurm_ranks.jsonl")
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert sorted(r["local_rank"] for r in ranks) == [0, 1]
    (start,) = [r for r in read_jsonl(run_dir / "slurm_launches.jsonl") if r["event"] == "start"]
    assert {(r["master_addr"], r["master_port"]) for r in ranks} == {(start["master_addr"], start["master_port"])}
    assert start["master_port"] == expected_master_port(job_id)
    # The processes SLURM started are the ones that joined one process group: world.json is
    # written by the recipe after the rendezvous, with every rank's pid gathered over it.
    world = (run_dir / "world.json").read_text()
    for r in ranks:
        assert re.search(rf'"pid": {r["pid"]}\b', world), (r, world)
    # The template's own log file (#SBATCH --output=slurm/logs/%x-%j.out) got the job's output.
    assert "rendezvous" in template_log("uninterrupted", job_id).read_text()


def test_sweep_ran_every_override_set_in_its_own_run_dir(local_slurm, recipe, jobs):
    array_id, sweep_dir = jobs["sweep"]
    lines = jobs["sweep_lines"]
    local_slurm.wait_done([array_id], timeout=400)
    task_ids = [f"{array_id}_{i}" for i in range(len(lines))]
    states = {t: local_slurm.job(t)["JobState"] for t in task_ids}
    assert set(states.values()) == {"COMPLETED"}, [job_log(local_slurm, t)[-2000:] for t in task_ids]
    assert (sweep_dir / "sweep.txt").exists()
    finals = []
    for i, line in enumerate(lines):
        task_dir = sweep_dir / f"task-{i}"
        (start,) = [r for r in read_jsonl(task_dir / "slurm_launches.jsonl") if r["event"] == "start"]
        given = start["overrides"].split()
        assert given[-len(line.split()) - 1:-1] == line.split()  # this task's set, after the common ones
        assert f"run.dir={task_dir}" in given
        metrics = recipe.metrics(task_dir)
        assert metrics, task_dir
        finals.append(metrics[-1])
    # Different seeds/learning rates gave different runs: the sets reached the processes.
    assert len({repr(f) for f in finals}) == len(lines)


def test_a_real_failure_is_not_requeued(local_slurm, jobs):
    job_id, run_dir = jobs["failing"]
    final = local_slurm.wait_done([job_id], timeout=300)[job_id]
    assert final["JobState"] == "FAILED", final
    assert final["Restarts"] == "0"
    end = read_jsonl(run_dir / "slurm_launches.jsonl")[-1]
    assert end["event"] == "end" and end["action"] == "failed" and end["exit_code"] not in ("0", "75")


def test_checkpoint_exit_past_the_restart_limit_is_not_requeued(local_slurm, jobs):
    job_id, run_dir = jobs["restart_limit"]   # QUATRO_MAX_RESTARTS=0, USR1 after its first step
    final = local_slurm.wait_done([job_id], timeout=300)[job_id]
    assert final["JobState"] == "FAILED" and final["Restarts"] == "0", final
    end = read_jsonl(run_dir / "slurm_launches.jsonl")[-1]
    assert end["exit_code"] == "75" and end["action"].startswith("gave up"), end


def test_eval_template_runs_the_evaluate_recipe_into_its_default_run_dir(local_slurm, jobs):
    job_id = jobs["eval"]
    final = local_slurm.wait_done([job_id], timeout=300)[job_id]
    assert final["JobState"] == "COMPLETED", job_log(local_slurm, job_id)[-3000:]
    out = jobs["eval_runs_dir"] / f"test-eval-{job_id}"      # out defaults to <runs>/<job name>-<job id>
    report = json.loads((out / "report.json").read_text())
    # hand-labelled fixture: base pass@1 is (0 + 2/4)/2 on bench_a and 1 on bench_b: mean 0.625
    assert report["runs"]["base"][AVERAGE]["pass@k"]["1"] == pytest.approx(0.625)
    (start,) = [r for r in read_jsonl(out / "slurm_launches.jsonl") if r["event"] == "start"]
    assert start["recipe"] == "evaluate" and "num_samples=256" in start["overrides"].split()
