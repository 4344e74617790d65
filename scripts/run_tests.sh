#!/usr/bin/env bash
# The project's one test command (README and .ci/run call it): installs what the tests need,
# runs the main suite in .venv, then builds (or reuses) the real-vLLM environment .venv-vllm and
# runs tests/vllm in it (scripts/setup_vllm_env.sh: vLLM's CPU build through recipes/train.py),
# then the NeMo-Aligner environment .venv-aligner and tests/aligner in it
# (scripts/test_aligner.sh, docs/aligner.md). Exit 0 only if every suite passes; their closing
# pytest lines are repeated at the end.
# Extra arguments go to the main suite's pytest, and then only the main suite runs (the aligner
# suite alone: bash scripts/test_aligner.sh [pytest arguments]).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# System packages: bubblewrap is the code sandbox (docs/sandbox.md); python3-numpy is imported by
# HumanEval+/MBPP+ programs inside it. The SLURM tests install their own (scripts/slurm_local.sh).
if ! command -v bwrap >/dev/null || ! /usr/bin/python3 -c "import numpy" 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3-numpy >/dev/null
    else
        echo "run_tests.sh: install bubblewrap and python3-numpy (apt-get) for the sandbox tests" >&2
    fi
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

main_rc=0
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@" 2>&1 | tee "$logs/main" || main_rc=$?
if [ $# -gt 0 ]; then
    echo "run_tests.sh: pytest arguments given: only the main suite ran (aligner suite: bash scripts/test_aligner.sh)"
    exit "$main_rc"
fi

vllm_start=$SECONDS
vllm_rc=0
{ bash scripts/setup_vllm_env.sh && .venv-vllm/bin/python -m pytest tests/vllm; } 2>&1 | tee "$logs/vllm" || vllm_rc=$?
vllm_seconds=$((SECONDS - vllm_start))

aligner_start=$SECONDS
aligner_rc=0
bash scripts/test_aligner.sh 2>&1 | tee "$logs/aligner" || aligner_rc=$?
aligner_seconds=$((SECONDS - aligner_start))

echo "run_tests.sh: main suite (.venv):            $(tail -n 1 "$logs/main") exit $main_rc"
echo "run_tests.sh: real-vLLM suite (.venv-vllm):  $(tail -n 1 "$logs/vllm") exit $vllm_rc" \
     "(${vllm_seconds} s with the environment build/check)"
echo "run_tests.sh: aligner suite (.venv-aligner): $(tail -n 1 "$logs/aligner") exit $aligner_rc" \
     "(${aligner_seconds} s with the environment build/check)"
[ "$main_rc" -eq 0 ] && [ "$vllm_rc" -eq 0 ] && [ "$aligner_rc" -eq 0 ]
