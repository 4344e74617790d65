#!/usr/bin/env bash
# Create (or update) the CPU virtual environment at .venv in the repository root.
# Idempotent: reinstalls only when requirements/*.txt changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.quatro-requirements.sha
want=$(cat requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements/cpu.txt
    .venv/bin/python -m pip install -q --no-deps -e .
    echo "$want" > "$stamp"
fi
