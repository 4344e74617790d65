"""scripts/study_background.sh on a tiny real study: started detached at the lowest priority, it
can be paused (every process of it stopped) and resumed; `stop` makes the running trainings
checkpoint and exit 75 and the study exit 75 (state: stopped), with the runs finished so far kept
and published; the next `start` resumes the stopped runs and finishes the study."""
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.engine.conftest import TINY

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "study_background.sh")
STEPS = 60


def script(command, env):
    done = subprocess.run(["bash", SCRIPT, command], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def wait_for(condition, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


def logged_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return len(open(path).readlines()) if os.path.isfile(path) else 0


def test_background_study_pauses_stops_cleanly_and_resumes(tmp_path, warm_cache):
    config = {"name": "tiny_bg", "kind": "adaptive", "description": "tiny background study",
              "train_overrides": TINY + [f"warmstart.cache_dir={warm_cache}", f"trainer.steps={STEPS}",
                                         "trainer.checkpoint_every=0"],
              "adaptive": {"tasks": ["binary"], "fixed_deltas": [0.05, 0.2], "stress": {}, "seeds": [1],
                           "strategies": {"controller": {"delta_controller": {"kind": "kl"}}}},
              "evaluation": {"num_problems": 4, "n_samples": 4, "top_p": [0.7], "sweep_n_samples": 4},
              "workers": 2, "time_budget_minutes": 10}
    (tmp_path / "conf" / "study").mkdir(parents=True)
    (tmp_path / "conf" / "study" / "tiny_bg.yaml").write_text(yaml.safe_dump(config))
    state, out, results = tmp_path / "state", tmp_path / "runs", tmp_path / "results"
    env = dict(os.environ, QUATRO_STUDIES="tiny_bg", QUATRO_STUDY_STATE=str(state), QUATRO_STUDY_OUT=str(out),
               QUATRO_STUDY_RESULTS=str(results), QUATRO_STUDY_ARGS=f"--config-dir={tmp_path / 'conf'}",
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    runs = out / "study_tiny_bg" / "runs"
    assert "started" in script("start", env)
    pid = int((state / "pid").read_text())
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid          # detached: its own session and group
    assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    wait_for(lambda: runs.is_dir() and any(logged_steps(d) >= 2 for d in runs.iterdir()))

    script("pause", env)
    group = subprocess.run(["ps", "-o", "stat=", "-g", str(pid)], capture_output=True, text=True).stdout.split()
    assert group and all(stat.startswith("T") for stat in group), group
    assert "state: paused" in script("status", env)
    script("resume", env)

    stopped = script("stop", env)                                      # returns once everything exited
    assert "state: stopped" in stopped
    log = (state / "log").read_text()
    assert "study=tiny_bg: exit 75" in log
    invocation = json.loads((results / "tiny_bg" / "invocations.jsonl").read_text().splitlines()[-1])
    assert invocation["interrupted"]
    progress = json.loads((out / "study_tiny_bg" / "progress.json").read_text())
    assert progress["state"] == "stopped" and progress["runs_done"] < progress["runs_total"] == 3
    interrupted = [d for d in runs.iterdir() if not (d / "report.json").exists()]
    assert interrupted and all((d / "checkpoints").is_dir() for d in interrupted)   # checkpointed at the stop

    script("start", env)
    wait_for(lambda: (state / "state").read_text().strip() != "running")
    assert (state / "state").read_text().strip() == "finished", (state / "log").read_text()[-3000:]
    assert "study=tiny_bg: 3/3 runs done" in script("status", env)
    for run in interrupted:                                            # resumed, not restarted
        starts = [line for line in (run / "train.log").read_text().splitlines() if f"->{STEPS} |" in line]
        assert len(starts) == 2 and f"steps 0->{STEPS}" in starts[0] and f"steps 0->{STEPS}" not in starts[1], starts
    kept = sorted(p.name for p in (results / "tiny_bg" / "metrics").glob("*.jsonl.gz"))
    assert kept == sorted([f"{d.name}.jsonl.gz" for d in runs.iterdir()] + ["base.jsonl.gz"])
