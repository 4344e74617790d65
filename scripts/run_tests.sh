#!/usr/bin/env bash
# The project's one test command (README and .ci/run call it): installs what the tests need,
# runs the main suite in .venv (Python 3.11, megatron-core 0.16.1), then builds (or reuses) the
# cluster environment .venv-cluster (scripts/setup_cluster_env.sh: Python 3.12, megatron-core
# 0.19, vLLM's CPU build) and runs tests/vllm (the real engine through recipes/train.py),
# tests/megatron and tests/conversion in it, then the NeMo-Aligner environment .venv-aligner and
# tests/aligner in it
# (scripts/test_aligner.sh, docs/aligner.md). Between the main and the cluster suite, the
# "other kernels" stage reruns a chosen set of the machine-sensitive tests (the ones comparing
# floats across micro-batch layouts and machines, KERNEL_TESTS below) under torch CPU kernels other
# than this machine's default: ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine, =default (scalar)
# on any other, so one machine also checks another's rounding (issue 31; 2.3 CPU-min, ~1.5 min).
# Exit 0 only if every suite passes; their closing pytest lines are repeated at the end.
# Extra arguments go to the main suite's pytest, and then only the main suite runs (the aligner
# suite alone: bash scripts/test_aligner.sh [pytest arguments]; the cluster suite alone:
# bash scripts/setup_cluster_env.sh && .venv-cluster/bin/python -m pytest tests/vllm ...).
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
    echo "run_tests.sh: pytest arguments given: only the main suite ran (see this script's header for the others)"
    exit "$main_rc"
fi

# Tests whose numbers depend on the CPU's kernels: log-probs equal across micro-batchings, the
# token-budget run's first step against the padded run's, the committed studies' reports rebuilt.
KERNEL_TESTS=(tests/engine/test_learning_signal.py
              tests/engine/test_train_e2e.py::test_token_budget_micro_batches_give_the_first_step_of_the_padded_run
              tests/megatron/test_parallel_equivalence.py
              tests/study/test_committed_studies.py)
kernels_start=$SECONDS
kernels_rc=0
machine_kernels=$(.venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())" || echo unknown)
other_kernels=$([ "$machine_kernels" = AVX512 ] && echo avx2 || echo default)
echo "run_tests.sh: other kernels: this machine's are $machine_kernels; rerunning ${#KERNEL_TESTS[@]} test paths" \
     "under ATEN_CPU_CAPABILITY=$other_kernels"
ATEN_CPU_CAPABILITY=$other_kernels .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "${KERNEL_TESTS[@]}" \
    2>&1 | tee "$logs/kernels" || kernels_rc=$?
kernels_seconds=$((SECONDS - kernels_start))

cluster_start=$SECONDS
cluster_rc=0
{ bash scripts/setup_cluster_env.sh \
    && .venv-cluster/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" tests/vllm tests/megatron tests/conversion; } \
    2>&1 | tee "$logs/cluster" || cluster_rc=$?
cluster_seconds=$((SECONDS - cluster_start))

aligner_start=$SECONDS
aligner_rc=0
bash scripts/test_aligner.sh 2>&1 | tee "$logs/aligner" || aligner_rc=$?
aligner_seconds=$((SECONDS - aligner_start))

echo "run_tests.sh: main suite (.venv):            $(tail -n 1 "$logs/main") exit $main_rc"
echo "run_tests.sh: other kernels (ATEN_CPU_CAPABILITY=$other_kernels): $(tail -n 1 "$logs/kernels") exit $kernels_rc" \
     "(${kernels_seconds} s)"
echo "run_tests.sh: cluster suite (.venv-cluster): $(tail -n 1 "$logs/cluster") exit $cluster_rc" \
     "(${cluster_seconds} s with the environment build/check)"
echo "run_tests.sh: aligner suite (.venv-aligner): $(tail -n 1 "$logs/aligner") exit $aligner_rc" \
     "(${aligner_seconds} s with the environment build/check)"
[ "$main_rc" -eq 0 ] && [ "$kernels_rc" -eq 0 ] && [ "$cluster_rc" -eq 0 ] && [ "$aligner_rc" -eq 0 ]
