#!/bin/bash
# n = 256 evaluation of a checkpoint with recipes/evaluate.py on one H100 node (one process; the
# sampler uses the node's GPUs).
#
#   sbatch slurm/eval.sh checkpoint=runs/quatro-1p5b-123/checkpoints/step_100 \
#       data=[data/math500.jsonl] name=quatro            # from the repository root
#
# Arguments are recipes/evaluate.py's Hydra overrides (keys: conf/evaluate.yaml, `--cfg job`);
# num_samples defaults to 256 (the paper's n) and out to runs/<job name>-<job id>; any you pass win.
#SBATCH --job-name=quatro-eval
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out
set -euo pipefail

QUATRO_ROOT=${QUATRO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=slurm/lib/common.sh
source "$QUATRO_ROOT/slurm/lib/common.sh" \
    || { echo "quatro-slurm: submit from the quatro-nemo root or export QUATRO_ROOT" >&2; exit 2; }
quatro_run_recipe evaluate out num_samples=256 -- "$@"
