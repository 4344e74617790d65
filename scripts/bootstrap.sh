#!/usr/bin/env bash
# Create (or update) the CPU virtual environment at .venv in the repository root.
#   bash scripts/bootstrap.sh train   # what the training recipes need (requirements/core.txt)
#   bash scripts/bootstrap.sh test    # everything the test suite needs (requirements/cpu.txt)
# Idempotent: reinstalls only when the requirement files changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
case "$profile" in
    train) requirements=requirements/core.txt ;;
    test) requirements=requirements/cpu.txt ;;
    *) echo "bootstrap.sh: unknown profile '$profile' (train or test)" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
fingerprint() { cat requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1; }
want=$(fingerprint)
if [ "$(cat ".venv/.quatro-$profile.sha" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r "$requirements"
    .venv/bin/python -m pip install -q --no-deps -e .
    echo "$want" > ".venv/.quatro-$profile.sha"
    # the test environment is a superset of the training one
    if [ "$profile" = test ]; then echo "$want" > .venv/.quatro-train.sha; fi
fi
