#!/usr/bin/env bash
# The project's one test command (README and .ci/run call it): installs what the tests need,
# then runs the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
.venv/bin/python -m pytest "$@"
