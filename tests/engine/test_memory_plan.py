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
    def table(*args):
        state = training_state_bytes(*args)
        return state.weights, state.grads, state.optimizer

    assert table(2, False, 8) == (2, 4, 12)
    assert table(2, True, 8) == (2, 4, 12 / 8)
    assert table(4, False, 4) == (4, 4, 8)
    assert table(4, True, 4) == (4, 4, 8 / 4)
    # Adam's two float32 moments (8 bytes) come with the first step; a bf16 model's float32 main
    # parameters (4) with the optimizer; a float32 model has none.
    bf16 = training_state_bytes(2, True, 8)
    assert (bf16.main_params, bf16.adam, bf16.before_first_step) == (4 / 8, 8 / 8, 6 + 4 / 8)
    assert training_state_bytes(4, False, 1).main_params == 0


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


H100_TOTAL = 81_920 * 2**20   # the largest nvidia-smi total of an "80 GB" card (A100 80 GB; H100: 81,559 MiB)


def test_7b_plan_term_by_term_hand_derived():
    """The default 7B layout (TP=2, DP=4, full recompute, micro-batch 1, s = 512 + 3072) on a GPU
    with Transformer Engine: what each part of the engine allocates, by hand, and each phase."""
    # Per GPU: 28 layers x (233,050,624 sharded / 2 + 7,168 norms) + embedding and output layer
    # (152,064 x 3,584 / 2 each) + the final norm.
    params = 28 * (233_050_624 // 2 + 7_168) + 2 * 272_498_688 + 3_584
    assert params == 3_807_910_400
    plan = plan_memory(QWEN25_7B, Layout(2, 1, full_recompute=True), ClusterConfig(), ScaleConfig(),
                       VllmConfig(tensor_parallel=2), _work(eval_problems=500, eval_samples=16), Runtime())
    gb = 1e9
    assert plan.parameters_per_gpu == params
    assert plan.weights_gb * gb == pytest.approx(2 * params)       # bf16 weights
    assert plan.grads_gb * gb == pytest.approx(4 * params)         # DDP float32 gradient buffer
    assert plan.optimizer_gb * gb == pytest.approx(12 * params / 4)  # main params + Adam over DP=4
    assert plan.adam_moments_gb * gb == pytest.approx(8 * params / 4)
    assert plan.reference_gb * gb == pytest.approx(2 * params)     # beta > 0: pi_ref on the GPU
    # Full recomputation: 28 layer inputs (3,584 tokens x h, bf16) + one layer's activations
    # (4h + (4,608 qkv + 3,584 attention + 37,888 fc1 + 18,944 fc2) / 2 = 46,848 per token).
    layer = 46_848 * 3584 * 2
    assert plan.activations_gb * gb == pytest.approx(28 * 3584 * 3584 * 2 + layer)
    # One micro-batch's logits [3,584 x 76,032] at 16 bytes (the loss's forward: the entropy's
    # gradient is never materialised, so the backward holds 8) + the output layer's bf16 input; a
    # forward-only pass holds 16 bytes too.
    output_input = 3584 * 3584 * 2
    assert plan.logits_gb * gb == pytest.approx(3584 * 76_032 * 16 + output_input)
    assert plan.logprob_forward_gb * gb == pytest.approx(3584 * 76_032 * 16 + output_input + layer)
    assert plan.optimizer_step_transient_gb == 0  # FusedAdam
    # vLLM asleep keeps vllm.sleep_residual_gb (2) while the trainer works; awake it takes half
    # of the device's own total (81,920 MiB), not of the nominal 80 GB.
    assert plan.vllm_while_training_gb == 2.0
    assert plan.vllm_gb * gb == pytest.approx(0.5 * H100_TOTAL)
    assert plan.train_phase_gb * gb == pytest.approx(11 * params + 1_055_129_600 + 4_385_669_120 + 2e9 + 6e9)
    # Rollout: the optimizer and gradients offloaded; bf16 weights + reference + reserve stay; vLLM's
    # share covers its weights plus the push of 3 x the 152,064 x 3,584 embedding.
    assert plan.weight_push_gb * gb == pytest.approx(3 * 152_064 * 3584 * 2)
    assert plan.rollout_phase_gb * gb == pytest.approx(4 * params + 6e9 + 0.5 * H100_TOTAL)
    # The other phases, each over its own state (memory_phases module doc):
    between = 2 * params + 2e9 + 6e9   # pi_ref, vLLM asleep, reserve
    fresh = 2 * params + 4 * params + 4 * params / 4   # weights, gradients, main params (no Adam moments yet)
    full = fresh + 8 * params / 4
    engine_build = 2 * params + 0.5 * H100_TOTAL + 6e9   # the engine is built beside the policy's weights
    load = 28 * 2 * 18_944 * 3584 // 2 * 2   # every layer's SwiGLU fc1 put back together by torch.cat
    expected = {"startup": max(fresh + between, engine_build), "resume": full + between + load,
                "rollout": plan.rollout_phase_gb * gb, "train": plan.train_phase_gb * gb,
                "eval": max(plan.rollout_phase_gb * gb, full + between + plan.logprob_forward_gb * gb),
                "save": full + between}
    assert list(plan.phases) == list(expected)
    for name, value in expected.items():
        assert plan.phases[name] * gb == pytest.approx(value), name
    assert plan.load_transient_gb * gb == load == 3_802_136_576
    # The host during a save: each rank writes 1/4 of its shard's optimizer state (12 P) and
    # weights (2 P) plus one largest tensor (the output layer's shard), staged in pinned memory
    # (x2 at most), beside the optimizer state kept on the host (12 P / 4) and 10 GB of process.
    written = 14 * params / 4 + 272_498_688 * 2
    assert plan.checkpoint_written_gb_per_rank * gb == pytest.approx(written)
    assert plan.host_save_gb_per_rank * gb == pytest.approx(3 * params + 2 * written + 10e9)
    assert plan.host_save_gb_per_node == pytest.approx(8 * plan.host_save_gb_per_rank)
    kept = plan_memory(QWEN25_7B, Layout(2, 1, full_recompute=True), ClusterConfig(),
                       ScaleConfig(offload_optimizer_in_rollout=False), VllmConfig(tensor_parallel=2), _work(),
                       Runtime())
    assert kept.rollout_phase_gb * gb == pytest.approx((2 + 4 + 3 + 2) * params + 6e9 + 0.5 * H100_TOTAL)
    assert kept.host_offload_gb_per_rank == 0


def test_an_engine_awake_at_start_up_cannot_resume_7b_on_one_node():
    """Without sleep mode the engine holds its whole share while a resume allocates Adam's moments
    and loads (the first requeue of a 1-node 7B run, issue 38): refused, naming the fix."""
    awake = plan_memory(QWEN25_7B, Layout(2, 1, full_recompute=True), ClusterConfig(), ScaleConfig(),
                        VllmConfig(tensor_parallel=2, sleep_between_phases=False), _work(), Runtime())
    assert awake.vllm_while_training_gb == awake.vllm_gb
    assert awake.phases["resume"] > 80 >= awake.phases["rollout"]
    with pytest.raises(ConfigError, match=r"the resume phase needs 9\d\.\d GB per GPU > cluster.gpu_memory_gb=80 .*"
                                          r"vllm.sleep_between_phases=true"):
        check_plan(awake)


def test_vllm_takes_its_share_of_the_devices_own_total():
    """vLLM multiplies the device's total (torch's, nvidia-smi's MiB), not the nominal size: the
    known total of an 80 GB card, or cluster.gpu_total_mib; a size without a known total plans
    from it and says so."""
    def engine(**cluster):
        return plan_memory(QWEN25_7B, Layout(2, 1, True), ClusterConfig(**cluster), ScaleConfig(),
                           VllmConfig(tensor_parallel=2), _work(), Runtime())

    assert engine().vllm_gb * 1e9 == pytest.approx(0.5 * 81_920 * 2**20)
    assert engine().device_total_gb == pytest.approx(85.899345920)
    assert engine(gpu_total_mib=81_559).vllm_gb * 1e9 == pytest.approx(0.5 * 81_559 * 2**20)   # an H100
    odd = engine(gpu_memory_gb=85)
    assert odd.vllm_gb == pytest.approx(0.5 * 85)
    assert any("cluster.gpu_total_mib" in note for note in odd.notes)
    with pytest.raises(ConfigError, match="cluster.gpu_total_mib must be > 0"):
        ClusterConfig(gpu_total_mib=0)


def test_a_save_that_does_not_fit_the_hosts_memory_is_refused():
    plan = plan_memory(QWEN25_7B, Layout(2, 1, True), ClusterConfig(host_memory_gb=300), ScaleConfig(),
                       VllmConfig(tensor_parallel=2), _work(), Runtime())
    assert plan.host_save_gb_per_node > 300
    with pytest.raises(ConfigError, match=r"checkpoint save needs \d+ GB of host memory per node > "
                                          r"cluster.host_memory_gb=300 .*raise cluster.nodes"):
        check_plan(plan)
    four_nodes = plan_memory(QWEN25_7B, Layout(2, 1, True), ClusterConfig(nodes=4, host_memory_gb=300), ScaleConfig(),
                             VllmConfig(tensor_parallel=2), _work(), Runtime())
    assert check_plan(four_nodes).host_save_gb_per_node < 300   # smaller shards per rank


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
    assert plan_for_arguments([f"config={name}"]).world_size == 8   # fits: next test


@pytest.mark.parametrize("name", ["quatro_1p5b", "quatro_coder_1p5b", "quatro_7b"])
@pytest.mark.parametrize("runtime", ["the training image", "this machine"])
def test_scale_configs_fit_every_phase_at_their_node_count_with_the_planners_max_num_seqs(name, runtime):
    """Every phase of the shipped configs fits their GPUs and the host at the configs' own node
    count, in the training image (Transformer Engine, FusedAdam) and with this machine's packages
    (what recipes/train.py checks here), and vllm.max_num_seqs is the planner's."""
    from quatro_nemo.engine.config import load_config, memory_plan
    from quatro_nemo.engine.memory_plan import plan_run

    config = load_config([f"config={name}"])
    plan = plan_run(config, Runtime()) if runtime == "the training image" else memory_plan(config)
    assert set(plan.phases) == {"startup", "resume", "rollout", "train", "eval", "save"}
    assert all(0 < needed <= config.cluster.gpu_memory_gb for needed in plan.phases.values()), plan.phases
    assert plan.host_save_gb_per_node <= config.cluster.host_memory_gb
    assert config.vllm.max_num_seqs == plan.proposed_max_num_seqs >= 1


def _template(name):
    """(config name, #SBATCH --nodes, the USR1 lead of #SBATCH --signal) of slurm/<name>."""
    import re

    text = open(os.path.join(ROOT, "slurm", name)).read()
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", text, re.MULTILINE)
    lead = re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.MULTILINE)
    config = re.search(r"^quatro_run_recipe train run.dir config=(\w+) ", text, re.MULTILINE)
    assert nodes and lead and config, name
    return config.group(1), int(nodes.group(1)), int(lead.group(1))


