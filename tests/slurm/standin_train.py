"""A tiny stand-in for recipes/train.py that follows the training entry point's contract.

Contract (docs/interfaces.md, "Training entry point"): `key=value` overrides; one process per
rank with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; `run.dir=PATH` holds
`metrics.jsonl`, `world.json` and `checkpoints/`; a restart resumes from the newest complete
checkpoint; SIGUSR1/SIGTERM -> checkpoint at the next step boundary and exit 75.

It trains a 4-parameter least-squares model with data-parallel SGD over gloo, in float64, so
an interrupted and resumed run gives bit-identical metrics to an uninterrupted one. The SLURM
tests use it to check the cluster tooling itself; the same tests run the real recipe too.

Overrides: run.dir (required), trainer.steps (8), trainer.step_seconds (0.2: sleep per step,
so a signal can land mid-run), trainer.lr (0.1), seed (0), trainer.fail_at_step (-1: exit 1
there, a "real" failure).
"""

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

EXIT_REQUEUE = 75
DEFAULTS = {
    "trainer.steps": "8",
    "trainer.step_seconds": "0.2",
    "trainer.lr": "0.1",
    "seed": "0",
    "trainer.fail_at_step": "-1",
}


def parse_overrides(argv):
    config = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"standin_train.py: argument {arg!r} is not key=value")
        config[key.lstrip("+")] = value
    if "run.dir" not in config:
        raise SystemExit("standin_train.py: run.dir=PATH is required")
    return config


def step_data(seed, step, rank):
    """This rank's shard of the batch of one step: 8 rows of x in R^4 and y = x . w_true."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    w_true = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    return x, x @ w_true


def latest_checkpoint(checkpoint_dir):
    steps = sorted(int(p.stem.split("_")[1]) for p in checkpoint_dir.glob("step_*.pt"))
    return (checkpoint_dir / f"step_{steps[-1]}.pt") if steps else None


def main():
    config = parse_overrides(sys.argv[1:])
    run_dir = Path(config["run.dir"])
    checkpoint_dir = run_dir / "checkpoints"
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))

    def all_reduce(tensor, op=dist.ReduceOp.SUM):
        if world_size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    stop_requested = torch.zeros(1)

    def request_stop(signum, frame):
        stop_requested.fill_(1.0)

    signal.signal(signal.SIGUSR1, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    me = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "host": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME", ""),
        "pid": os.getpid(),
        "master_addr": os.environ.get("MASTER_ADDR", ""),
        "master_port": os.environ.get("MASTER_PORT", ""),
    }
    world = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(world, me)
    else:
        world = [me]

    weights = torch.zeros(4, dtype=torch.float64)
    start_step = 0
    checkpoint = latest_checkpoint(checkpoint_dir)
    if checkpoint is not None:
        state = torch.load(checkpoint)
        weights, start_step = state["weights"], state["step"]
    if rank == 0:
        print(f"[standin] world {world_size} | steps {start_step}->{config['trainer.steps']} | run dir {run_dir}",
              flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_dir.mkdir(exist_ok=True)
        (run_dir / "world.json").write_text(json.dumps({"ranks": world}, indent=1))
        metrics_path = run_dir / "metrics.jsonl"
        kept = []
        if metrics_path.exists():  # drop metrics of steps after the checkpoint we resume from
            kept = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] < start_step]
        metrics_path.write_text("".join(l + "\n" for l in kept))

    def save(step):
        if rank == 0:
            tmp = checkpoint_dir / f".step_{step}.tmp"
            torch.save({"weights": weights, "step": step}, tmp)
            tmp.rename(checkpoint_dir / f"step_{step}.pt")
        if world_size > 1:
            dist.barrier()

    lr = float(config["trainer.lr"])
    seed = int(config["seed"])
    for step in range(start_step, int(config["trainer.steps"])):
        if step == int(config["trainer.fail_at_step"]):
            print(f"rank {rank}: failing at step {step} as asked", flush=True)
            sys.exit(1)
        if all_reduce(stop_requested.clone(), dist.ReduceOp.MAX).item() > 0:
            save(step)
            print(f"rank {rank}: stop requested, checkpoint at step {step}, exit {EXIT_REQUEUE}", flush=True)
            sys.exit(EXIT_REQUEUE)
        x, y = step_data(seed, step, rank)
        residual = x @ weights - y
        loss = all_reduce((residual**2).mean()) / world_size
        grad = all_reduce(2 * x.T @ residual / len(y)) / world_size
        weights = weights - lr * grad
        save(step + 1)
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "w": weights.tolist()}) + "\n")
        time.sleep(float(config["trainer.step_seconds"]))
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
