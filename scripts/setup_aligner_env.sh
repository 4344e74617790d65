#!/usr/bin/env bash
# Build (or reuse) the separate NeMo-Aligner 0.7.0 environment at .venv-aligner (CPU, Python 3.11).
# It is separate from .venv because NeMo-Aligner's container stack pins megatron-core 0.10.0
# (the main environment uses 0.16.1). Installs requirements/locks/aligner.txt (scripts/lock.sh
# writes it from requirements/aligner.txt). Cached: reinstalls only when the lock or the scripts
# changed. ALIGNER_VENV chooses the path, PYTHON the interpreter. First build ~5-10 min and
# ~3.6 GB (see docs/aligner.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/env.sh
source scripts/lib/env.sh
# mamba-ssm (a hard NeMo import) has no CPU wheel: its Python part is built from the sdist, with
# the build dependencies of requirements/aligner-uv.toml.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE checkout_env "${ALIGNER_VENV:-.venv-aligner}" \
    requirements/locks/aligner.txt 3.11 .quatro-aligner-requirements.sha --config-file requirements/aligner-uv.toml
