#!/usr/bin/env bash
# Build (or reuse) the separate NeMo-Aligner 0.7.0 environment at .venv-aligner (CPU, Python 3.11).
# It is separate from .venv because NeMo-Aligner's container stack pins megatron-core 0.10.0
# (the main environment uses 0.16.1). Cached: reinstalls only when requirements/aligner.txt or
# this script changed. First build ~5-10 min and ~3.6 GB (see docs/aligner.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${ALIGNER_VENV:-.venv-aligner}
stamp="$VENV/.quatro-aligner-requirements.sha"
want=$(cat requirements/aligner.txt scripts/setup_aligner_env.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q)
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==2.13.0" > "$constraint"   # a looser torch pulls a multi-GB CUDA build
"${pip[@]}" --upgrade pip
"${pip[@]}" -c "$constraint" torch==2.13.0 setuptools wheel packaging ninja
# mamba-ssm (a hard NeMo import) has no CPU wheel: build its Python part only.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    "${pip[@]}" -c "$constraint" --no-build-isolation mamba-ssm==2.2.2
"${pip[@]}" -c "$constraint" -r requirements/aligner.txt
# quatro_nemo from this checkout, without installing anything into the source tree.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/quatro_nemo_checkout.pth"
echo "$want" > "$stamp"
