"""HF Qwen2 <-> megatron-core conversion against ``transformers``' own Qwen2 (tiny random config,
built locally, no download): logits at TP=1 and TP=2, exact tensor round trips, safetensors files.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from quatro_nemo.megatron.hf_conversion import (
    fuse_qkv,
    hf_config_from_model_config,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
    model_config_from_hf,
    read_hf_checkpoint,
    split_qkv,
    write_hf_checkpoint,
)
from tests.distributed import run_ranks
from tests.conversion.megatron_helpers import forward_logits

transformers = pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location(
    "gpu_check_hf", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_hf.py")
_GPU_CHECK_HF = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_GPU_CHECK_HF)


def tiny_qwen2(tie: bool, vocab_size: int = 62, seed: int = 0):
    """A random float32 Qwen2ForCausalLM: 2 layers, GQA (4 heads, 2 KV heads), QKV bias, hidden size
    32, non-trivial norms and biases (the GPU check's builder, scripts/gpu_check_hf.py)."""
    return _GPU_CHECK_HF.tiny_qwen2(tie=tie, vocab_size=vocab_size, hidden_size=32, intermediate_size=48, seed=seed)


def hf_config_dict(model) -> dict:
    return model.config.to_dict()


def hf_state(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
            if not (model.config.tie_word_embeddings and name == "lm_head.weight")}


# ----------------------------------------------------------------------------------------------
# Pure mapping
# ----------------------------------------------------------------------------------------------


def test_fuse_qkv_groups_heads_by_kv_head_hand_built():
    # 4 query heads, 2 KV groups, head_dim 1: megatron order is [q0 q1 k0 v0 | q2 q3 k1 v1].
    q, k, v = torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21])
    assert fuse_qkv(q, k, v, num_heads=4, num_groups=2).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    q2 = torch.arange(8.).reshape(8, 1)  # head_dim 2, 4 heads, 1 group (MQA)
    fused = fuse_qkv(q2, torch.tensor([[8.], [9]]), torch.tensor([[10.], [11]]), num_heads=4, num_groups=1)
    assert fused.flatten().tolist() == list(range(12))


@pytest.mark.parametrize("heads,groups", [(4, 2), (8, 1), (4, 4)])
def test_split_qkv_inverts_fuse(heads, groups):
    d, h = 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    for got, want in zip(split_qkv(fuse_qkv(q, k, v, heads, groups), heads, groups), (q, k, v)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("transformer_engine", [False, True])
def test_hf_megatron_hf_identical_tensors(tie, transformer_engine):
    model = tiny_qwen2(tie)
    cfg = model_config_from_hf(hf_config_dict(model), params_dtype="float32")
    state = hf_state(model)
    full = hf_to_megatron_state_dict(state, cfg, transformer_engine=transformer_engine)
    assert ("output_layer.weight" in full) == (not tie)
    assert full["decoder.layers.1.mlp.linear_fc1.weight"].shape == (96, 32)
    assert full["decoder.layers.0.self_attention.linear_qkv.bias"].shape == ((4 + 2 * 2) * 8,)
    back = megatron_to_hf_state_dict(full, cfg)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_hf_to_megatron_names_unknown_and_missing_keys():
    model = tiny_qwen2(True)
    cfg = model_config_from_hf(hf_config_dict(model), params_dtype="float32")
    state = hf_state(model)
    with pytest.raises(KeyError, match="model.layers.0.foo"):
        hf_to_megatron_state_dict(dict(state, **{"model.layers.0.foo": torch.zeros(1)}), cfg)
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron_state_dict(state, cfg)


# The public config.json of Qwen/Qwen2.5-Math-1.5B and -7B (the values the paper fine-tunes).
QWEN25_MATH_1P5B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
                    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                    "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0, "sliding_window": 4096, "use_sliding_window": False,
                    "tie_word_embeddings": True, "vocab_size": 151936, "hidden_act": "silu",
                    "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"}
QWEN25_MATH_7B = dict(QWEN25_MATH_1P5B, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                      num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152064)


def test_model_config_from_qwen25_math_configs():
    small = model_config_from_hf(QWEN25_MATH_1P5B)
    assert (small.hidden_size, small.num_layers, small.num_attention_heads, small.num_query_groups,
            small.ffn_hidden_size, small.vocab_size, small.rotary_base, small.tie_embeddings,
            small.norm_eps, small.params_dtype) == (1536, 28, 12, 2, 8960, 151936, 10000, True, 1e-6, "bfloat16")
    large = model_config_from_hf(QWEN25_MATH_7B)
    assert (large.num_query_groups, large.tie_embeddings, large.vocab_size) == (4, False, 152064)
    assert model_config_from_hf(dict(QWEN25_MATH_1P5B, vocab_size=151665), vocab_multiple=128).vocab_size == 151680
    with pytest.raises(ValueError, match="use_sliding_window"):
        model_config_from_hf(dict(QWEN25_MATH_1P5B, use_sliding_window=True))
    with pytest.raises(ValueError, match="rope_scaling"):
        model_config_from_hf(dict(QWEN25_MATH_1P5B, rope_scaling={"type": "yarn", "factor": 4}))
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf(dict(QWEN25_MATH_1P5B, model_type="llama"))


