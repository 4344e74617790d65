"""The GPU image's Python stack, tested where the image cannot be built.

1. The image's compiled part resolves against the image's torch: scripts/lock.sh's own commands
   for ``locks/image-build.txt`` and ``locks/image-stack.txt`` (megatron-core, Transformer Engine
   for CUDA 13, their build tools) run again with this environment's torch (PyPI's torch 2.13.0,
   the image's), which the sdist of TE's PyTorch extension computes its requirements from (torch
   and ``transformer_engine_cu<torch's CUDA major>``), against vLLM 0.32.0's pins; they must
   succeed and give the committed pins. Seconds with uv's cache; needs PyPI, like the rest of
   this suite's environment (skipped when pypi.org cannot be reached).
2. A fresh environment gets what the Dockerfile's final stage puts into the image's Python, from
   the same locks, then must pass ``pip check`` and train the 2-step CPU default (its model and
   task; a 40-step warm-start).

The Dockerfile installs ``requirements/locks/image.txt`` (the project's pure-Python set, hash-
checked, ``--no-deps``) over a base that provides torch, numpy and megatron-core (vLLM's image plus
megatron-core; ``requirements/image-overrides.txt`` keeps them out of the lock), then runs
``pip check``. Here the base is those three at the pins of ``requirements/locks/cluster.txt``
(which the image lock is compiled against) with what they need from it, hash-checked too. vLLM
itself, Transformer Engine and apex are the image's compiled part and stay out (the cluster
environment tests vLLM's CPU build). Runs in ``.venv-cluster`` (Python 3.12, its ``uv``, and uv's
cache of the cluster lock's wheels from ``scripts/setup_cluster_env.sh``).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

from .conftest import REPO, TRAIN, launch_environment

LOCKS = REPO / "requirements" / "locks"
COMPILED_PART = ("image-build", "image-stack")     # scripts/lock.sh's names
BASE = ("torch", "numpy", "megatron-core")  # what the image's stack provides (image-overrides.txt)
MAX_LOCK_BYTES = 2_000_000


def lock_entries(path: Path) -> Dict[str, List[str]]:
    """{package: its lines (pin, hashes, "# via" comments)} of a uv lock file."""
    assert path.stat().st_size < MAX_LOCK_BYTES
    entries: Dict[str, List[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if pin:
            current = pin.group(1).lower()
            entries[current] = [line]
        elif current is not None and line.startswith(" "):
            entries[current].append(line)
        else:
            current = None
    return entries


def dependents(lines: List[str]) -> Set[str]:
    """The packages a lock entry's ``# via`` comment names (those that require it)."""
    return {m.group(1).lower() for line in lines
            if (m := re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*$", line)) and m.group(1) != "via"}


def base_requirements(cluster: Dict[str, List[str]]) -> str:
    """The base's packages and everything they need, as locked in the cluster lock."""
    needed = set(BASE)
    while True:
        more = {name for name, lines in cluster.items() if name not in needed and dependents(lines) & needed}
        if not more:
            break
        needed |= more
    return "\n".join(line for name in sorted(needed) for line in cluster[name] if not line.strip().startswith("#")) + "\n"


def pinned(path: Path) -> Dict[str, str]:
    """{package: version} of a lock file."""
    return {name: lines[0].split("==", 1)[1].split()[0] for name, lines in lock_entries(path).items()}


def test_the_images_compiled_part_resolves_against_the_images_torch(tmp_path):
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as err:
        pytest.skip(f"PyPI unreachable ({err}): the resolver needs its metadata")
    for name in COMPILED_PART:         # uv keeps a committed pin that still satisfies
        shutil.copy(LOCKS / f"{name}.txt", tmp_path / f"{name}.txt")
    env = dict(os.environ, QUATRO_LOCKS=" ".join(COMPILED_PART), QUATRO_LOCK_DIR=str(tmp_path),
               UV=str(Path(sys.prefix) / "bin" / "uv"), QUATRO_IMAGE_TORCH_PYTHON=sys.executable)
    resolved = subprocess.run(["bash", "scripts/lock.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    assert resolved.returncode == 0, resolved.stderr[-4000:]
    for name in COMPILED_PART:
        assert pinned(tmp_path / f"{name}.txt") == pinned(LOCKS / f"{name}.txt"), \
            f"locks/{name}.txt is not what the resolver gives today: bash scripts/lock.sh"


@pytest.mark.slow
def test_the_image_python_set_installs_from_its_lock_passes_pip_check_and_trains(tmp_path):
    env_dir, uv = tmp_path / "image-python", Path(sys.prefix) / "bin" / "uv"
    base_lock = tmp_path / "image-base.txt"
    base_lock.write_text(base_requirements(lock_entries(LOCKS / "cluster.txt")))
    subprocess.run([sys._base_executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    python = str(env_dir / "bin" / "python")
    installed = subprocess.run(
        [str(uv), "pip", "install", "-q", "--python", python, "--require-hashes", "--no-deps",
         "-r", str(base_lock), "-r", str(LOCKS / "image.txt")],
        capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stderr[-4000:]
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    # the 2-step CPU default (the checkout's quatro_nemo, as the image's `pip install -e .`)
    # (its model and task; a shorter warm-start and evaluation: the stack, not the learning)
    done = subprocess.run([python, TRAIN, "trainer.steps=2", "warmstart.steps=40", "eval.num_problems=8",
                           f"warmstart.cache_dir={tmp_path / 'warm'}", f"run.dir={tmp_path / 'run'}",
                           "run.progress_bar=false", "logging.tensorboard=false"],
                          env=launch_environment(PYTHONPATH=str(REPO)), cwd=str(REPO), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
