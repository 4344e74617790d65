#!/usr/bin/env bash
# Refresh the lock files of requirements/locks/ from the requirement files: the one command.
#   bash scripts/lock.sh               # re-resolve, keeping every pin that still satisfies
#   bash scripts/lock.sh --upgrade     # newest versions the requirement files admit
# One lock per environment, every package pinned with the hashes of its files:
#   cpu.txt      .venv, Python 3.11 (scripts/bootstrap.sh test; the Dockerfile's project set)
#   train.txt    .venv for `make train` only (bootstrap.sh train): a subset of cpu.txt, same pins
#   cluster.txt  .venv-cluster, Python 3.12 (scripts/setup_cluster_env.sh), with the replacements
#                of requirements/cluster-overrides.txt
#   aligner.txt  .venv-aligner, Python 3.11 (scripts/setup_aligner_env.sh)
#   image.txt    the project's pure-Python set in the GPU image (Dockerfile, engine stack, Python
#                3.12) at the pins of cluster.txt, less what the image's stack provides
#                (requirements/image-overrides.txt); image-aligner.txt the same for the aligner
#                stack (Python 3.10)
#   image-build.txt, image-stack.txt  what the engine stage adds to vLLM's image (build tools; then
#                megatron-core and Transformer Engine), resolved against the image's torch at the
#                pins of cluster.txt: transformer-engine-torch is an sdist whose setup.py computes its
#                requirements from the installed torch, so its metadata is built with no isolation
#                by $QUATRO_IMAGE_TORCH_PYTHON (default .venv-cluster/bin/python: PyPI's torch
#                2.13.0, the image's; scripts/setup_cluster_env.sh)
#   gpu_check.txt  scripts/gpu_check.sh's offline set at the image's versions, less torch
#   uv.txt       the installer itself
# QUATRO_LOCKS="image-stack gpu_check" refreshes only those (names without .txt, in this order);
# QUATRO_LOCK_DIR writes them elsewhere (default requirements/locks; tests/vllm re-resolves there).
# The CPU torch of Python 3.11 (torch==2.13.0+cpu) is the wheel in /opt/wheels on these machines,
# not on PyPI; its locks name that folder (--find-links) and the wheel's hash. Uses $UV, else
# .venv/bin/uv, else uv on PATH. Extra arguments go to every `uv pip compile`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${UV:-}" ]; then uv=$UV
elif [ -x .venv/bin/uv ]; then uv=.venv/bin/uv
else uv=$(command -v uv) || { echo "lock.sh: no uv (bash scripts/bootstrap.sh installs it into .venv)" >&2; exit 2; }
fi
WHEELS=${QUATRO_WHEELS:-/opt/wheels}
LOCKS=requirements/locks
OUT=${QUATRO_LOCK_DIR:-$LOCKS}
ALL="uv cpu train cluster image image-aligner image-build image-stack gpu_check aligner"
selected=" ${QUATRO_LOCKS:-$ALL} "
for name in $selected; do
    [[ " $ALL " == *" $name "* ]] || { echo "lock.sh: no lock '$name' (locks: $ALL)" >&2; exit 2; }
done
compile() {  # compile NAME PYTHON_VERSION ARG...: requirements/locks/NAME.txt (into $OUT), if selected
    local name=$1 python_version=$2
    shift 2
    [[ $selected == *" $name "* ]] || return 0
    "$uv" pip compile -q --generate-hashes --python-version "$python_version" \
        --python-platform x86_64-manylinux_2_28 "$@" "${extra[@]}" -o "$OUT/$name.txt"
}
extra=("$@")
compile uv 3.11 requirements/uv.txt
compile cpu 3.11 --find-links "$WHEELS" --emit-find-links requirements/cpu.txt
compile train 3.11 --find-links "$WHEELS" --emit-find-links -c $LOCKS/cpu.txt requirements/core.txt
compile cluster 3.12 --override requirements/cluster-overrides.txt requirements/cluster.txt
compile image 3.12 --override requirements/image-overrides.txt -c $LOCKS/cluster.txt requirements/image.txt
compile image-aligner 3.10 --override requirements/image-overrides.txt requirements/image.txt
compile image-build 3.12 -c $LOCKS/cluster.txt requirements/image-build.txt
if [[ $selected == *" image-stack "* ]]; then
    torch_python=${QUATRO_IMAGE_TORCH_PYTHON:-.venv-cluster/bin/python}
    [ -x "$torch_python" ] || { echo "lock.sh: image-stack needs $torch_python (the image's torch):" \
        "bash scripts/setup_cluster_env.sh, or set QUATRO_IMAGE_TORCH_PYTHON" >&2; exit 2; }
    compile image-stack 3.12 --python "$torch_python" --no-build-isolation -c $LOCKS/cluster.txt \
        -c $LOCKS/image-build.txt requirements/image-stack.txt
fi
compile gpu_check 3.12 --override requirements/gpu_check-overrides.txt -c $LOCKS/image.txt \
    -c $LOCKS/image-stack.txt requirements/gpu_check.txt
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    compile aligner 3.11 --config-file requirements/aligner-uv.toml --find-links "$WHEELS" --emit-find-links \
    requirements/aligner.txt
