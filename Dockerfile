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
# megatron-core 0.10.0 (its own NGC base, Python 3.10), while the engine is written against
# megatron-core 0.16.1 and vLLM 0.33.0, which pins torch 2.14.0 (CUDA 13). Every version is a
# build argument pinned below; the project's own Python dependencies come from requirements/.

ARG STACK=engine

# ---- engine: torch, vLLM, megatron-core, Transformer Engine and apex, built against each other
FROM nvcr.io/nvidia/pytorch:25.10-py3 AS stack-engine
ARG TORCH_VERSION=2.14.0
ARG VLLM_VERSION=0.33.0
ARG MEGATRON_CORE_VERSION=0.16.1
# megatron-core 0.16.1 asks for transformer-engine >=2.9,<2.12
ARG TRANSFORMER_ENGINE_VERSION=2.11.0
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ARG MAX_JOBS=8
# The NGC image pins its own torch build through PIP_CONSTRAINT: this stack replaces it with the
# PyPI build vLLM is compiled against, then compiles TE and apex against that torch.
ENV PIP_CONSTRAINT="" \
    PIP_NO_CACHE_DIR=1 \
    MAX_JOBS=${MAX_JOBS}
# One layer per long build, so a changed pin rebuilds only what depends on it.
RUN pip install "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}"
# hadolint ignore=DL3059
RUN NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
        "transformer-engine[pytorch,core_cu13]==${TRANSFORMER_ENGINE_VERSION}"
# hadolint ignore=DL3059
RUN APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-build-isolation \
        "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"

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

# ---- the project, on the chosen stack
# hadolint ignore=DL3006
FROM stack-${STACK} AS quatro
WORKDIR /opt/quatro-nemo
COPY requirements/ requirements/
# core.txt pins torch and megatron-core for the CPU environment: the stack provides both here.
RUN grep -v -E '^(torch|megatron-core)\b' requirements/core.txt > /tmp/core-no-stack.txt \
    && pip install --no-cache-dir -r /tmp/core-no-stack.txt -r requirements/eval.txt \
    && rm /tmp/core-no-stack.txt
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import quatro_nemo, megatron.core, torch; print('quatro-nemo on torch', torch.__version__)"
ENV QUATRO_PYTHON=python \
    OMP_NUM_THREADS=1
ENTRYPOINT ["/opt/quatro-nemo/slurm/lib/launch.sh"]
CMD ["train"]
