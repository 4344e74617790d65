#!/usr/bin/env bash
# The GPU check: one prepared script, within 10 minutes on one H200 or H100, that asserts what it
# measures (the product itself: recipes/train.py and the engine's own pieces).
#
#     bash scripts/gpu_check.sh [WHEEL_DIR] [key=value ...]     (from anywhere; runs in the repo root)
#
# Its parts, in this order (vLLM first: the likeliest to fail); a part whose library does not
# import is reported skipped, not failed:
#   env       always: driver, CUDA, cuDNN, NCCL, package versions, TE's attention backend, megatron's
#             Adam (FusedAdam or torch's AdamW) (scripts/gpu_check_env.py)
#   engine    vLLM: the 7B run's engine alone (conf/quatro_7b.yaml's model, dummy weights, vLLM's
#             memory share of an 80 GB GPU): construction, sleep residual (vLLM's own log line),
#             push and wake seconds, decode tokens/s at 256 and 512 sequences (gpu_check_engine.py)
#   vllm      vLLM: the vLLM backend at the 1.5B shape with full recompute and the 8k token budget,
#             2 steps, then a resumed 3rd, with vllm.check_push (quatro_nemo/engine/push_check.py)
#   megatron  the megatron backend on the 0.5B model with full recompute, 2 steps + a resumed 3rd
#   packed    Transformer Engine: the megatron backend with THD-packed token-budget micro-batches, 2 steps
#   hf        an HF Qwen2 checkpoint loaded into this device's megatron model (TE's layer names where
#             TE imports) against transformers' logits, and exported back (gpu_check_hf.py)
# Each training part runs recipes/train.py config=gpu_check (conf/gpu_check.yaml; through
# scripts/gpu_check_train.py, whose only change is a reward a random policy earns half the time, so
# that every step takes optimizer steps) and the planner (recipes/plan_memory.py) for the same
# config; scripts/gpu_check_report.py then asserts:
# steps 1-3 logged, resumed, each with an optimizer step; the engine gap of every step
# (engine_gap/token_abs_mean < 0.03, seq_ratio_mean in [0.9, 1.1]; the megatron sampler's own
# log-probs too); for vllm, no weight-load warning of vLLM's in the log and every push's layer
# outputs equal to megatron's weights (engine_push/*_rel_err < 0.02); the engine probe and the HF
# round trip ran clean. It prints each
# run phase's seconds, torch.cuda peaks and host peak (kind "phases" records of metrics.jsonl:
# quatro_nemo/engine/phase_peaks.py) next to the planner's phases, and a final
# GPU_CHECK_RESULT {json} line. A line "[gpu_check] PART: ... took N s" follows every command.
# Exit code 0 when every part that ran passed (and at least one ran).
#
# key=value arguments go to every recipes/train.py, plan_memory.py and engine probe call (e.g.
# trainer.device=cpu and a tiny model.*: tests/conversion/test_gpu_check_smoke.py and
# tests/vllm/test_gpu_check_real_engine.py run this script on the CPU).
#
# Dependencies: torch (with CUDA) must be installed. When megatron-core or the other pure-Python
# dependencies (requirements/gpu_check.txt, at the GPU image's versions: locks/gpu_check.txt) do not
# import (PYTHONPATH counts: a --target folder works), they are installed hash-checked without an
# index from WHEEL_DIR (or $QUATRO_WHEELS), prepared with Python 3.12 where a registry is reachable:
#     pip download --no-deps --require-hashes --dest wheels/ -r requirements/locks/gpu_check.txt
# Environment: GPU_CHECK_PARTS (default "engine vllm megatron packed hf"), GPU_CHECK_BUDGET_S
# (seconds all parts together may take, default 540: a command still running then is stopped and
# its part fails; a part not started is "out of time"), GPU_CHECK_DIR (default
# runs/gpu_check-<UTC time>), GPU_CHECK_TOKEN_BUDGET (tokens per micro-batch of vllm and packed,
# default 8192), GPU_CHECK_DECODE_SEQUENCES (default "256 512") and GPU_CHECK_DECODE_TOKENS
# (default 256) for the engine probe, PYTHON (default: the repository's .venv, else python3), OUT
# (when set: the summary gpu_check.json and the parts' logs are copied there, at most 8 files).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1

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
budget=${GPU_CHECK_BUDGET_S:-540}
deadline=$((SECONDS + budget))
token_budget=${GPU_CHECK_TOKEN_BUDGET:-8192}
: > "$check_dir/commands.tsv"

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    # the planner plans for this GPU (its size, and vLLM's share of its exact total) unless the
    # caller chose a size
    [[ " ${overrides[*]} " == *" cluster.gpu_memory_gb="* ]] \
        || overrides=("cluster.gpu_memory_gb=$((total_mib * 1048576 / 1000000000))"
                      "cluster.gpu_total_mib=$total_mib" "${overrides[@]}")
