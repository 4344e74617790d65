"""Fixtures of the SLURM tests: a real local cluster (session) and the recipe the jobs run.

See slurm_cluster.py for what they provide and QUATRO_SLURM_TEST_RECIPE.
"""
from __future__ import annotations

import fcntl
import os
import subprocess

import pytest

from .slurm_cluster import SLURM_LOCAL, STATE_DIR, LocalSlurm, Recipe, real_recipe, standin_recipe, unavailable


@pytest.fixture(scope="session")
def recipe(tmp_path_factory) -> Recipe:
    choice = os.environ.get("QUATRO_SLURM_TEST_RECIPE", "real")
    if choice == "standin":
        return standin_recipe(tmp_path_factory.mktemp("slurm-recipes"))
    if choice == "real":
        return real_recipe(tmp_path_factory.mktemp("slurm-real-recipe"))
    raise ValueError(f"QUATRO_SLURM_TEST_RECIPE must be 'real' or 'standin', got {choice!r}")


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("the local SLURM cluster needs root (slurmd runs jobs as the submitting user)")
    install = subprocess.run(["bash", str(SLURM_LOCAL), "install"], capture_output=True, text=True)
    if install.returncode != 0:
        unavailable(f"cannot install SLURM: {install.stderr[-2000:]}")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    lock = open(STATE_DIR / "tests.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one test session at a time drives the cluster
    env = dict(os.environ, SLURM_CONF=str(STATE_DIR / "etc" / "slurm.conf"), OMP_NUM_THREADS="1")
    cluster = LocalSlurm(env=env, log_dir=tmp_path_factory.mktemp("slurm-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
