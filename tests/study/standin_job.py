"""A stand-in for the study's job (quatro_nemo.study.job.run_job) in the runner's tests: it
records what it was asked and how it was started, and behaves as ``<study dir>/behaviour.json``
says for its run (fail, slow, finish_on_sigterm, stop: exit 75 as a preempted training does)."""
import json
import os
import signal
import sys
import time


def run_standin(request) -> int:
    run_dir = request.config.run.dir
    study_dir = os.path.dirname(os.path.dirname(run_dir))
    path = os.path.join(study_dir, "behaviour.json")
    behaviour = json.load(open(path)).get(os.path.basename(run_dir), "") if os.path.isfile(path) else ""
    if behaviour == "fail":
        sys.exit(3)
    if behaviour == "stop":
        return 75
    if behaviour == "finish_on_sigterm":     # a run past its training: SIGTERM does not stop it
        signal.signal(signal.SIGTERM, lambda *_: None)
    open(os.path.join(run_dir, "started"), "w").close()
    if behaviour == "finish_on_sigterm":
        time.sleep(6)
    if behaviour == "slow":
        time.sleep(60)
    with open(os.path.join(run_dir, "seen.json"), "w") as f:
        json.dump({"master_port": os.environ.get("MASTER_PORT"), "threads": os.environ.get("OMP_NUM_THREADS"),
                   "seed": request.config.run.seed, "digest": request.digest(),
                   "n_samples": None if request.evaluation is None else request.evaluation.n_samples}, f)
    open(os.path.join(run_dir, "report.json"), "w").write("{}")
    if request.evaluation is not None:
        open(os.path.join(run_dir, "study_eval.jsonl"), "w").write("{}\n")
    return 0
