#!/usr/bin/env bash
# Start one recipe process. Used as the Docker ENTRYPOINT and as the per-rank command under srun.
#
#   launch.sh RECIPE [key=value ...]
#
# RECIPE is a name in recipes/ (train, evaluate, prepare_data, ...) or a path to a .py script;
# anything else that is a command on PATH (bash, python, ...) is run as given, so
# `docker run IMAGE bash` still works. Under srun (one process per rank) it exports the
# torch.distributed variables from SLURM's: RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS,
# LOCAL_RANK=SLURM_LOCALID; MASTER_ADDR and MASTER_PORT come from the batch script
# (slurm/lib/common.sh), and with QUATRO_CACHE_DIR (common.sh: per job, node-local) each rank gets
# its own TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and VLLM_CACHE_ROOT under
# $QUATRO_CACHE_DIR/rank$RANK unless set. The repository this file lives in comes first on PYTHONPATH, so a
# checkout mounted into the container runs its own code with the image's dependencies.
# Python: $QUATRO_PYTHON, else the repository's .venv, else python3. Recipe names are looked up
# in $QUATRO_RECIPES_DIR (default: the repository's recipes/).
#
# CUDA forward compatibility, before Python starts: when the driver (nvidia-smi) is older than
# the branch the image's CUDA needs, $QUATRO_CUDA_MIN_DRIVER (default 580: CUDA 13.0, the engine
# image; the Dockerfile sets it per stack), and the image has CUDA's forward-compatibility
# libraries ($QUATRO_CUDA_COMPAT_DIR, default /usr/local/cuda/compat; empty: never), that folder
# goes first on LD_LIBRARY_PATH. Otherwise nothing changes. It must happen here: the dynamic
# linker reads LD_LIBRARY_PATH once, when a process starts, so vLLM's own switch
# (VLLM_ENABLE_CUDA_COMPATIBILITY, vllm/env_override.py: it edits os.environ before importing
# torch) reaches only the processes vLLM starts, not a rank that runs the engine in-process; and
# neither `docker run` nor pyxis runs an entrypoint of the base image here (this file is the
# entrypoint). Forward compatibility works on data-center GPUs only (NVIDIA's CUDA compatibility
# guide); docs/cluster.md ("Driver") has NVIDIA_DISABLE_REQUIRE for pyxis.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RECIPES=${QUATRO_RECIPES_DIR:-$ROOT/recipes}

die() { echo "launch.sh: $*" >&2; exit 2; }

# The driver's branch (the major of nvidia-smi's driver_version, first GPU); empty without a
# working nvidia-smi (a CPU node, or no GPU in the step).
driver_branch() {
    local version
    version=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1) || return 0
    if [[ $version =~ ^([0-9]+)\. ]]; then
        echo "${BASH_REMATCH[1]}"
    fi
}

compat_dir=${QUATRO_CUDA_COMPAT_DIR-/usr/local/cuda/compat}
if [ -n "$compat_dir" ] && [ -d "$compat_dir" ]; then
    branch=$(driver_branch)
    min_branch=${QUATRO_CUDA_MIN_DRIVER:-580}
    if [ -n "$branch" ] && [ "$branch" -lt "$min_branch" ]; then
        export LD_LIBRARY_PATH=$compat_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        if [ "${LOCAL_RANK:-${SLURM_LOCALID:-0}}" = 0 ]; then
            echo "launch.sh: driver R$branch < R$min_branch: CUDA forward compatibility from $compat_dir" >&2
        fi
    fi
fi

[ $# -ge 1 ] || die "usage: launch.sh RECIPE [key=value ...] (RECIPE: a script name in $RECIPES, or a .py path)"
recipe=$1
shift

case $recipe in
    *.py) script=$recipe ;;
    */*) script=$recipe ;;
    *) script=$RECIPES/$recipe.py ;;
esac
if [ ! -f "$script" ]; then
    if [[ $recipe != *.py && $recipe != */* ]] && command -v "$recipe" >/dev/null; then
        exec "$recipe" "$@"
    fi
    die "no recipe '$recipe' (looked for $script)"
fi

if [ -n "${SLURM_STEP_ID:-}" ] && [ -n "${SLURM_PROCID:-}" ] && [ -z "${RANK:-}" ]; then
    export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
    if [ "$WORLD_SIZE" -gt 1 ]; then
        [ -n "${MASTER_ADDR:-}" ] && [ -n "${MASTER_PORT:-}" ] \
            || die "rank $RANK of $WORLD_SIZE: MASTER_ADDR/MASTER_PORT not set (start ranks through slurm/lib/common.sh)"
    fi
fi

# Compile and library caches of this rank under the job's QUATRO_CACHE_DIR (common.sh), unless
# already set: ranks never share (or race on) one cache directory, and $HOME is not written (the
# container does not mount it: a HOME that is not writable is replaced by one in the cache).
if [ -n "${QUATRO_CACHE_DIR:-}" ]; then
    rank_cache=$QUATRO_CACHE_DIR/rank${RANK:-0}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$rank_cache/triton}
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$rank_cache/inductor}
    export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$rank_cache/vllm}
    export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$rank_cache/xdg-cache}
    export XDG_CONFIG_HOME=${XDG_CONFIG_HOME:-$rank_cache/xdg-config}
    export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$rank_cache/cuda-compute-cache}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$rank_cache/flashinfer}
    if [ -z "${HOME:-}" ] || [ ! -w "$HOME" ]; then
        export HOME=$rank_cache/home
        mkdir -p "$HOME"
    fi
fi

# One line per rank start in the run directory (common.sh sets the file): which node and pid ran
# which rank, and the rendezvous it was given.
if [ -n "${QUATRO_RANK_LOG:-}" ]; then
    printf '{"job_id": "%s", "restart_count": "%s", "rank": %s, "local_rank": %s, "world_size": %s, "node": "%s", "host": "%s", "pid": %s, "master_addr": "%s", "master_port": "%s"}\n' \
        "${SLURM_JOB_ID:-}" "${SLURM_RESTART_COUNT:-0}" "${RANK:-0}" "${LOCAL_RANK:-0}" "${WORLD_SIZE:-1}" \
        "${SLURMD_NODENAME:-}" "$(hostname)" "$$" "${MASTER_ADDR:-}" "${MASTER_PORT:-}" >> "$QUATRO_RANK_LOG"
fi

if [ -n "${QUATRO_PYTHON:-}" ]; then
    python=$QUATRO_PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
    python=$ROOT/.venv/bin/python
else
    python=python3
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
exec "$python" "$script" "$@"
