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
checkout_env "${CLUSTER_VENV:-.venv-cluster}" requirements/locks/cluster.txt 3.12 .quatro-cluster.sha