def test_written_checkpoint_loads_in_transformers_with_same_logits(tmp_path):
    model = tiny_qwen2(tie=False)
    cfg = model_config_from_hf(hf_config_dict(model), params_dtype="float32")
    full = hf_to_megatron_state_dict(hf_state(model), cfg)
    files = write_hf_checkpoint(tmp_path / "export", megatron_to_hf_state_dict(full, cfg),
                                hf_config_from_model_config(cfg, base=hf_config_dict(model)),
                                max_shard_bytes=20_000)
    assert len(files) > 1 and (tmp_path / "export" / "model.safetensors.index.json").is_file()
    config, state = read_hf_checkpoint(tmp_path / "export", lazy=True)
    assert len(state) == len(hf_state(model))
    assert config["rope_theta"] == 10000.0 and config["num_key_value_heads"] == 2
    for name, tensor in hf_state(model).items():
        assert torch.equal(state[name], tensor), name
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    tokens = torch.randint(0, 62, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_read_hf_checkpoint_names_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------
# Distributed: megatron logits == HF logits at TP=1 and TP=2; export gives the HF tensors back
# ----------------------------------------------------------------------------------------------


def _conversion_rank(rank: int, hf_dir: str, tokens: torch.Tensor, export_root: str) -> dict:
    from quatro_nemo.megatron import parallel
    from quatro_nemo.megatron.hf_conversion import export_megatron_to_hf, load_hf_into_megatron
    from quatro_nemo.megatron.models import build_model
    from quatro_nemo.megatron.parallel import initialize_parallel

    hf_config, state = read_hf_checkpoint(hf_dir, lazy=True)  # as written by transformers itself
    result = {}
    for tp in (1, 2):
        initialize_parallel(tp, 1, seed=7)
        cfg = model_config_from_hf(hf_config, params_dtype="float32", vocab_multiple=tp)
        model = build_model(cfg)
        load_hf_into_megatron(model, state, cfg)
        with torch.no_grad():
            logits = forward_logits(model, tokens)
        export_megatron_to_hf(model, cfg, f"{export_root}/tp{tp}_dp{parallel.dp_rank()}",
                              base_config=hf_config)
        result[tp] = logits[..., : hf_config["vocab_size"]]
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("tie,vocab", [(True, 62), (False, 61)], ids=["tied", "untied-odd-vocab"])
def test_megatron_logits_match_hf_at_tp1_and_tp2(tmp_path, tie, vocab):
    model = tiny_qwen2(tie, vocab_size=vocab)
    tokens = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = model(tokens).logits
    assert hf_logits.abs().max() > 1.0  # a scale at which a wrong mapping shows
    state = hf_state(model)
    model.save_pretrained(tmp_path / "hf")
    results = run_ranks(2, _conversion_rank, str(tmp_path / "hf"), tokens, str(tmp_path))
    for rank, result in enumerate(results):
        for tp in (1, 2):
            diff = (result[tp] - hf_logits).abs().max().item()
            assert diff <= 1e-4, f"rank {rank} TP={tp}: max |megatron - HF logit| = {diff}"
    for export in ("tp1_dp0", "tp2_dp0"):
        config, exported = read_hf_checkpoint(tmp_path / export)
        assert config["vocab_size"] == vocab and config["tie_word_embeddings"] == tie
        assert sorted(exported) == sorted(state)
        for name, tensor in state.items():
            assert torch.equal(exported[name], tensor), f"{export}: {name}"


def test_load_hf_state_as_megatron_checks_the_model_section(tmp_path):
    from quatro_nemo.megatron.hf_conversion import load_hf_state_as_megatron

    model = tiny_qwen2(tie=True)
    model.save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(hf_config_dict(model), params_dtype="float32", vocab_multiple=64)
    view = load_hf_state_as_megatron(tmp_path / "hf", cfg, transformer_engine=False)
    expected = hf_to_megatron_state_dict(hf_state(model), cfg)
    assert sorted(view) == sorted(expected)
    assert all(torch.equal(view[k], v) for k, v in expected.items())
    wrong = model_config_from_hf(dict(hf_config_dict(model), num_key_value_heads=4), params_dtype="float32")
    with pytest.raises(ValueError, match="model.num_query_groups=4 but .*config.json gives 2"):
        load_hf_state_as_megatron(tmp_path / "hf", wrong)
