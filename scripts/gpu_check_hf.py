#!/usr/bin/env python
"""The GPU check's HF round trip: a Hugging Face Qwen2 checkpoint into the GPU's megatron model and
back, against ``transformers``' own logits.

    python scripts/gpu_check_hf.py --json-file F

A random untied float32 ``transformers.Qwen2ForCausalLM`` (2 layers, GQA, QKV bias, non-trivial
norms and biases) is saved with ``save_pretrained``, loaded the way a run loads its base model
(:func:`~quatro_nemo.megatron.hf_conversion.load_hf_state_as_megatron`: Transformer Engine's
layer names where TE imports, as :func:`~quatro_nemo.megatron.models.build_model` builds with TE
there) into the model ``build_model`` makes on this device, run forward against ``transformers``
on the same device, then exported again with
:func:`~quatro_nemo.megatron.hf_conversion.export_megatron_to_hf` and compared tensor by tensor.

Writes ``transformer_engine`` (the names used), ``device``, ``logits_rel_err`` (max |megatron -
transformers| / max |transformers|; tolerance ``LOGITS_TOLERANCE`` of the device, TF32-level on a
GPU, where a wrong mapping gives ~1) and ``export_mismatches`` (tensors not bit-identical after the
round trip) to ``--json-file``, with ``"error"`` when a stage raised. Exit code 0 when both hold.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, LENGTH = 256, 24
LOGITS_TOLERANCE = {"cuda": 1e-2, "cpu": 1e-4}


def tiny_qwen2(tie: bool, vocab_size: int, hidden_size: int, intermediate_size: int, seed: int = 0):
    """A random float32 ``transformers`` Qwen2ForCausalLM: 2 layers, GQA (4 heads, 2 KV heads), QKV
    bias (also tests/conversion/test_hf_qwen2.py's)."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def round_trip(figures: Dict[str, Any]) -> None:
    import torch

    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.checkpoint import load_full_state_dict
    from quatro_nemo.megatron.compat import current_device
    from quatro_nemo.megatron.hf_conversion import (export_megatron_to_hf, load_hf_state_as_megatron,
                                                    model_config_from_hf, read_hf_checkpoint,
                                                    uses_transformer_engine_names)
    from quatro_nemo.megatron.models import build_model

    parallel.initialize_parallel(1, 1, seed=0)
    device = current_device()
    reference = tiny_qwen2(tie=False, vocab_size=VOCAB, hidden_size=128, intermediate_size=256)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="gpu-check-hf-") as folder:
        reference.save_pretrained(os.path.join(folder, "hf"))
        hf_config, _ = read_hf_checkpoint(os.path.join(folder, "hf"))
        cfg = model_config_from_hf(hf_config, params_dtype="float32")
        model = build_model(cfg)
        load_full_state_dict(model, load_hf_state_as_megatron(os.path.join(folder, "hf"), cfg))
        figures.update(device=str(device), transformer_engine=uses_transformer_engine_names(model))
        positions = torch.arange(LENGTH).unsqueeze(0).expand(2, LENGTH)
        with torch.no_grad():
            ours = model(tokens.to(device), positions.to(device), None)[..., :VOCAB].float().cpu()
            theirs = reference.to(device)(tokens.to(device)).logits.float().cpu()
        figures["logits_rel_err"] = float((ours - theirs).abs().max() / theirs.abs().max())
        export_megatron_to_hf(model, cfg, os.path.join(folder, "export"), base_config=hf_config)
        _, exported = read_hf_checkpoint(os.path.join(folder, "export"))
        state = {name: tensor.detach().cpu() for name, tensor in reference.state_dict().items()}
        figures["export_mismatches"] = sorted(name for name in set(state) | set(exported)
                                              if name not in exported or name not in state
                                              or not torch.equal(exported[name], state[name]))
    tolerance = LOGITS_TOLERANCE[device.type]
    print(f"[gpu_check] hf: {'Transformer Engine' if figures['transformer_engine'] else 'local'} layer names on "
          f"{device.type}: logits max rel. error {figures['logits_rel_err']:.2e} (tolerance {tolerance:g}), "
          f"{len(figures['export_mismatches'])} tensors differ after export", flush=True)
    figures["ok"] = figures["logits_rel_err"] <= tolerance and not figures["export_mismatches"]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-file", required=True)
    args = parser.parse_args(argv)
    figures: Dict[str, Any] = {"ok": False}
    try:
        round_trip(figures)
    except Exception as exc:  # reported in the summary, as a failure of this part
        traceback.print_exc()
        figures["error"] = f"{type(exc).__name__}: {exc}"
    with open(args.json_file, "w") as handle:
        json.dump(figures, handle, indent=1)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
