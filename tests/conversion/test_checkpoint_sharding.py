"""checkpoint.gather_full_state_dict / load_full_state_dict across TP x PP layouts.

Reference: a TP=1, PP=1 build's ``named_parameters`` and its plain forward, in the same forked
rank (never the code under test). Every layout first scrambles its weights, so a passing test
shows the load did the work.
"""
from __future__ import annotations


import pytest
import torch

from quatro_nemo.megatron.checkpoint import merge_shards, shard_tensor
from tests.distributed import run_ranks
from tests.conversion.megatron_helpers import forward_logits

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tensor_parallel, pipeline_parallel) on 4 ranks

# Odd vocabulary at TP=1, padded to 64 rows for the sharded layouts (vocab padding path).
TINY_GPT = dict(architecture="gpt", vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4,
                max_position_embeddings=32, tie_embeddings=False)
TINY_QWEN2 = dict(architecture="qwen2", vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=32, tie_embeddings=True,
                  rotary_base=10000, norm_eps=1e-6)
PADDED_VOCAB = 64


# ----------------------------------------------------------------------------------------------
# Strided slicing against hand-written layouts
# ----------------------------------------------------------------------------------------------


def test_shard_tensor_stride_two_takes_gate_and_up_rows_of_each_rank():
    full = torch.arange(8).unsqueeze(1)  # rows 0-3 = gate, 4-7 = up (ffn = 4)
    assert shard_tensor(full, 0, 2, 2, 0).flatten().tolist() == [0, 1, 4, 5]
    assert shard_tensor(full, 0, 2, 2, 1).flatten().tolist() == [2, 3, 6, 7]
    assert shard_tensor(full, 0, 1, 2, 1).flatten().tolist() == [4, 5, 6, 7]


def test_shard_tensor_along_columns():
    full = torch.arange(12).reshape(2, 6)
    assert shard_tensor(full, 1, 1, 3, 2).tolist() == [[4, 5], [10, 11]]


@pytest.mark.parametrize("tp,stride,dim", [(2, 1, 0), (2, 2, 0), (4, 2, 0), (2, 3, 1), (4, 1, 1)])
def test_merge_inverts_shard(tp, stride, dim):
    full = torch.randn(24, 24)
    shards = [shard_tensor(full, dim, stride, tp, r) for r in range(tp)]
    assert torch.equal(merge_shards(shards, dim, stride), full)


def test_shard_tensor_rejects_indivisible():
    with pytest.raises(ValueError, match="tensor_parallel=4 x stride=2"):
        shard_tensor(torch.zeros(12, 2), 0, 2, 4, 0)


# ----------------------------------------------------------------------------------------------
# Distributed: TP=1 reference -> every layout
# ----------------------------------------------------------------------------------------------


def _sharding_rank(rank: int, cfg_kwargs: dict, tokens: torch.Tensor) -> dict:
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.checkpoint import gather_full_state_dict, load_full_state_dict
    from quatro_nemo.megatron.models import ModelConfig, build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    reference_cfg = ModelConfig(**cfg_kwargs)
    initialize_parallel(1, 1, seed=1234)
    reference = build_model(reference_cfg)
    reference_sd = {name: param.detach().clone() for name, param in reference.named_parameters()}
    with torch.no_grad():
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        reference_logits = reference(tokens, position_ids, None)
    del reference

    result = {"reference_sd": reference_sd, "reference_logits": reference_logits, "layouts": {}}
    padded_cfg = ModelConfig(**dict(cfg_kwargs, vocab_size=PADDED_VOCAB))
    for tp, pp in LAYOUTS:
        initialize_parallel(tp, pp, seed=99)
        model = build_model(padded_cfg)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_()  # scramble: the load must overwrite everything
        load_full_state_dict(model, reference_sd)
        with torch.no_grad():
            logits = forward_logits(model, tokens)
        gathered = gather_full_state_dict(model, vocab_size=reference_cfg.vocab_size)
        first_replica = parallel.dp_rank() == 0 and parallel.tp_rank() == 0
        result["layouts"][(tp, pp)] = {
            "logits": logits if first_replica else None,
            "gathered": gathered,
        }
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("cfg_kwargs", [TINY_GPT, TINY_QWEN2], ids=["gpt-untied", "qwen2-gqa-tied"])
def test_full_state_dict_roundtrip_and_logits_in_every_layout(tmp_path, cfg_kwargs):
    tokens = torch.randint(0, cfg_kwargs["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    results = run_ranks(4, _sharding_rank, cfg_kwargs, tokens)
    reference_sd = results[0]["reference_sd"]
    reference_logits = results[0]["reference_logits"]
    assert reference_logits.shape == (2, 12, cfg_kwargs["vocab_size"])
    if cfg_kwargs["tie_embeddings"]:
        assert "output_layer.weight" not in reference_sd
    for (tp, pp) in LAYOUTS:
        logits = [r["layouts"][(tp, pp)]["logits"] for r in results if r["layouts"][(tp, pp)]["logits"] is not None]
        assert logits, f"no logits for TP={tp} PP={pp}"
        for got in logits:
            vocab = cfg_kwargs["vocab_size"]
            assert got.shape == (2, 12, PADDED_VOCAB)
            diff = (got[..., :vocab] - reference_logits).abs().max().item()
            assert diff <= 1e-5, f"TP={tp} PP={pp}: max |logit diff| = {diff}"
        for rank, result in enumerate(results):
            gathered = result["layouts"][(tp, pp)]["gathered"]
            assert sorted(gathered) == sorted(reference_sd), f"TP={tp} PP={pp} rank {rank}: keys differ"
            for key, value in reference_sd.items():
                assert torch.equal(gathered[key], value), f"TP={tp} PP={pp} rank {rank}: {key} differs"
