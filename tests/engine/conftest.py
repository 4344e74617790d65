"""A tiny, fast version of the CPU default for end-to-end tests of the training loop."""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "recipes" / "train.py")
CONVERT = str(REPO / "recipes" / "convert_checkpoint.py")

# Small everything: a 2-layer model, a short warm-start (cached per test session), 8 prompts x 4.
TINY = [
    "model.hidden_size=32", "model.ffn_hidden_size=64", "model.max_position_embeddings=48",
    "warmstart.steps=40", "warmstart.batch_size=32",
    "task.num_train=64", "task.num_heldout=8",
    "trainer.prompts_per_step=8", "trainer.checkpoint_every=1",
    "rollout.n=4", "rollout.max_new_tokens=24",
    "parallel.micro_batch_size=16",
    "eval.num_problems=4", "eval.n_samples=4",
    "logging.tensorboard=false", "run.progress_bar=false",
]


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """One warm-start cache for the whole test session, shared by pytest-xdist's workers (their
    base temporary directories sit side by side in the session's): each base model is trained
    once, not once per worker. The cache writes each file atomically (warmstart._save_atomic), so
    two workers building the same one at once both read a complete file."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "warmstart-cache"
        shared.mkdir(exist_ok=True)
        return str(shared)
    return str(tmp_path_factory.mktemp("warmstart-cache"))


@pytest.fixture
def tiny_args(warm_cache):
    def make(run_dir, *extra):
        return TINY + [f"warmstart.cache_dir={warm_cache}", f"run.dir={run_dir}", *extra]
    return make


def run_train(args, nproc=1, timeout=600, **popen):
    """Start recipes/train.py (under torchrun when nproc > 1) as a subprocess."""
    return run_recipe(TRAIN, args, nproc, **popen)


def run_recipe(script, args, nproc=1, **popen):
    """Start the recipe ``script`` (under torchrun when nproc > 1) as a subprocess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        command = [sys.executable, script, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", script, *args]
    return subprocess.Popen(command, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)
