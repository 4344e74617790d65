"""The study's fork server: a run forked from it is the same computation as the run in its own
process (compared with recipes/train.py started as a plain subprocess), and it reports exit codes,
errors and signals as the interpreter would."""
import json
import os
import signal
import subprocess
import sys

import pytest

from quatro_nemo.engine.api import RunRequest
from quatro_nemo.engine.config import load_config
from quatro_nemo.megatron.parallel import standalone_environment
from quatro_nemo.study.forkserver import encode_call
from quatro_nemo.study.job import preload, run_job
from quatro_nemo.study.runner import ForkServer, ForkServerError
from tests.engine.conftest import REPO, TRAIN
from tests.study.forkserver_calls import fail_to_preload, report, sleep

ENV = dict(standalone_environment(), PYTHONUNBUFFERED="1")


def run_all(server, requests):
    """Start every (name, call) request and wait for all; name -> (exit code, log text, CPU seconds)."""
    for name, call in requests:
        server.start(name, call, os.path.join(os.path.dirname(server.log_path), f"{name}.log"))
    reports = {r["finished"]: r for r in server.close()}
    assert set(reports) == {name for name, _ in requests}
    return {name: (reports[name]["code"], open(os.path.join(os.path.dirname(server.log_path), f"{name}.log")).read(),
                   reports[name]["cpu"]) for name in reports}


def test_exit_codes_errors_and_output_as_the_interpreter_reports_them(tmp_path):
    server = ForkServer(str(tmp_path), ENV)
    out = run_all(server, [(what, encode_call(report, what)) for what in ("ok", "exit3", "raise", "message", "returns5")]
                  + [("unpicklable", "bm90IGEgcGlja2xl")])
    assert out["ok"][0] == 0 and "called ok tests.study.forkserver_calls" in out["ok"][1] and out["ok"][2] > 0.05
    assert out["exit3"][0] == 3
    assert out["raise"][0] == 1 and "ValueError: a named problem" in out["raise"][1]
    assert out["message"][0] == 1 and "stopped with a message" in out["message"][1]
    assert out["returns5"][0] == 5
    assert out["unpicklable"][0] == 1 and "Traceback" in out["unpicklable"][1]


def test_a_child_takes_sigterm_although_the_server_blocks_it(tmp_path):
    server = ForkServer(str(tmp_path), ENV)
    server.start("sleeper", encode_call(sleep), str(tmp_path / "sleeper.log"))
    os.kill(server.process.pid, signal.SIGTERM)     # blocked by the server
    server.terminate()                               # SIGTERM to the child, at once: the default action ends it
    (report_,) = server.close()
    assert report_["code"] == -signal.SIGTERM and server.process.returncode == 0


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    server = ForkServer(str(tmp_path), ENV)
    server.process.kill()
    with pytest.raises(ForkServerError, match="fork server exited"):
        server.finished(timeout=5)
    (tmp_path / "second").mkdir()
    with pytest.raises(ForkServerError, match="the preload failed"):
        ForkServer(str(tmp_path / "second"), ENV, preload=encode_call(fail_to_preload))


def train_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in map(json.loads, f) if r["kind"] in ("train", "eval")]


def test_a_forked_run_is_the_same_run_as_in_its_own_process(tmp_path, tiny_args):
    # The reference: recipes/train.py as a plain process. The same run as a typed request to the
    # engine's front door, forked from a server that preloaded the libraries and built the task,
    # must log the same records, bit for bit.
    plain, forked = str(tmp_path / "plain"), str(tmp_path / "forked")
    args = lambda run_dir: tiny_args(run_dir, "trainer.steps=3", "algorithm=gspo", "run.seed=7")  # noqa: E731
    reference = subprocess.run([sys.executable, TRAIN, *args(plain)], cwd=REPO, env=ENV, capture_output=True,
                               text=True, timeout=600)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    (tmp_path / "server").mkdir()
    server = ForkServer(str(tmp_path / "server"), ENV,
                        preload=encode_call(preload, load_config(tiny_args(str(tmp_path / "prewarm")))))
    out = run_all(server, [("forked", encode_call(run_job, RunRequest(load_config(args(forked)))))])
    assert out["forked"][0] == 0, out["forked"][1][-3000:]
    assert train_records(forked) == train_records(plain) and len(train_records(plain)) == 3 + 2
