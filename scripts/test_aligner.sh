#!/usr/bin/env bash
# Build (or reuse) the NeMo-Aligner 0.7.0 environment and run tests/aligner in it (docs/aligner.md).
# Extra arguments go to pytest. ALIGNER_VENV=PATH puts the environment elsewhere (e.g. a cache
# outside the checkout); this checkout is put first on PYTHONPATH, so it is what gets tested.
# The TensorRT-LLM export chain (GPU-only, never called on CPU) is replaced by the test-only
# import hook tests/aligner/site/sitecustomize.py; nothing else is stubbed.
set -euo pipefail
cd "$(dirname "$0")/.."
export ALIGNER_VENV=${ALIGNER_VENV:-.venv-aligner}
bash scripts/setup_aligner_env.sh
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/tests/aligner/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$ALIGNER_VENV/bin/python" -m pytest tests/aligner "$@"