@pytest.mark.parametrize("template", ["quatro_7b.sh", "quatro_1p5b.sh"])
def test_slurm_templates_signal_the_ranks_early_enough_for_a_step_an_evaluation_and_a_save(template):
    """#SBATCH --signal=B:USR1@N leaves the seconds the planner estimates for a step, a held-out
    evaluation and a checkpoint save of the template's config at the template's node count."""
    from quatro_nemo.engine.config import load_config
    from quatro_nemo.engine.memory_plan import plan_run

    config_name, nodes, lead = _template(template)
    plan = plan_run(load_config([f"config={config_name}", f"cluster.nodes={nodes}"]), Runtime())
    assert plan.preemption_lead_seconds == pytest.approx(plan.step_seconds + plan.eval_seconds + plan.save_seconds)
    assert 0 < plan.preemption_lead_seconds <= lead, (template, plan.phase_seconds)


def test_phase_seconds_hand_derived():
    """phase_times: decoding reads the engine's weights and its running sequences' KV cache at
    full length per step; prefill, training and the entropy pass are compute at the assumed MFU;
    a save is a node's bytes at its write bandwidth."""
    from quatro_nemo.engine.phase_times import (EngineRates, PhaseSeconds, compute_seconds, preemption_line,
                                                sampling_seconds, save_seconds)

    cluster = ClusterConfig(gpus_per_node=4, peak_tflops=100.0, assumed_mfu=0.5, memory_bandwidth_tb_s=2.0,
                            assumed_mbu=0.5, checkpoint_write_gb_s=2.0)
    assert compute_seconds(4e15, 8, cluster) == pytest.approx(4e15 / (8 * 50e12))
    engine = EngineRates(weight_bytes=1e9, kv_bytes_per_token=1e3, parameters=2e9, tensor_parallel=2, max_concurrent=10)
    # 25 sequences of 100 + 50 tokens, 10 at once: 3 waves of 50 decode steps, each reading
    # 1e9 + 10 x 150 x 1e3 bytes at 1e12 B/s; prefill 2 x 2e9 x 25 x 100 FLOPs on 2 GPUs.
    decode = 3 * 50 * (1e9 + 10 * 150 * 1e3) / 1e12
    prefill = 2 * 2e9 * 25 * 100 / (2 * 50e12)
    assert sampling_seconds(engine, 25, 100, 50, cluster) == pytest.approx(decode + prefill)
    assert sampling_seconds(engine, 0, 100, 50, cluster) == 0
    assert save_seconds(5e9, cluster) == pytest.approx(4 * 5e9 / 2e9)
    seconds = PhaseSeconds(rollout=100.0, train=200.0, eval=150.0, save=50.0)
    assert seconds.preemption_lead == 500
    assert preemption_line(seconds, 600) == ("preemption: this run needs ~500 s after USR1 (step 300 + eval 150 "
                                             "+ save 50); the template gives 600")
    assert preemption_line(seconds, 300).endswith("the template gives 300 (too short: raise #SBATCH --signal="
                                                  "B:USR1@N, or the checkpoint may be cut off)")
    assert "no SLURM template's --signal lead is known here" in preemption_line(seconds, None)


