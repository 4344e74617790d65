#!/usr/bin/env python
"""Train with QUATRO (or any registered baseline) on megatron-core.

    python recipes/train.py                                   # the embedded CPU default
    python recipes/train.py algorithm=gspo trainer.inner_loops=4 algorithm.clip_low=3e-4
    python recipes/train.py config=quatro_1p5b run.dir=/scratch/runs/q1p5b
    torchrun --nproc-per-node 2 recipes/train.py parallel.tensor=2
    python recipes/train.py -m algorithm=quatro,gspo trainer.steps=2     # two runs: <run.dir>/0, <run.dir>/1
    python recipes/train.py config=quatro_7b --cfg job                   # print the composed config

A Hydra app (hydra-core 1.3) over conf/: arguments are Hydra overrides (``key=value``,
``group=option``, ``++key=value``) and flags (``-m``, ``--cfg job``, ``--help``); ``config=NAME``
chooses the primary config conf/NAME.yaml (Hydra's ``--config-name``). See
quatro_nemo/engine/config.py and the README. Exit codes: 0 done; 1 Hydra rejected an override
(its message names the key) or training failed; 2 a config value failed validation (the message
names the key); 75 preempted. Re-running the same command resumes from the newest checkpoint in
run.dir. SIGUSR1/SIGTERM save a checkpoint and exit with code 75 (requeue me); the SLURM
templates rely on it.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The imports of torch, megatron and the engine are inside main(): dist_checkpointing's writer
# starts a ``spawn`` Manager at the first checkpoint, and a spawned process re-runs this file's top
# level (as __mp_main__), so heavy imports here would cost every training process ~2 s more.


def main(argv) -> int:
    """Run the Hydra app on ``argv`` (``config=NAME`` -> ``--config-name=NAME``); the exit code."""
    import hydra
    from omegaconf import DictConfig

    from quatro_nemo.engine.config import (CONF_DIR, DEFAULT_PRIMARY, HYDRA_VERSION_BASE, config_errors_exit,
                                           hydra_job_config, register_configs, run_hydra_app)
    from quatro_nemo.engine.api import RunRequest, run
    from quatro_nemo.megatron.preemption import preemption_exits

    register_configs()

    @hydra.main(config_path=CONF_DIR, config_name=DEFAULT_PRIMARY, version_base=HYDRA_VERSION_BASE)
    def train_job(cfg: DictConfig) -> None:
        """One training run (each job of a multirun is one). Exits are SystemExit, which Hydra passes on."""
        with config_errors_exit():
            config = hydra_job_config(cfg)
        with preemption_exits():
            run(RunRequest(config))

    return run_hydra_app(train_job, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
