#!/usr/bin/env bash
# Build (or reuse) the separate NeMo-Aligner 0.7.0 environment at .venv-aligner (CPU, Python 3.11).
# It is separate from .venv because NeMo-Aligner's container stack pins megatron-core 0.10.0
# (the main environment uses 0.16.1). Installs requirements/locks/aligner.txt (scripts/lock.sh
# writes it from requirements/aligner.txt). Cached: reinstalls only when the lock or the scripts
# changed. ALIGNER_VENV chooses the path, PYTHON the interpreter. First build ~5-10 min and
# ~3.6 GB (see docs/aligner.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/env.sh
source scripts/lib/env.sh
VENV=${ALIGNER_VENV:-.venv-aligner}
lock=requirements/locks/aligner.txt
stamp="$VENV/.quatro-aligner-requirements.sha"
want=$(fingerprint "$lock" requirements/locks/uv.txt requirements/aligner-uv.toml scripts/lib/env.sh \
    scripts/setup_aligner_env.sh)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
# mamba-ssm (a hard NeMo import) has no CPU wheel: its Python part is built from the sdist, with
# the build dependencies of requirements/aligner-uv.toml.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    install_lock "$VENV" "$lock" 3.11 --config-file requirements/aligner-uv.toml
# quatro_nemo from this checkout, without installing anything into the source tree.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/quatro_nemo_checkout.pth"
echo "$want" > "$stamp"
