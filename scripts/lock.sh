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
#   uv.txt       the installer itself
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
compile() {
    local python_version=$1
    shift
    "$uv" pip compile -q --generate-hashes --python-version "$python_version" \
        --python-platform x86_64-manylinux_2_28 "$@" "${extra[@]}"
}
extra=("$@")
compile 3.11 requirements/uv.txt -o requirements/locks/uv.txt
compile 3.11 --find-links "$WHEELS" --emit-find-links requirements/cpu.txt -o requirements/locks/cpu.txt
compile 3.11 --find-links "$WHEELS" --emit-find-links -c requirements/locks/cpu.txt \
    requirements/core.txt -o requirements/locks/train.txt
compile 3.12 --override requirements/cluster-overrides.txt requirements/cluster.txt \
    -o requirements/locks/cluster.txt
compile 3.12 --override requirements/image-overrides.txt -c requirements/locks/cluster.txt \
    requirements/image.txt -o requirements/locks/image.txt
compile 3.10 --override requirements/image-overrides.txt requirements/image.txt \
    -o requirements/locks/image-aligner.txt
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    compile 3.11 --config-file requirements/aligner-uv.toml --find-links "$WHEELS" --emit-find-links \
    requirements/aligner.txt -o requirements/locks/aligner.txt