def test_the_start_up_line_plans_the_world_the_run_got():
    """preemption_lead.preemption_report: the planned run's need at its real world size (the
    template's #SBATCH --nodes does not reach cluster.nodes) next to the template's lead from
    the environment; nothing for a run the planner does not plan."""
    from quatro_nemo.engine.config import load_config, memory_plan
    from quatro_nemo.engine.preemption_lead import USR1_LEAD_ENV, preemption_report

    config = load_config(["config=quatro_7b"])
    four_nodes = memory_plan(load_config(["config=quatro_7b", "cluster.nodes=4"]))
    line = preemption_report(config, 32, {USR1_LEAD_ENV: "900"})
    assert line == (f"preemption: this run needs ~{four_nodes.preemption_lead_seconds:.0f} s after USR1 "
                    f"(step {four_nodes.step_seconds:.0f} + eval {four_nodes.eval_seconds:.0f} + save "
                    f"{four_nodes.save_seconds:.0f}); the template gives 900")
    assert preemption_report(config, 8, {}).endswith("no SLURM template's --signal lead is known here")
    assert preemption_report(load_config([]), 1, {USR1_LEAD_ENV: "900"}) is None   # the CPU default


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
    table = capsys.readouterr().out
    for phase in ("start-up", "resume", "rollout", "training", "held-out evaluation", "checkpoint save",
                  "host per node during a save", "preemption lead"):
        assert f"= {phase}" in table or phase in table, phase
    assert plan_memory.main(["config=quatro_7b", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)  # what scripts/gpu_check.sh reads
    plan = plan_memory.plan_for_arguments(["config=quatro_7b"])
    assert figures["train_peak_allocated_gb"] == plan.train_peak_allocated_gb
    assert figures["train_phase_gb"] == pytest.approx(figures["train_peak_allocated_gb"] + figures["reserve_gb"])
    assert figures["peak_allocated_gb"] == pytest.approx(max(plan.phases.values()) - plan.reserve_gb)
    # what scripts/gpu_check_report.py compares measured per-phase peaks with: GB per GPU of each phase
    assert set(figures["phases"]) == {"startup", "resume", "rollout", "train", "eval", "save"}
    assert figures["phases"]["train"] == figures["train_phase_gb"]
    assert figures["phases"]["rollout"] == figures["rollout_phase_gb"]
    assert figures["host_save_gb_per_node"] == pytest.approx(8 * figures["host_save_gb_per_rank"])
    half = plan.peak_allocated_gb / 2
    assert plan_memory.main(["config=quatro_7b", "--json", f"--measured-peak-gb={half}"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_over_planned"] == pytest.approx(0.5)
    # --json-file: the table on stdout and the same JSON in the file (gpu_check.sh's one call)
    json_file = tmp_path / "plan.json"
    assert plan_memory.main(["config=quatro_7b", f"--json-file={json_file}"]) == 0
    assert "= training" in capsys.readouterr().out
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
