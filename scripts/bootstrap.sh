#!/usr/bin/env bash
# Create (or update) the CPU virtual environment at .venv in the repository root, from a lock file
# (requirements/locks/, refreshed by scripts/lock.sh):
#   bash scripts/bootstrap.sh train   # what the training recipes need (requirements/locks/train.txt)
#   bash scripts/bootstrap.sh test    # everything the test suite needs (requirements/locks/cpu.txt)
# Python 3.11 (the CPU torch wheel of these machines is cp311): $PYTHON, else python3.11 on PATH
# or in pyenv. Idempotent: reinstalls only when the lock or this script changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/env.sh
source scripts/lib/env.sh
profile=${1:-test}
case "$profile" in
    train) lock=requirements/locks/train.txt ;;
    test) lock=requirements/locks/cpu.txt ;;
    *) echo "bootstrap.sh: unknown profile '$profile' (train or test)" >&2; exit 2 ;;
esac
stamp_of() {
    fingerprint "$1" requirements/locks/uv.txt pyproject.toml scripts/lib/env.sh scripts/bootstrap.sh
}
want=$(stamp_of "$lock")
if [ "$(cat ".venv/.quatro-$profile.sha" 2>/dev/null)" != "$want" ]; then
    install_lock .venv "$lock" 3.11
    .venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
    echo "$want" > ".venv/.quatro-$profile.sha"
    # the test lock is a superset of the training one, at the same pins
    if [ "$profile" = test ]; then stamp_of requirements/locks/train.txt > .venv/.quatro-train.sha; fi
fi
