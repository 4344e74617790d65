#!/usr/bin/env bash
# Build (or reuse) the cluster environment at .venv-cluster (CPU, Python 3.12): the GPU image's
# Python stack (megatron-core 0.19, PyPI's torch 2.13, transformers 5, vLLM's CPU build), where
# tests/megatron, tests/conversion and the real-vLLM tests run on the newest megatron-core.
# Installs requirements/locks/cluster.txt (scripts/lock.sh writes it from requirements/cluster.txt
# and cluster-overrides.txt). Cached: reinstalls only when the lock or the scripts changed.
# CLUSTER_VENV chooses the path, PYTHON the interpreter (else python3.12 on PATH or in pyenv).
# First build: 6.3 GB, under a minute to a few minutes (docs/cluster.md, "Environments").
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/env.sh
source scripts/lib/env.sh
VENV=${CLUSTER_VENV:-.venv-cluster}
lock=requirements/locks/cluster.txt
stamp="$VENV/.quatro-cluster.sha"
want=$(fingerprint "$lock" requirements/locks/uv.txt scripts/lib/env.sh scripts/setup_cluster_env.sh)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
install_lock "$VENV" "$lock" 3.12
# quatro_nemo from this checkout, without installing anything into the source tree.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/quatro_nemo_checkout.pth"
echo "$want" > "$stamp"
