#!/usr/bin/env bash
# Build (or reuse) the NeMo-Aligner 0.7.0 environment (.venv-aligner) and run tests/aligner in it.
# Extra arguments go to pytest. The TensorRT-LLM export chain (GPU-only, never called on CPU) is
# replaced by the test-only import hook tests/aligner/site/sitecustomize.py; nothing else is stubbed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_aligner_env.sh
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/tests/aligner/site${PYTHONPATH:+:$PYTHONPATH}"
.venv-aligner/bin/python -m pytest tests/aligner "$@"
