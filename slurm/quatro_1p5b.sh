#!/bin/bash
# QUATRO RL fine-tuning of Qwen2.5-Math-1.5B on H100 nodes (8 GPUs each), one rank per GPU.
#
#   sbatch slurm/quatro_1p5b.sh [key=value ...]                      # from the repository root
#   sbatch slurm/quatro_1p5b.sh algorithm.delta=0.05 trainer.inner_loops=4
#   sbatch --nodes=4 --time=48:00:00 slurm/quatro_1p5b.sh ...        # sbatch flags win over #SBATCH
#   QUATRO_CONTAINER_IMAGE=/images/quatro.sqsh sbatch slurm/quatro_1p5b.sh ...   # pyxis/enroot
#
# Resources: edit the #SBATCH lines below (add your partition/account). The run directory is
# runs/<job name>-<job id> unless run.dir=... is given; the job log is slurm/logs/<name>-<id>.out.
# Before the time limit (--signal) the ranks checkpoint and exit 75; the job requeues itself and
# resumes from the newest checkpoint. See docs/cluster.md.
# --signal's lead covers a step, a held-out evaluation and a save at the 2 nodes below, with
# room to spare (python recipes/plan_memory.py config=quatro_1p5b cluster.nodes=2: "preemption lead";
# tests/engine/test_memory_plan.py checks it). Fewer nodes need more: the run prints its need at start-up.
#SBATCH --job-name=quatro-1p5b
#SBATCH --nodes=2
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

# Network: Gloo (megatron's and vLLM's CPU-side groups) uses the interface that holds the first
# node's address, and the job stops before starting any rank if that is a loopback address or
# none (slurm/lib/common.sh). Name the cluster network's interface here to choose it yourself:
# export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5

QUATRO_ROOT=${QUATRO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=slurm/lib/common.sh
source "$QUATRO_ROOT/slurm/lib/common.sh" \
    || { echo "quatro-slurm: submit from the quatro-nemo root or export QUATRO_ROOT" >&2; exit 2; }
quatro_run_recipe train run.dir config=quatro_1p5b -- "$@"
