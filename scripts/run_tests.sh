#!/usr/bin/env bash
# The project's one test command (README and .ci/run call it): installs what the tests need,
# then runs the whole suite. Extra arguments go to pytest.
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
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
