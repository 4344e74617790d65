#!/usr/bin/env bash
# The GPU check: the product's own recipes/train.py on one GPU, in under 10 minutes.
#
#     bash scripts/gpu_check.sh [WHEEL_DIR] [key=value ...]     (from anywhere; runs in the repo root)
#
# conf/gpu_check.yaml: a randomly initialised Qwen2-0.5B (conf/model/qwen2_0p5b.yaml, no download)
# with the cluster configs' settings scaled down to one GPU. For each rollout backend (megatron,
# then vllm where `import vllm` works, then "packed": megatron with token-budget micro-batches
# packed into THD sequences where Transformer Engine imports; a missing one is reported skipped):
#   1. recipes/train.py config=gpu_check rollout.backend=B trainer.steps=2   (checkpoints each step)
#   2. the same command with trainer.steps=3: resumes from its step-2 checkpoint, trains step 3
# then prints, per backend, step time, tokens/s, the training state's offload/reload seconds around
# vLLM's rollouts (pinned host buffers on a GPU) and the peak GPU memory (nvidia-smi, sampled every
# 0.5 s) next to the prediction of recipes/plan_memory.py, and a final GPU_CHECK_RESULT {json} line
# (also $OUT/gpu_check.json when $OUT is set). Exit code 0 when every attempted run passed.
# key=value arguments go to every recipes/train.py and plan_memory.py call (e.g. trainer.device=cpu
# and a tiny model.*: tests/conversion/test_gpu_check_smoke.py runs this script on the CPU).
#
# Dependencies: torch (with CUDA) must be installed. When megatron-core or the other pure-Python
# dependencies (requirements/gpu_check.txt, at the GPU image's versions: locks/gpu_check.txt) are
# missing, they are installed hash-checked without an index from WHEEL_DIR (or $QUATRO_WHEELS),
# prepared with Python 3.12 where a registry is reachable:
#     pip download --no-deps --require-hashes --dest wheels/ -r requirements/locks/gpu_check.txt
# Environment: GPU_CHECK_DIR (run directories; default runs/gpu_check-<UTC time>),
# GPU_CHECK_BACKENDS (default "megatron vllm packed"), GPU_CHECK_TOKEN_BUDGET (packed: tokens per
# micro-batch, default 8192), GPU_CHECK_BUDGET_S (seconds all train.py commands
# together may take, default 540: a command is stopped when the budget is spent and the check fails),
# PYTHON (default: the repository's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

die() { echo "gpu_check: $*" >&2; exit 2; }
say() { echo "[gpu_check] $*"; }

wheels=${QUATRO_WHEELS:-}
if [ $# -gt 0 ] && [[ $1 != *=* ]]; then
    wheels=$1
    shift
fi
overrides=("$@")

if ! "$PYTHON" -c "import megatron.core, omegaconf, hydra, scipy, safetensors" 2>/dev/null; then
    [ -n "$wheels" ] || die "megatron-core (or another requirements/gpu_check.txt package) is missing: pass a wheel directory (bash scripts/gpu_check.sh WHEEL_DIR; see this script's header)"
    [ -d "$wheels" ] || die "wheel directory '$wheels' not found"
    say "installing requirements/locks/gpu_check.txt from $wheels (no index)"
    # no build isolation: antlr4-python3-runtime 4.9.3 is an sdist, built with the installed setuptools
    "$PYTHON" -m pip install --no-index --find-links "$wheels" --no-deps --require-hashes --no-build-isolation \
        -r requirements/locks/gpu_check.txt
fi

check_dir=${GPU_CHECK_DIR:-runs/gpu_check-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$check_dir"
check_dir=$(cd "$check_dir" && pwd)

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    # the planner sizes vLLM against this GPU unless the caller chose a size
    [[ " ${overrides[*]} " == *" cluster.gpu_memory_gb="* ]] \
        || overrides=("cluster.gpu_memory_gb=$((total_mib * 1048576 / 1000000000))" "${overrides[@]}")
fi

say "memory plan (recipes/plan_memory.py config=gpu_check rollout.backend=vllm ${overrides[*]})"
"$PYTHON" recipes/plan_memory.py config=gpu_check rollout.backend=vllm "${overrides[@]}" --json-file="$check_dir/plan.json"

sampler=""
start_memory_sampler() {  # start_memory_sampler FILE: nvidia-smi's used memory (MiB) every 0.5 s
    [ "$gpu" = 1 ] || return 0
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$1" &
    sampler=$!
}
stop_memory_sampler() {
    [ -n "$sampler" ] || return 0
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    sampler=""
}
trap stop_memory_sampler EXIT

deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))
backends=()
for backend in ${GPU_CHECK_BACKENDS:-megatron vllm packed}; do
    if [ "$backend" = vllm ] && ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
        say "vllm: skipped (vllm is not importable here)"
        echo "vllm is not importable" > "$check_dir/vllm.skipped"
        continue
    fi
    # "packed": the megatron backend with token-budget micro-batches packed into THD sequences
    # (Transformer Engine only), beside the padded "megatron" run: tokens/s both ways.
    engine=$backend
    batching=()
    if [ "$backend" = packed ]; then
        if ! "$PYTHON" -c "import transformer_engine" >/dev/null 2>&1; then
            say "packed: skipped (Transformer Engine is not importable here; THD packing needs it)"
            echo "transformer_engine is not importable" > "$check_dir/packed.skipped"
            continue
        fi
        engine=megatron
        batching=("parallel.max_tokens_per_micro_batch=${GPU_CHECK_TOKEN_BUDGET:-8192}" parallel.sequence_packing=true)
    fi
    backends+=("$backend")
    run_dir=$check_dir/$backend
    for steps in 2 3; do  # the second command resumes from the first one's checkpoint
        say "$backend: recipes/train.py config=gpu_check rollout.backend=$engine ${batching[*]} trainer.steps=$steps"
        if [ "$SECONDS" -ge "$deadline" ]; then
            say "$backend: out of time (GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-540} spent)"
            break
        fi
        start_memory_sampler "$check_dir/$backend.steps$steps.memory"
        if ! timeout "$((deadline - SECONDS))" "$PYTHON" recipes/train.py config=gpu_check \
                rollout.backend="$engine" run.dir="$run_dir" trainer.steps="$steps" run.progress_bar=false \
                logging.tensorboard=false "${batching[@]}" "${overrides[@]}" 2>&1 | tee -a "$check_dir/$backend.log"; then
            say "$backend: recipes/train.py trainer.steps=$steps failed (log: $check_dir/$backend.log)"
            stop_memory_sampler
            break
        fi
        stop_memory_sampler
    done
done

exec "$PYTHON" scripts/gpu_check_report.py "$check_dir" "${backends[@]}"
