#!/bin/bash
# QUATRO through NeMo-Aligner 0.7.0 (docs/aligner.md): the same templates' launch, rendezvous,
# logs and overrides, running recipes/train_quatro_aligner.py in the NeMo-Aligner container.
#
#   QUATRO_CONTAINER_IMAGE=/images/quatro-aligner.sqsh sbatch slurm/quatro_aligner.sh \
#       pretrained_checkpoint.restore_from_path=/ckpt/qwen2p5-math-1p5b.nemo \
#       quatro.data.train_file=data/math_train.jsonl quatro.data.validation_file=data/math500.jsonl \
#       ++model.tensor_model_parallel_size=1 algorithm@model.quatro.algorithm=quatro
#
# Arguments are NeMo-style Hydra overrides of conf/aligner/gpt_quatro_actor.yaml. Build the image
# with `docker build --build-arg STACK=aligner` (Dockerfile). Checkpoints and resume are NeMo's
# exp_manager (resume_if_exists): a requeued or resubmitted job continues from the newest one.
# As with quatro_*.sh: before the time limit (--signal) the ranks finish their step, validate,
# checkpoint and exit 75, and the job requeues itself (slurm/lib/common.sh). A step plus the
# validation must fit in the 600 s; raise the @600 for long steps.
#SBATCH --job-name=quatro-aligner
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out
set -euo pipefail

QUATRO_ROOT=${QUATRO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=slurm/lib/common.sh
source "$QUATRO_ROOT/slurm/lib/common.sh" \
    || { echo "quatro-slurm: submit from the quatro-nemo root or export QUATRO_ROOT" >&2; exit 2; }
quatro_run_recipe train_quatro_aligner exp_manager.explicit_log_dir -- "$@"
