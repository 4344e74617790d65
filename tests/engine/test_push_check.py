"""The push check's megatron side (quatro_nemo/engine/push_check.py) without an engine: vLLM's qkv
row order by hand, and the errors of engine outputs built here from HF-layout tensors (the truth),
right and with gate/up or k/v swapped. The real engine: tests/vllm/test_push_check_real_engine.py."""
from __future__ import annotations

import pytest
import torch

from quatro_nemo.engine.config import VllmConfig
from quatro_nemo.engine.push_check import PushCheck, probe_inputs, vllm_qkv_rows
from quatro_nemo.megatron.hf_conversion import fuse_qkv
from quatro_nemo.megatron.models import ModelConfig
from quatro_nemo.validation import ConfigError

HEADS, GROUPS, HIDDEN, FFN, VOCAB = 4, 2, 16, 24, 40


def test_vllm_qkv_rows_by_hand():
    # megatron [q0 q1 k0 v0 | q2 q3 k1 v1] (head_dim 1) -> vLLM [q0 q1 q2 q3 | k0 k1 | v0 v1]
    assert vllm_qkv_rows(num_heads=4, num_groups=2, head_dim=1).tolist() == [0, 1, 4, 5, 2, 6, 3, 7]
    # head_dim 2, one group: megatron's block is already [q; k; v]
    assert vllm_qkv_rows(num_heads=2, num_groups=1, head_dim=2).tolist() == list(range(8))


def _model_and_engine(swap: str = ""):
    """Megatron's full tensors of a 1-layer Qwen2 and the outputs an engine holding the HF tensors
    (``swap``: 'gate_up' or 'kv' mixed up) gives on the probes."""
    gen = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS
    q, k, v = (torch.randn(n * head_dim, HIDDEN, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    bq, bk, bv = (torch.randn(n * head_dim, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    gate, up = torch.randn(FFN, HIDDEN, generator=gen), torch.randn(FFN, HIDDEN, generator=gen)
    embedding = torch.randn(VOCAB, HIDDEN, generator=gen)
    megatron = [("embedding.word_embeddings.weight", embedding),
                ("decoder.layers.0.self_attention.linear_qkv.weight", fuse_qkv(q, k, v, HEADS, GROUPS)),
                ("decoder.layers.0.self_attention.linear_qkv.bias", fuse_qkv(bq, bk, bv, HEADS, GROUPS)),
                ("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]))]
    if swap == "gate_up":
        gate, up = up, gate
    if swap == "kv":
        k, v, bk, bv = v, k, bv, bk
    x = probe_inputs(HIDDEN, torch.float32)
    engine = {"0.qkv": x @ torch.cat([q, k, v]).t() + torch.cat([bq, bk, bv]),
              "0.gate_up": x @ torch.cat([gate, up]).t(), "logits": x @ embedding.t()}
    return megatron, engine


@pytest.mark.parametrize("swap,wrong", [("", None), ("gate_up", "gate_up"), ("kv", "qkv")])
def test_errors_are_zero_for_the_right_layout_and_large_for_a_mixed_up_one(swap, wrong):
    cfg = ModelConfig(architecture="qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1,
                      num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN, tie_embeddings=True)
    megatron, engine = _model_and_engine(swap)
    check = PushCheck(cfg)
    assert list(check.tap(iter(megatron))) == megatron   # the push's stream goes through untouched
    errors = check.errors(engine)
    assert set(errors) == {"engine_push/qkv_rel_err", "engine_push/gate_up_rel_err", "engine_push/logits_rel_err"}
    for kind in ("qkv", "gate_up", "logits"):
        if kind == wrong:
            assert errors[f"engine_push/{kind}_rel_err"] > 0.5, errors
        else:
            assert errors[f"engine_push/{kind}_rel_err"] < 1e-6, errors


def test_a_layer_missing_on_one_side_is_an_infinite_error():
    cfg = ModelConfig(architecture="qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1,
                      num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN, tie_embeddings=True)
    megatron, engine = _model_and_engine()
    check = PushCheck(cfg)
    list(check.tap(iter(megatron)))
    del engine["0.gate_up"]
    assert check.errors(engine)["engine_push/gate_up_rel_err"] == float("inf")


def test_check_push_needs_one_engine_per_rank():
    with pytest.raises(ConfigError, match=r"vllm\.check_push .* needs vllm\.tensor_parallel=1, not 2"):
        VllmConfig(tensor_parallel=2, check_push=True)
