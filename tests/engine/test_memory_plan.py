"""The memory/throughput planner: parameter counts against transformers' Qwen2 and the published
Qwen2.5 totals, the Megatron-LM bytes-per-parameter table, a hand-derived activation count, the
1.5B / 7B configs (load, validate, fit 8 x 80 GB), and refusals that name the setting."""
from __future__ import annotations

import os
import sys

import pytest

from quatro_nemo.engine.memory_plan import (
    ClusterConfig,
    Layout,
    ModelShape,
    PlanError,
    ScaleConfig,
    VllmConfig,
    Workload,
    check_plan,
    layer_activation_elements,
    plan_memory,
    stage_parameter_counts,
    total_parameter_count,
    weight_bytes_per_parameter,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

QWEN25_1P5B = ModelShape(vocab_size=151936, hidden_size=1536, num_layers=28, num_attention_heads=12,
                         num_query_groups=2, ffn_hidden_size=8960, tie_embeddings=True)
QWEN25_7B = ModelShape(vocab_size=152064, hidden_size=3584, num_layers=28, num_attention_heads=28,
                       num_query_groups=4, ffn_hidden_size=18944, tie_embeddings=False)


def test_parameter_counts_match_published_qwen25_totals():
    # Qwen2.5-1.5B / -7B (same shapes as the -Math models): 1,543,714,304 and 7,615,616,512.
    assert total_parameter_count(QWEN25_1P5B) == 1_543_714_304
    assert total_parameter_count(QWEN25_7B) == 7_615_616_512


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_transformers_qwen2(tie):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=62, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = transformers.Qwen2ForCausalLM(config)
    expected = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    shape = ModelShape(vocab_size=62, hidden_size=32, num_layers=3, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=48, tie_embeddings=tie)
    assert total_parameter_count(shape) == expected


def test_stage_parameter_counts_hand_derived():
    # h=8, 2 heads (d=4), 1 KV group, f=12, V=10, 4 layers, tied.
    shape = ModelShape(vocab_size=10, hidden_size=8, num_layers=4, num_attention_heads=2, num_query_groups=1,
                       ffn_hidden_size=12, tie_embeddings=True)
    qkv = 8 * 16 + 16            # (2 + 2*1) * 4 = 16 rows, with bias
    sharded = qkv + 8 * 8 + 8 * 24 + 12 * 8
    replicated = 16
    assert stage_parameter_counts(shape, Layout(1, 1)) == [4 * (sharded + replicated) + 80 + 8]
    # TP=2, PP=2: 2 layers per stage; the last stage also holds the tied output copy.
    per_layer = sharded // 2 + replicated
    assert stage_parameter_counts(shape, Layout(2, 2)) == [2 * per_layer + 40, 2 * per_layer + 8 + 40]


def test_weight_bytes_follow_megatron_distributed_optimizer_table():
    assert weight_bytes_per_parameter(2, False, 8) == 18
    assert weight_bytes_per_parameter(2, True, 8) == 6 + 12 / 8
    assert weight_bytes_per_parameter(4, False, 4) == 16
    assert weight_bytes_per_parameter(4, True, 4) == 8 + 8 / 4


def test_layer_activation_elements_hand_derived():
    # h=4, 2 heads of d=2, 1 KV group, f=6 (SwiGLU), TP=1, 3 tokens:
    # 4h = 16; qkv (2+2)*2 = 8; attention out 2*2 = 4; fc1 out 12; fc2 in 6 -> 46 per token.
    shape = ModelShape(vocab_size=8, hidden_size=4, num_layers=1, num_attention_heads=2, num_query_groups=1,
                       ffn_hidden_size=6)
    assert layer_activation_elements(shape, tokens=3, tp=1, flash_attention=True, sequence_length=3) == 138
    # Without flash attention: + scores and softmax, 2 heads * s = 2*2*3 = 12 per token.
    assert layer_activation_elements(shape, tokens=3, tp=1, flash_attention=False, sequence_length=3) == 174
    # TP=2 halves the sharded part only: 16 + 30/2 = 31 per token.
    assert layer_activation_elements(shape, tokens=3, tp=2, flash_attention=True, sequence_length=3) == 93


def _work(**overrides) -> Workload:
    return Workload(**dict(dict(prompts_per_step=256, n=8, max_prompt_tokens=512, max_new_tokens=3072,
                                micro_batch_size=1), **overrides))


def test_refuses_layouts_naming_the_setting():
    cluster, scale, vllm = ClusterConfig(), ScaleConfig(), VllmConfig(tensor_parallel=2)
    with pytest.raises(PlanError, match="parallel.tensor=4 does not divide model.num_query_groups=2"):
        plan_memory(QWEN25_1P5B, Layout(4, 1), cluster, scale, vllm, _work())
    with pytest.raises(PlanError, match="parallel.pipeline=3 does not divide model.num_layers=28"):
        plan_memory(QWEN25_7B, Layout(2, 3), cluster, scale, vllm, _work())
    with pytest.raises(PlanError, match="trainer.mini_batch_prompts=12 is not divisible by data_parallel=8"):
        plan_memory(QWEN25_1P5B, Layout(1, 1), cluster, scale, vllm, _work(mini_batch_prompts=12, prompts_per_step=48))
    with pytest.raises(PlanError, match="parallel.max_tokens_per_micro_batch=1"):
        plan_memory(QWEN25_7B, Layout(2, 1), cluster, scale, vllm, _work(max_tokens_per_micro_batch=1))
    # 7B on TP=1 with a plain optimizer and no recomputation cannot fit 80 GB.
    too_big = plan_memory(QWEN25_7B, Layout(1, 1), cluster, ScaleConfig(distributed_optimizer=False), vllm,
                          _work(micro_batch_size=4))
    assert too_big.train_phase_gb > 80
    with pytest.raises(PlanError, match="training phase needs .* cluster.gpu_memory_gb=80.*micro_batch_size"):
        check_plan(too_big)
    greedy_vllm = plan_memory(QWEN25_7B, Layout(2, 1, True), cluster, scale,
                              VllmConfig(tensor_parallel=2, gpu_memory_utilization=0.9), _work())
    with pytest.raises(PlanError, match="rollout phase .* vllm.gpu_memory_utilization"):
        check_plan(greedy_vllm)
    tiny_kv = plan_memory(QWEN25_7B, Layout(2, 1, True), cluster, scale,
                          VllmConfig(tensor_parallel=1, gpu_memory_utilization=0.2), _work())
    with pytest.raises(PlanError, match="KV cache .* cannot hold one full-length sequence"):
        check_plan(tiny_kv)


def test_micro_batch_size_needs_no_divisor():
    # 256 x 8 sequences over DP=4 (TP=2): 512 per rank in micro-batches of 3 -> ceil(512 / 3) = 171.
    plan = plan_memory(QWEN25_7B, Layout(2, 1), ClusterConfig(), ScaleConfig(), VllmConfig(tensor_parallel=2),
                       _work(micro_batch_size=3))
    assert plan.num_microbatches == 171


def test_token_budget_plans_activations_and_logits_from_the_budget():
    """A budget of b full-length rows' tokens plans exactly like b rows; a budget below one row
    plans one full row (it runs alone)."""
    args = (QWEN25_7B, Layout(2, 2, True), ClusterConfig(), ScaleConfig(), VllmConfig(tensor_parallel=2))
    s = 512 + 3072

    def plan(**work):
        return plan_memory(*args, _work(**work))

    rows2, rows1 = plan(micro_batch_size=2), plan(micro_batch_size=1)
    budget = plan(micro_batch_size=64, max_tokens_per_micro_batch=2 * s)
    assert (budget.activations_gb, budget.logits_gb) == (rows2.activations_gb, rows2.logits_gb)
    assert budget.num_microbatches == rows2.num_microbatches
    small = plan(micro_batch_size=64, max_tokens_per_micro_batch=1000)
    assert (small.activations_gb, small.logits_gb) == (rows1.activations_gb, rows1.logits_gb)
    # With flash attention every activation term is linear in the tokens (2 micro-batches in
    # flight either way), so 1.5 rows' worth of budget costs 1.5 x one row.
    between = plan(max_tokens_per_micro_batch=3 * s // 2)
    assert between.activations_gb == pytest.approx(1.5 * rows1.activations_gb)
    assert between.logits_gb == pytest.approx(1.5 * rows1.logits_gb)


def test_data_parallel_shards_optimizer_state():
    work = _work(max_new_tokens=1024, micro_batch_size=4)
    one_node = plan_memory(QWEN25_1P5B, Layout(1, 1), ClusterConfig(nodes=1), ScaleConfig(), VllmConfig(), work)
    two_nodes = plan_memory(QWEN25_1P5B, Layout(1, 1), ClusterConfig(nodes=2), ScaleConfig(), VllmConfig(), work)
    params = total_parameter_count(QWEN25_1P5B)
    assert one_node.weights_grads_optimizer_gb == pytest.approx(params * (6 + 12 / 8) / 1e9)
    assert two_nodes.weights_grads_optimizer_gb == pytest.approx(params * (6 + 12 / 16) / 1e9)
    assert two_nodes.sequences_per_engine == one_node.sequences_per_engine // 2


# ----------------------------------------------------------------------------------------------
# The shipped configs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["quatro_1p5b", "quatro_7b"])
def test_scale_configs_load_validate_and_fit_one_node_of_8x80gb(name):
    from quatro_nemo.engine.config import load_config
    from plan_memory import plan_for_arguments

    config = load_config([f"config={name}"])
    assert config.rollout.n == 8 and config.trainer.prompts_per_step == 256 and config.trainer.lr == 1e-6
    assert config.rollout.top_p == 1.0 and config.eval.top_p == 0.7 and config.rollout.temperature == 1.0
    assert config.algorithm.beta == 0.001
    assert config.rollout.max_new_tokens == {"quatro_1p5b": 1024, "quatro_7b": 3072}[name]
    plan = plan_for_arguments([f"config={name}"])
    assert plan.world_size == 8 and plan.train_phase_gb <= 80 and plan.rollout_phase_gb <= 80
    assert plan.max_concurrent_sequences >= 1


@pytest.mark.parametrize("name,hf", [("quatro_1p5b", "QWEN25_MATH_1P5B"), ("quatro_7b", "QWEN25_MATH_7B")])
def test_scale_config_model_matches_the_checkpoint_config(name, hf):
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.megatron.hf_conversion import model_config_from_hf
    from quatro_nemo.megatron.models import ModelConfig
    from tests.conversion import test_hf_qwen2

    model = dict(load_config([f"config={name}"]).model)
    model.pop("extra")
    assert ModelConfig(**model) == model_config_from_hf(getattr(test_hf_qwen2, hf))


@pytest.mark.parametrize("baseline", ["grpo", "gspo"])
def test_baselines_reuse_the_scale_config(baseline):
    from quatro_nemo.engine.config import load_config

    config = load_config(["config=quatro_7b", f"algorithm={baseline}"])
    assert config.algorithm_name == baseline and config.rollout.max_new_tokens == 3072


def test_plan_memory_recipe_exit_codes(capsys):
    import plan_memory

    assert plan_memory.main(["config=quatro_7b"]) == 0
    assert "training phase" in capsys.readouterr().out
    assert plan_memory.main(["config=quatro_7b", "cluster.gpu_memory_gb=40"]) == 2
    assert "cluster.gpu_memory_gb=40" in capsys.readouterr().err


def test_plan_sections_reject_unknown_keys_by_name():
    from quatro_nemo.engine.memory_plan import section_from_dict

    assert section_from_dict("vllm", {"tensor_parallel": 2}).tensor_parallel == 2
    with pytest.raises(PlanError, match=r"vllm.gpu_mem"):
        section_from_dict("vllm", {"gpu_mem": 0.5})
