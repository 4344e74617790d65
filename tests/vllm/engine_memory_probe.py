"""Measure the host memory the real vLLM engine (its CPU build) takes, for the planner check.

    python tests/vllm/engine_memory_probe.py --num-layers 8 --kv-cache-gb 0.25

Builds the probe model of tests/engine/memory_probe.py (qwen2-style, float32, untied) with
``--num-layers`` layers, then the product's :class:`VllmRolloutBackend` with an explicit KV cache,
pushes the weights and samples once, and prints one JSON line: the growth of the resident set
(``VmRSS``) from a baseline taken after every import and the model build (so library imports do
not count), after the first rollout. Run it in a fresh process with ``MALLOC_MMAP_THRESHOLD_``
set (the test does).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.engine.memory_probe import MODEL, memory_kb  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--kv-cache-gb", type=float, required=True)
    args = parser.parse_args()
    import torch
    import vllm  # noqa: F401  (imported before the baseline)

    from quatro_nemo.engine.config import VllmConfig
    from quatro_nemo.engine.vllm_backend import VllmRolloutBackend
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel
    from quatro_nemo.megatron.sampling import SamplingParams

    initialize_parallel(1, 1)
    config = ModelConfig(**dict(MODEL, num_layers=args.num_layers))
    model = build_model(config)
    baseline = memory_kb("VmRSS")
    backend = VllmRolloutBackend(model, config, VllmConfig(enforce_eager=True, kv_cache_memory_gb=args.kv_cache_gb),
                                 stop_token_ids=[1], pad_id=0)
    prompts = torch.randint(2, MODEL["vocab_size"], (8, 32), generator=torch.Generator().manual_seed(0)).tolist()
    backend.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
    print("ENGINE_MEMORY " + json.dumps({"resident_bytes": (memory_kb("VmRSS") - baseline) * 1024}), flush=True)


if __name__ == "__main__":
    main()
