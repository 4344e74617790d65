"""The memory/throughput planner: parameter counts against transformers' Qwen2 and the published
Qwen2.5 totals, the Megatron-LM bytes-per-parameter table, a hand-derived activation count and
optimizer-step temporaries, the 7B plan term by term, the 1.5B / 7B configs (load, validate, fit
8 x 80 GB), and refusals that name the setting. Measured reality: test_memory_reality.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from quatro_nemo.engine.config import ClusterConfig, ScaleConfig, VllmConfig
from quatro_nemo.engine.memory_plan import (
    Layout,
    ModelShape,
    Runtime,
    Workload,
    check_plan,
    layer_activation_elements,
    optimizer_step_transient_bytes,
    plan_memory,
    stage_parameter_counts,
    total_parameter_count,
    training_state_bytes,
)
from quatro_nemo.validation import ConfigError

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


def test_training_state_follows_megatron_distributed_optimizer_table():
    # dist_optimizer.md: bf16 params + fp32 grads 18 (plain) / 6 + 12/d; fp32 16 / 8 + 8/d.
    assert training_state_bytes(2, False, 8) == {"weights": 2, "grads": 4, "optimizer": 12}
    assert training_state_bytes(2, True, 8) == {"weights": 2, "grads": 4, "optimizer": 12 / 8}
    assert training_state_bytes(4, False, 4) == {"weights": 4, "grads": 4, "optimizer": 8}
    assert training_state_bytes(4, True, 4) == {"weights": 4, "grads": 4, "optimizer": 8 / 4}


def test_optimizer_step_transients_hand_derived():
    # h=8, V=10, f=12 (SwiGLU: fc1 24 x 8 = 192 > embedding 80): largest tensor 192 elements at TP=1.
    shape = ModelShape(vocab_size=10, hidden_size=8, num_layers=1, num_attention_heads=2, num_query_groups=1,
                       ffn_hidden_size=12)
    fused = Runtime(device="cuda", fused_adam=True)
    foreach = Runtime(device="cuda", fused_adam=False)
    cpu = Runtime(device="cpu", fused_adam=False)
    assert optimizer_step_transient_bytes(shape, 1, 1000, 1000, fused, True, 2) == 0
    # torch AdamW foreach: sqrt(exp_avg_sq) of 1000 optimizer parameters, 4 bytes each.
    assert optimizer_step_transient_bytes(shape, 1, 1000, 1000, foreach, False, 1) == 4000
    # CPU single-tensor AdamW: 8 bytes x 192 (the clip's 4 x 192 is smaller); TP=2 halves the tensor.
    assert optimizer_step_transient_bytes(shape, 1, 1000, 1000, cpu, False, 1) == 8 * 192
    assert optimizer_step_transient_bytes(shape, 2, 1000, 1000, cpu, False, 1) == 8 * 96
    # gloo's reduce-scatter temporary of the 1000-element float32 gradient buffer (distributed, d > 1).
    assert optimizer_step_transient_bytes(shape, 1, 500, 1000, cpu, True, 2) == 4000


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
    with pytest.raises(ConfigError, match="parallel.tensor=4 does not divide model.num_query_groups=2"):
        plan_memory(QWEN25_1P5B, Layout(4, 1), cluster, scale, vllm, _work())
    with pytest.raises(ConfigError, match="parallel.pipeline=3 does not divide model.num_layers=28"):
        plan_memory(QWEN25_7B, Layout(2, 3), cluster, scale, vllm, _work())
    with pytest.raises(ConfigError, match="trainer.mini_batch_prompts=12 is not divisible by data_parallel=8"):
        plan_memory(QWEN25_1P5B, Layout(1, 1), cluster, scale, vllm, _work(mini_batch_prompts=12, prompts_per_step=48))
    with pytest.raises(ConfigError, match="parallel.max_tokens_per_micro_batch=1"):
        plan_memory(QWEN25_7B, Layout(2, 1), cluster, scale, vllm, _work(max_tokens_per_micro_batch=1))
    # 7B on TP=1 with a plain optimizer and no recomputation cannot fit 80 GB.
    too_big = plan_memory(QWEN25_7B, Layout(1, 1), cluster, ScaleConfig(distributed_optimizer=False),
                          VllmConfig(tensor_parallel=1), _work(micro_batch_size=4))
    assert too_big.train_phase_gb > 80
    with pytest.raises(ConfigError, match="training phase needs .* cluster.gpu_memory_gb=80.*micro_batch_size"):
        check_plan(too_big)
    greedy_vllm = plan_memory(QWEN25_7B, Layout(2, 1, True), cluster, scale,
                              VllmConfig(tensor_parallel=2, gpu_memory_utilization=0.9), _work())
    with pytest.raises(ConfigError, match="rollout phase .* vllm.gpu_memory_utilization"):
        check_plan(greedy_vllm)
    tiny_kv = plan_memory(QWEN25_7B, Layout(2, 1, True), cluster, scale,
                          VllmConfig(tensor_parallel=1, gpu_memory_utilization=0.2), _work())
    with pytest.raises(ConfigError, match="KV cache .* cannot hold one full-length sequence"):
        check_plan(tiny_kv)


def test_micro_batch_size_needs_no_divisor():
    # 256 x 8 sequences over DP=4 (TP=2): 512 per rank in micro-batches of 3 -> ceil(512 / 3) = 171.
    plan = plan_memory(QWEN25_7B, Layout(2, 1), ClusterConfig(), ScaleConfig(), VllmConfig(tensor_parallel=2),
                       _work(micro_batch_size=3))
    assert plan.num_microbatches == 171


def test_token_budget_plans_activations_and_logits_from_the_budget():
    """A budget of b full-length rows' tokens plans exactly like b rows; a budget below one row
    plans one full row (it runs alone)."""
    args = (QWEN25_7B, Layout(2, 1, True), ClusterConfig(), ScaleConfig(), VllmConfig(tensor_parallel=2))
    s = 512 + 3072

    def plan(**work):
        return plan_memory(*args, _work(**work))

    rows2, rows1 = plan(micro_batch_size=2), plan(micro_batch_size=1)
    budget = plan(micro_batch_size=64, max_tokens_per_micro_batch=2 * s)
    assert (budget.activations_gb, budget.logits_gb) == (rows2.activations_gb, rows2.logits_gb)
    assert budget.num_microbatches == rows2.num_microbatches
    small = plan(micro_batch_size=64, max_tokens_per_micro_batch=1000)
    assert (small.activations_gb, small.logits_gb) == (rows1.activations_gb, rows1.logits_gb)
    # With flash attention (Transformer Engine) every activation term is linear in the tokens (one
    # micro-batch in flight at PP=1), so 1.5 rows' worth of budget costs 1.5 x one row.
    between = plan(max_tokens_per_micro_batch=3 * s // 2)
    assert between.activations_gb == pytest.approx(1.5 * rows1.activations_gb)
    assert between.logits_gb == pytest.approx(1.5 * rows1.logits_gb)


def test_refuses_what_the_engine_cannot_run():
    cluster, scale, work = ClusterConfig(), ScaleConfig(), _work()
    with pytest.raises(ConfigError, match="vllm.tensor_parallel=4 does not divide parallel.tensor=2"):
        plan_memory(QWEN25_7B, Layout(2, 1), cluster, scale, VllmConfig(tensor_parallel=4), work)
    with pytest.raises(ConfigError, match="parallel.pipeline=2 with rollout.backend=vllm"):
        plan_memory(QWEN25_7B, Layout(2, 2), cluster, scale, VllmConfig(tensor_parallel=2), work)
    with pytest.raises(ConfigError, match="model.extra.sequence_parallel"):
        plan_memory(QWEN25_7B, Layout(2, 1, sequence_parallel=True), cluster, scale, VllmConfig(), work)
    from quatro_nemo.megatron.models import ModelConfig

    with pytest.raises(ConfigError, match="model.params_dtype=float16"):
        ModelShape.from_model_config(ModelConfig(architecture="qwen2", params_dtype="float16"))
    odd_ffn = ModelShape(**dict(vars(QWEN25_7B), ffn_hidden_size=18945))
    with pytest.raises(ConfigError, match="parallel.tensor=2 does not divide model.ffn_hidden_size=18945"):
        plan_memory(odd_ffn, Layout(2, 1), cluster, scale, VllmConfig(), work)
    # The megatron rollout backend has no vLLM constraints and no vLLM memory.
    megatron_backend = Runtime(rollout_backend="megatron")
    plan = plan_memory(QWEN25_7B, Layout(2, 2), cluster, scale, VllmConfig(tensor_parallel=4), work, megatron_backend)
    assert plan.vllm_gb == plan.rollout_phase_gb == plan.weight_push_gb == 0


def test_7b_plan_term_by_term_hand_derived():
    """The default 7B layout (TP=2, DP=4, full recompute, micro-batch 1, s = 512 + 3072) on a GPU
    with Transformer Engine: what each part of the engine allocates, by hand."""
    # Per GPU: 28 layers x (233,050,624 sharded / 2 + 7,168 norms) + embedding and output layer
    # (152,064 x 3,584 / 2 each) + the final norm.
    params = 28 * (233_050_624 // 2 + 7_168) + 2 * 272_498_688 + 3_584
    assert params == 3_807_910_400
    plan = plan_memory(QWEN25_7B, Layout(2, 1, full_recompute=True), ClusterConfig(), ScaleConfig(),
                       VllmConfig(tensor_parallel=2), _work(), Runtime())
    gb = 1e9
    assert plan.parameters_per_gpu == params
    assert plan.weights_gb * gb == pytest.approx(2 * params)       # bf16 weights
    assert plan.grads_gb * gb == pytest.approx(4 * params)         # DDP float32 gradient buffer
    assert plan.optimizer_gb * gb == pytest.approx(12 * params / 4)  # main params + Adam over DP=4
    assert plan.reference_gb * gb == pytest.approx(2 * params)     # beta > 0: pi_ref on the GPU
    # Full recomputation: 28 layer inputs (3,584 tokens x h, bf16) + one layer's activations
    # (4h + (4,608 qkv + 3,584 attention + 37,888 fc1 + 18,944 fc2) / 2 = 46,848 per token).
    assert plan.activations_gb * gb == pytest.approx(28 * 3584 * 3584 * 2 + 46_848 * 3584 * 2)
    # One micro-batch's logits [3,584 x 76,032] at 28 bytes + the output layer's bf16 input.
    assert plan.logits_gb * gb == pytest.approx(3584 * 76_032 * 28 + 3584 * 3584 * 2)
    assert plan.optimizer_step_transient_gb == 0  # FusedAdam
    assert plan.train_phase_gb * gb == pytest.approx(11 * params + 1_055_129_600 + 7_655_653_376 + 6e9)
    # Rollout: the optimizer and gradients offloaded; bf16 weights + reference + reserve stay; vLLM
    # takes 0.5 x 80 GB, which covers its weights plus the push of 3 x the 152,064 x 3,584 embedding.
    assert plan.weight_push_gb * gb == pytest.approx(3 * 152_064 * 3584 * 2)
    assert plan.rollout_phase_gb * gb == pytest.approx(4 * params + 6e9 + 40e9)
    kept = plan_memory(QWEN25_7B, Layout(2, 1, full_recompute=True), ClusterConfig(),
                       ScaleConfig(offload_optimizer_in_rollout=False), VllmConfig(tensor_parallel=2), _work(),
                       Runtime())
    assert kept.rollout_phase_gb * gb == pytest.approx((2 + 4 + 3 + 2) * params + 6e9 + 40e9)


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
    from tests.conversion import test_hf_qwen2

    model = dataclasses.replace(load_config([f"config={name}"]).model, extra={})
    assert model == model_config_from_hf(getattr(test_hf_qwen2, hf))


@pytest.mark.parametrize("baseline", ["grpo", "gspo"])
def test_baselines_reuse_the_scale_config(baseline):
    from quatro_nemo.engine.config import load_config

    config = load_config(["config=quatro_7b", f"algorithm={baseline}"])
    assert config.algorithm_name == baseline and config.rollout.max_new_tokens == 3072


def test_plan_memory_recipe_exit_codes(capsys, tmp_path):
    import json

    import plan_memory

    assert plan_memory.main(["config=quatro_7b"]) == 0
    assert "training phase" in capsys.readouterr().out
    assert plan_memory.main(["config=quatro_7b", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)  # what scripts/gpu_check.sh reads
    plan = plan_memory.plan_for_arguments(["config=quatro_7b"])
    assert figures["train_peak_allocated_gb"] == plan.train_peak_allocated_gb
    assert figures["train_phase_gb"] == pytest.approx(figures["train_peak_allocated_gb"] + figures["reserve_gb"])
    assert figures["peak_allocated_gb"] == max(plan.train_peak_allocated_gb, plan.rollout_phase_gb - plan.reserve_gb)
    half = plan.peak_allocated_gb / 2
    assert plan_memory.main(["config=quatro_7b", "--json", f"--measured-peak-gb={half}"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_over_planned"] == pytest.approx(0.5)
    # --json-file: the table on stdout and the same JSON in the file (gpu_check.sh's one call)
    json_file = tmp_path / "plan.json"
    assert plan_memory.main(["config=quatro_7b", f"--json-file={json_file}"]) == 0
    assert "training phase" in capsys.readouterr().out
    assert json.loads(json_file.read_text()) == figures
    assert plan_memory.main(["config=quatro_7b", f"--measured-peak-gb={half}"]) == 0
    assert "measured / planned = 0.50" in capsys.readouterr().out
    assert plan_memory.main(["config=quatro_7b", "--measured-peak-gb=lots"]) == 2
    assert "--measured-peak-gb=<number>" in capsys.readouterr().err
    assert plan_memory.main(["config=quatro_7b", "cluster.gpu_memory_gb=40"]) == 2
    assert "cluster.gpu_memory_gb=40" in capsys.readouterr().err


def test_an_explicit_kv_cache_sizes_the_engine_and_a_tied_model_is_pushed_untied():
    """vllm.kv_cache_memory_gb (what vLLM's CPU build needs): the engine takes its weights, that KV
    cache and its activation reserve. The engine's output layer is its own (a tied policy's
    embedding is pushed into it: quatro_nemo.engine.vllm_backend.write_engine_model_dir)."""
    tied = dataclasses.replace(QWEN25_1P5B, tie_embeddings=True)
    plan = plan_memory(tied, Layout(1, 1), ClusterConfig(), ScaleConfig(),
                       VllmConfig(kv_cache_memory_gb=3.0, activation_reserve_gb=2.0), _work(), Runtime())
    engine_weights = (total_parameter_count(tied) + 151_936 * 1_536) * 2   # + its own output layer, bf16
    assert plan.vllm_gb * 1e9 == pytest.approx(engine_weights + 3e9 + 2e9)
    assert plan.kv_cache_gb == pytest.approx(3.0)


def test_a_null_vocabulary_is_the_tasks_before_planning():
    """The CPU default's model.vocab_size is null (the task's tokenizer decides): the planner of a
    vllm run plans that vocabulary instead of failing in its divisibility checks."""
    from quatro_nemo.engine.config import load_config, memory_plan
    from quatro_nemo.engine.task import build_task

    cfg = load_config(["rollout.backend=vllm", "model=tiny_qwen2", "warmstart.enabled=false"])
    assert cfg.model.vocab_size is None
    trained = build_task(cfg).model_config(cfg.model)   # the model train() builds
    assert memory_plan(cfg).total_parameters == total_parameter_count(ModelShape.from_model_config(trained))