fi

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

# timed PART LABEL COMMAND...: the command under what is left of the budget, its output appended
# to PART.log; prints and records (commands.tsv) its seconds and exit code (124: out of time).
timed() {
    local part=$1 label=$2 start=$SECONDS rc=0
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -le 0 ]; then
        say "$part: out of time before $label (GPU_CHECK_BUDGET_S=$budget spent)"
        printf '%s\t%s\t0\t124\n' "$part" "$label" >> "$check_dir/commands.tsv"
        return 124
    fi
    set +e
    timeout "$left" "$@" 2>&1 | tee -a "$check_dir/$part.log"
    rc=${PIPESTATUS[0]}
    set -e
    say "$part: $label took $((SECONDS - start)) s (exit code $rc)"
    printf '%s\t%s\t%s\t%s\n' "$part" "$label" "$((SECONDS - start))" "$rc" >> "$check_dir/commands.tsv"
    return "$rc"
}

skip() {  # skip PART REASON
    say "$1: skipped ($2)"
    echo "$2" > "$check_dir/$1.skipped"
}

# train_part PART "STEPS..." OVERRIDES...: plan, then recipes/train.py for each step count (the
# second command resumes from the first one's checkpoint).
train_part() {
    local part=$1 step_counts=$2
    shift 2
    local args=("$@" "${overrides[@]}")
    timed "$part" "plan_memory.py" "$PYTHON" recipes/plan_memory.py config=gpu_check "${args[@]}" \
        --json-file="$check_dir/$part.plan.json" || true   # a refused plan: the run fails on it too
    for steps in $step_counts; do
        start_memory_sampler "$check_dir/$part.steps$steps.memory"
        local rc=0
        timed "$part" "train.py trainer.steps=$steps" "$PYTHON" scripts/gpu_check_train.py config=gpu_check \
            run.dir="$check_dir/$part" trainer.steps="$steps" run.progress_bar=false logging.tensorboard=false \
            "${args[@]}" || rc=$?
        stop_memory_sampler
        [ "$rc" = 0 ] || break
    done
}

python_has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }
vllm_imports=$(python_has vllm && echo 1 || echo 0)   # once: importing vLLM takes seconds

timed env "gpu_check_env.py" "$PYTHON" scripts/gpu_check_env.py --json-file "$check_dir/env.json" || true
for part in ${GPU_CHECK_PARTS:-engine vllm megatron packed hf}; do
    case $part in
        engine)
            if [ "$vllm_imports" = 0 ]; then skip engine "vllm is not importable"; continue; fi
            timed engine "gpu_check_engine.py (config=quatro_7b)" "$PYTHON" scripts/gpu_check_engine.py \
                --json-file "$check_dir/engine.json" --sequences "${GPU_CHECK_DECODE_SEQUENCES:-256 512}" \
                --new-tokens "${GPU_CHECK_DECODE_TOKENS:-256}" "${overrides[@]}" || true ;;
        vllm)
            if [ "$vllm_imports" = 0 ]; then skip vllm "vllm is not importable"; continue; fi
            # Qwen2.5-Math-1.5B's shape (conf/quatro_1p5b.yaml), random weights
            train_part vllm "2 3" rollout.backend=vllm model.hidden_size=1536 model.num_layers=28 \
                model.num_attention_heads=12 model.num_query_groups=2 model.ffn_hidden_size=8960 \
                model.rotary_base=10000 "parallel.max_tokens_per_micro_batch=$token_budget" vllm.check_push=true ;;
        megatron)
            train_part megatron "2 3" rollout.backend=megatron ;;
        packed)
            # the megatron backend with token-budget micro-batches packed into THD sequences
            if ! python_has transformer_engine; then
                skip packed "transformer_engine is not importable (THD packing needs it)"; continue
            fi
            train_part packed "2" rollout.backend=megatron "parallel.max_tokens_per_micro_batch=$token_budget" \
                parallel.sequence_packing=true ;;
        hf)
            timed hf "gpu_check_hf.py" "$PYTHON" scripts/gpu_check_hf.py --json-file "$check_dir/hf.json" || true ;;
        *)
            die "GPU_CHECK_PARTS: unknown part '$part' (engine vllm megatron packed hf)" ;;
    esac
done

rc=0
"$PYTHON" scripts/gpu_check_report.py "$check_dir" || rc=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then  # the summary and each part's log (its last 8 MB)
    for log in "$check_dir"/*.log; do
        [ -e "$log" ] && tail -c 8000000 "$log" > "$OUT/$(basename "$log")"
    done
    cp "$check_dir/commands.tsv" "$OUT/"
fi
exit "$rc"
