"""Helpers for the SLURM tests: the local cluster driver and the recipe the jobs run.

The session fixture `local_slurm` installs SLURM if needed (apt-get, root), starts it with
scripts/slurm_local.sh, and stops the daemons it started when the session ends. Without root it
skips; under CI (CI=true) a cluster that cannot be installed or started is an error, not a skip.

Which training entry point the jobs run (QUATRO_SLURM_TEST_RECIPE):
  real     recipes/train.py on the embedded CPU default, made tiny by overrides (the default)
  standin  tests/slurm/standin_train.py: the same contract in 4 float64 parameters, for
           developing the cluster tooling quickly
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_LOCAL = ROOT / "scripts" / "slurm_local.sh"
STATE_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", ROOT / ".slurm-local"))
IN_CI = os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"local SLURM needed in CI: {reason}")
    pytest.skip(reason)


@dataclass
class Recipe:
    """How the tests drive one training entry point through the templates."""

    name: str
    env: Dict[str, str]          # extra environment for sbatch
    tiny: List[str]              # overrides for a short run
    long: List[str]              # overrides for a run long enough to be signalled mid-way
    failing: List[str]           # overrides that make it fail for a real reason
    seed_key: str                # the override that changes the run's random stream
    update_key: str              # a metric that is non-zero once the model is being updated

    def metrics(self, run_dir: Path) -> List[dict]:
        """metrics.jsonl without wall-clock timings and phase measurements (which differ between
        any two runs)."""
        from quatro_nemo.engine.logging import deterministic_view

        path = run_dir / "metrics.jsonl"
        return deterministic_view(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def standin_recipe(tmp_dir: Path) -> Recipe:
    recipes = tmp_dir / "standin_recipes"
    recipes.mkdir(exist_ok=True)
    link = recipes / "train.py"
    if not link.exists():
        link.symlink_to(Path(__file__).parent / "standin_train.py")
    return Recipe(
        name="standin",
        env={"QUATRO_RECIPES_DIR": str(recipes)},
        tiny=["trainer.steps=3", "trainer.step_seconds=0"],
        long=["trainer.steps=8", "trainer.step_seconds=1.0"],
        failing=["trainer.fail_at_step=1"],
        seed_key="seed",
        update_key="loss",
    )


def real_recipe(tmp_dir: Path) -> Recipe:
    """recipes/train.py on the embedded CPU default, made tiny.

    `config=config` selects conf/config.yaml (the CPU task) over the template's cluster config;
    `trainer.device=cpu` keeps it off any GPU. The 200-step warm-start leaves a base model that
    solves a few problems, so rewards and gradients are non-zero and a resumed run has real
    model and optimizer state to restore. It is trained once here, into this session's cache,
    and every job loads it.
    """
    tiny = [
        "config=config", "trainer.device=cpu", "run.progress_bar=false",
        "warmstart.steps=200", "warmstart.all_numbers=0", f"warmstart.cache_dir={tmp_dir / 'warmstart-cache'}",
        "task.num_train=64", "task.num_heldout=16",
        "trainer.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=12",
        "parallel.micro_batch_size=8", "eval.num_problems=0", "logging.tensorboard=false",
        "trainer.checkpoint_every=1",
    ]
    prewarm = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), *tiny, "trainer.steps=1",
         f"run.dir={tmp_dir / 'prewarm'}"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    if prewarm.returncode != 0:
        raise RuntimeError(f"warm-start for the SLURM tests failed:\n{prewarm.stdout[-3000:]}{prewarm.stderr[-3000:]}")
    return Recipe(
        name="real",
        env={},
        tiny=tiny + ["trainer.steps=2"],
        long=tiny + ["trainer.steps=6"],
        failing=tiny + ["trainer.steps=2", "algorithm.delta=-1"],
        seed_key="run.seed",
        update_key="grad_norm",
    )


@dataclass
class LocalSlurm:
    """Submit, watch and inspect jobs on the cluster started by scripts/slurm_local.sh."""

    env: Dict[str, str]
    nodes: Optional[int] = None
    log_dir: Optional[Path] = None
    started: bool = field(default=False)

    def _run(self, *args: str, env: Optional[Dict[str, str]] = None, check=True) -> str:
        result = subprocess.run(args, cwd=ROOT, env={**self.env, **(env or {})}, text=True,
                                capture_output=True, timeout=120)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def ensure(self, nodes: int) -> None:
        """Have a running cluster of `nodes` nodes (1: this host; 2+: fake nodes n1..)."""
        if self.nodes == nodes:
            return
        self.stop()
        self._run("bash", str(SLURM_LOCAL), "start", str(nodes))
        self.started = True
        self.nodes = nodes

    def stop(self) -> None:
        if self.started:
            self._run("bash", str(SLURM_LOCAL), "stop", check=False)
            self.started = False
            self.nodes = None

    def sbatch(self, *args: str, env: Optional[Dict[str, str]] = None) -> str:
        return self._run("sbatch", "--parsable", *args, env=env).strip().split(";")[0]

    def run(self, *args: str, env: Optional[Dict[str, str]] = None) -> str:
        return self._run(*args, env=env)

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job` as a dict (kept for MinJobAge=600 s after the job ends)."""
        text = self._run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def state(self, job_id: str) -> str:
        return self.job(job_id)["JobState"]

    def wait_until(self, predicate, timeout: float, what: str, poll: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")

    def wait_done(self, job_ids: List[str], timeout: float = 300) -> Dict[str, Dict[str, str]]:
        """Poll squeue until none of the jobs (or array jobs) is pending or running."""
        def finished():
            listed = self._run("squeue", "-h", "-o", "%i %A", "-j", ",".join(job_ids), check=False)
            return not listed.strip()
        self.wait_until(finished, timeout, f"jobs {job_ids} to end")
        return {j: self.job(j) for j in job_ids}


def expected_master_port(job_id: str, restart_count: int = 0) -> str:
    """The rendezvous port slurm/lib/common.sh documents for a job and restart."""
    return str(20000 + (int(job_id) % 2000) * 10 + restart_count % 10)


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
