#!/usr/bin/env bash
# Prepared GPU check for the Qwen2 / vLLM path (issue 6): one GPU, under 10 minutes.
#     bash scripts/gpu_check.sh            (inside the GPU container, from the repository root)
# Runs scripts/gpu_check.py under torchrun (one rank: vLLM's external launcher reads the torchrun
# environment). Prints step time and tokens/s, and a final GPU_CHECK_RESULT {json} line.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    scripts/gpu_check.py
